"""A model reference that does not resolve is one line naming the flag at fault, and its example uses that flag (issue
37, point 24: `areno train` was told to pass --model-path, which only `areno serve` takes)."""

import pytest

from areno.cli import main


@pytest.fixture
def unreachable_hub(monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("we are offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)


@pytest.mark.parametrize("argv,flag", [
    (["train", "--ckpt", "nobody/no-such-model", "--dataset-path", "d.jsonl", "--algo", "sft"], "--ckpt"),
    (["train", "--ckpt", "{folder}", "--ref-ckpt", "nobody/no-such-model", "--dataset-path", "d.jsonl", "--algo",
      "dpo"], "--ref-ckpt"),
    (["serve", "--model-path", "nobody/no-such-model"], "--model-path"),
])
def test_an_unresolvable_model_names_its_own_flag(argv, flag, unreachable_hub, tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')  # a --ckpt folder the checks accept
    with pytest.raises(SystemExit) as e:
        main([a.format(folder=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: {flag} could not resolve model 'nobody/no-such-model'" in err
    assert f"e.g. {flag} /path/to/model" in err
    others = {"--ckpt", "--ref-ckpt", "--model-path"} - {flag}
    assert not any(f"{other} /path" in err for other in others), err
    assert len(err.strip().splitlines()) == 2  # usage + one line

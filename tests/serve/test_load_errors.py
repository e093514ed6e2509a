"""`areno serve` on a model that will not load (corrupt weights, a config that does not match them, a folder whose
tokenizer file is cut short) ends with one line naming --model-path and exit code 2, never a raw traceback."""

import json
import shutil

import pytest

from areno.cli import main


def _corrupt_weights(folder):
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])  # cut mid-header


def _wrong_config(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_size"] = cfg["hidden_size"] + 32  # the weights no longer fit the config
    (folder / "config.json").write_text(json.dumps(cfg))


def _cut_tokenizer(folder):
    tokenizer = folder / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes()[:5000])  # a copy cut short


@pytest.mark.parametrize("spoil, extra", [
    (_corrupt_weights, []),  # the default engine-core process: its failure crosses a process boundary
    (_wrong_config, ["--engine-thread"]),
    (_cut_tokenizer, ["--engine-thread"]),
], ids=["corrupt-weights", "wrong-config", "cut-tokenizer"])
def test_a_model_that_does_not_load_is_one_line_and_exit_2(tiny_ckpt, tmp_path, capsys, spoil, extra):
    folder = tmp_path / "model"
    shutil.copytree(tiny_ckpt, folder)
    spoil(folder)
    rc = main(["serve", "--model-path", str(folder), "--port", "0", "--dtype", "float32", *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith(f"areno serve: error: --model-path {folder} could not be loaded: "), err
    assert len(lines[-1]) < 600


def test_a_flag_the_replicas_engine_refuses_is_named_as_in_process(tiny_ckpt, capsys, monkeypatch):
    """A ConfigError raised while the engine-core process builds its engine crosses the process boundary as itself:
    the same one line naming the refused flag (not --model-path) and exit 2 as `--engine-thread` gives."""

    def no_server(*a, **k):
        raise AssertionError("the engine was built: the flag was not refused")

    monkeypatch.setattr("areno.serve.server._make_server", no_server)
    line = "areno serve: error: --mamba-ssm-cache-dtype bfloat16 applies only to hybrid models"
    for extra in ([], ["--engine-thread"]):
        rc = main(["serve", "--model-path", str(tiny_ckpt), "--port", "0", "--dtype", "float32",
                   "--mamba-ssm-cache-dtype", "bfloat16", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err, err
        assert [ln for ln in err.splitlines() if ln.strip()][-1].startswith(line), (extra, err)

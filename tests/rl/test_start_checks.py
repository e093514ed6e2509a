"""Bad data and checkpoints give one line at start, not a traceback mid-run (issue 37, points 15, 16 and 24's
``_row``): a prompt + --max-new-tokens budget past the model's context, SFT rows past it (dropped and counted), a
checkpoint whose weights do not match its config or are cut short, a dataset line that is a JSON string, and the
wrong-fields error showing only the user's own fields."""

import json
import shutil
from types import SimpleNamespace

import pytest

from areno.cli import main
from areno.config import ConfigError
from areno.rl import setup
from areno.testing import make_tiny_checkpoint

CONTEXT = 64  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("start")
    make_tiny_checkpoint(root / "ckpt", family="qwen3", seed=0, max_position_embeddings=CONTEXT)
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(8)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text("def reward_fn(record):\n    return float(len(record.completion) % 2)\n")
    return root


def run(capsys, monkeypatch, files, *extra, data="data.jsonl", ckpt="ckpt"):
    monkeypatch.chdir(files)
    argv = ["train", "--ckpt", str(files / ckpt), "--dataset-path", str(files / data), "--batch-size", "4",
            "--mini-bs", "2", "--max-steps", "1", "--no-tensorboard", "--dtype", "float32", *extra]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, err.strip().splitlines()[-1] if err.strip() else ""


def test_prompt_plus_new_tokens_past_the_context_is_refused_at_start(files, capsys, monkeypatch, tmp_path):
    # before: the run started and crashed in its first rollout with IndexError: index 64 is out of bounds
    code, line = run(capsys, monkeypatch, files, "--reward-fn-path", str(files / "reward.py"), "--n-samples", "2",
                     "--max-prompt-tokens", "40", "--max-new-tokens", "30", "--save-path", str(tmp_path / "out"))
    assert code == 2
    assert line == (f"areno train: error: --max-new-tokens 30 + --max-prompt-tokens 40 = 70 tokens is more than the "
                    f"model's context (64 tokens: max_position_embeddings of {files / 'ckpt'}); lower one of them")
    assert not list((tmp_path / "out").glob("step-*"))


def test_sft_rows_past_the_context_are_dropped_counted_and_the_run_finishes(files, capsys, monkeypatch, caplog):
    # before: an SFT row whose prompt + response passed the context crashed the step (IndexError in the rope table)
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "response": "2 " * (4 + 12 * (i % 4))}
            for i in range(8)]
    (files / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING", logger="areno.train"):
        code, _ = run(capsys, monkeypatch, files, "--algo", "sft", "--max-prompt-tokens", "40", data="sft.jsonl")
    assert code == 0
    assert "dropped 4 of 8 rows (not truncated): 4 whose prompt + response is longer than the model's context " \
           "(64 tokens)" in caplog.text


def test_sft_warmup_rows_past_the_context_are_dropped_too(files, capsys, monkeypatch, caplog):
    # before: --sft-warmup-steps tokenized the responses itself, without any bound, and crashed the same way
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "response": "2 " * (4 + 12 * (i % 4)), "answer": "2"}
            for i in range(8)]
    (files / "warm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING", logger="areno.train"):
        code, _ = run(capsys, monkeypatch, files, "--reward-fn-path", str(files / "reward.py"), "--n-samples", "2",
                      "--max-prompt-tokens", "40", "--max-new-tokens", "8", "--sft-warmup-steps", "1",
                      data="warm.jsonl")
    assert code == 0
    assert "dropped 4 of 8 --sft-warmup-steps rows (not truncated): 4 whose prompt + response is longer than the " \
           "model's context (64 tokens)" in caplog.text


def test_the_context_check_applies_where_the_run_samples():
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=CONTEXT))
    inputs = SimpleNamespace(eval_rows=[], reward_fn=None, agent_fn=None)

    def cfg(**kw):
        return SimpleNamespace(**{"algo": "grpo", "split": False, "ckpt": "m", "max_prompt_tokens": 40,
                                  "max_new_tokens": 24, "max_context_len": None, **kw})

    assert setup.check_context(cfg(), model, inputs) == CONTEXT  # 40 + 24 fits exactly
    with pytest.raises(ConfigError, match="^--max-new-tokens 25 "):
        setup.check_context(cfg(max_new_tokens=25), model, inputs)
    setup.check_context(cfg(algo="sft", max_new_tokens=1024), model, inputs)  # SFT without evaluation: no sampling
    held_out = SimpleNamespace(eval_rows=[(0, {})], reward_fn=len, agent_fn=None)
    with pytest.raises(ConfigError, match="^--max-new-tokens"):  # ... but its held-out accuracy is sampled
        setup.check_context(cfg(algo="sft", max_new_tokens=1024), model, held_out)
    agent = SimpleNamespace(eval_rows=[], reward_fn=None, agent_fn=len)
    with pytest.raises(ConfigError, match=r"^--max-context-len 65 is more than the model's context \(64 tokens"):
        setup.check_context(cfg(max_context_len=65), model, agent)


@pytest.mark.parametrize("damage", ["config", "weights", "json"])
def test_a_checkpoint_that_cannot_load_is_one_line_exit_2(files, capsys, monkeypatch, tmp_path, damage):
    bad = tmp_path / "bad"
    shutil.copytree(files / "ckpt", bad)
    if damage == "config":  # weights made for another config: a RuntimeError traceback before
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    elif damage == "weights":  # cut short: safetensors' own error as a traceback before
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    else:  # a JSONDecodeError traceback from the CLI's model check before
        (bad / "config.json").write_text('{"model_type": "qwen3",')
    code, line = run(capsys, monkeypatch, files, "--reward-fn-path", str(files / "reward.py"), "--n-samples", "2",
                     "--max-prompt-tokens", "40", "--max-new-tokens", "8", ckpt=str(bad))
    assert code == 2 and line.startswith(f"areno train: error: --ckpt '{bad}' cannot be loaded: ")
    assert {"config": "config.json does not match the weights", "weights": "model.safetensors is not a readable "
            "safetensors file", "json": "config.json is not valid JSON"}[damage] in line


def test_a_json_string_line_is_one_line_exit_2(files, capsys, monkeypatch):
    # before: AttributeError: 'str' object has no attribute 'get' from the loop's split filter
    lines = (files / "data.jsonl").read_text().splitlines()
    (files / "strings.jsonl").write_text("\n".join(lines[:2] + ['"what is 2+2?"'] + lines[2:]) + "\n")
    code, line = run(capsys, monkeypatch, files, "--reward-fn-path", str(files / "reward.py"), data="strings.jsonl")
    assert code == 2
    assert line.startswith(f"areno train: error: --dataset-path: {files / 'strings.jsonl'} line 3 is a JSON string")


def test_the_wrong_fields_error_shows_only_the_users_fields(files, capsys, monkeypatch):
    rows = [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4", "split": "test"}]
    (files / "fields.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, line = run(capsys, monkeypatch, files, "--reward-fn-path", str(files / "reward.py"), data="fields.jsonl")
    assert code == 2
    assert "row 0 has no 'prompt' key (its keys: question, answer);" in line and "_row" not in line

"""`areno train --preset agentic-quickstart`: the task's rows, tool and episode reward, the preset's configuration,
and a shortened run of the real command in which the reward rises and held-out success (evaluated through the
agent) gains at least 20 points. The full preset's figures are in the README (measured once, on two CPU cores)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from areno import presets
from areno.cli import make_parser, parse_config
from areno.config import TrainConfig
from areno.engine.tool_calls import parse_tool_calls
from areno.quickstart import agentic
from areno.quickstart import agentic_task as task

ROOT = Path(__file__).resolve().parents[2]
# The shortened run (about two minutes on two CPU cores): 3-digit operands (shorter rows), fewer rows, 130 SFT steps
# (enough for the copying to set in), 4 RL steps at twice the preset's RL learning rate, 50 held-out problems.
SHORT = ["--sft-warmup-steps", "130", "--max-steps", "4", "--lr", "2e-3", "--dataset-path",
         "n_train=3000,n_eval=50,digits=3", "--eval-interval", "0"]


def operands(row) -> tuple[int, int]:
    a, b = row["prompt"][1]["content"].rstrip("=").split("+")
    return int(a), int(b)


def test_rows_one_per_assistant_turn_from_a_teacher_who_skips_the_tool():
    rows = task.load_training_dataset("n_train=2000,n_eval=50")
    first = [r for r in rows if len(r["prompt"]) == 2 and r.get("split") != "test"]
    answer = [r for r in rows if len(r["prompt"]) == 4]
    held_out = [r for r in rows if r.get("split") == "test"]
    assert len(first) == 2000 and len(held_out) == 50 and len(first) + len(answer) + len(held_out) == len(rows)
    assert 0.45 < len(answer) / len(first) < 0.55
    assert not {operands(r) for r in first} & {operands(r) for r in held_out}
    skipped = 0
    for r in first + held_out:
        a, b = operands(r)
        assert r["answer"] == str(a + b) and len(str(a)) == len(str(b)) == len(r["answer"]) == 7
        assert r["prompt"][0] == {"role": "system", "content": task.SYSTEM}
        if "response" not in r:
            continue
        content, calls = parse_tool_calls(r["response"])
        if calls:  # a correct call, exactly as the endpoint parses it
            assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": a, "b": b})]
        else:
            skipped += 1
            assert r["response"].startswith("about ") and r["response"] != f"about {a + b}"
    assert 0.65 < skipped / len(first) < 0.75
    assert all("response" not in r for r in held_out)
    for r in answer:  # the conversation up to the tool's result, answered with that result
        a, b = operands(r)
        assert r["prompt"][3] == {"role": "tool", "tool_call_id": "call_add", "content": str(a + b)}
        assert r["response"] == r["answer"] == str(a + b)
    assert rows == task.load_training_dataset("n_train=2000,n_eval=50")  # deterministic
    with pytest.raises(ValueError, match="keys"):
        task.parse_spec("digit=3")
    with pytest.raises(ValueError, match="teacher_skips"):
        task.generate(teacher_skips=1.5)


def test_an_answer_rows_prompt_renders_as_the_episode_does(tmp_path):
    """The warm-up's answer-turn prompt is token for token what the agent's session holds before the answer: the
    first turn's prompt, the call as sampled, the end of turn and the template's rendering of the tool result."""
    from transformers import AutoTokenizer

    from areno.testing.tokenizer import write_tokenizer_files

    write_tokenizer_files(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    a, b = 3821733, 1930566

    def ids(text):
        return tok.encode(text, add_special_tokens=False)

    first = tok.apply_chat_template(task.prompt(a, b), tokenize=False, add_generation_prompt=True)
    after = tok.apply_chat_template(task.after_tool(a, b), tokenize=False, add_generation_prompt=True)
    sampled = ids(first) + ids(task.tool_call_text(a, b)) + [tok.eos_token_id]
    prefix = first + task.tool_call_text(a, b) + tok.eos_token
    assert after.startswith(prefix) and ids(after) == sampled + ids(after[len(prefix):])
    assert "<tool_response>\n5752299\n</tool_response>" in after


def test_the_tool_and_the_episode_reward():
    assert task.add('{"a": 4821733, "b": 1930566}') == "6752299"
    assert task.add({"a": "12", "b": 30}) == "42"
    for bad in ('{"a": 1}', '{"a": 1, "b": 2, "c": 3}', '{"a": 1.5, "b": 2}', '{"a": true, "b": 2}', "{nope", "[1, 2]"):
        assert task.add(bad).startswith("error: "), bad
    assert task.run_tool("sub", "{}").startswith("error: unknown tool")
    call = {"role": "assistant", "content": "", "tool_calls": [task.tool_call(1, 2)]}
    tool = {"role": "tool", "tool_call_id": "call_add", "content": "3"}
    assert task.episode_reward([call, tool, {"role": "assistant", "content": "3"}], "3") == 1.0
    assert task.episode_reward([call, tool, {"role": "assistant", "content": "The sum is 3"}], "3") == 1.0
    assert task.episode_reward([call, tool, {"role": "assistant", "content": "33"}], "3") == 0.0
    assert task.episode_reward([call, tool], "3") == 0.0  # no answer after the tool
    assert task.episode_reward([call], "3") == 0.0  # still calling
    assert task.episode_reward([{"role": "assistant", "content": "about 6800000"}], "6752299") == 0.0
    assert task.episode_reward([], "3") == 0.0


def test_the_preset(areno_home):
    parser = make_parser("train", TrainConfig)
    base = presets.get_preset("agentic-quickstart")
    assert "agentic-quickstart" in presets.preset_names() and "quickstart" in presets.preset_names()
    assert base.agent_fn == base.dataset_loader_fn == str(agentic.TASK) and base.reward_fn_path is None
    assert base.algo == "grpo" and base.sft_warmup_steps > 0 and base.max_steps > 0 and base.metrics_dir is None
    assert base.save_path == "runs/agentic-quickstart" and base.overwrite and base.dtype == "float32"
    # every row fits: an answer-turn prompt, a tool call in one reply, a whole episode in the context
    rows = task.load_training_dataset(None)
    longest = max(len(r["prompt"]) for r in rows)
    assert longest == 4 and base.max_prompt_tokens >= 100 and base.max_new_tokens >= 40
    # the model is created under $ARENO_HOME/agentic-quickstart, apart from the quickstart's
    assert Path(base.ckpt).parent == areno_home / "agentic-quickstart"
    assert (Path(base.ckpt) / "model.safetensors").exists() and agentic.MODEL_VERSION in base.ckpt
    cfg = parse_config(parser, TrainConfig, ["--preset", "agentic-quickstart", "--max-steps", "3", "--seed", "7",
                                             "--save-path", "/elsewhere/run"])
    assert (cfg.max_steps, cfg.seed) == (3, 7) and cfg.agent_fn == base.agent_fn
    assert cfg.metrics_folder == "/elsewhere/run/metrics" and cfg.sft_warmup_steps == base.sft_warmup_steps


def test_the_readme_quotes_the_preset(monkeypatch):
    """The README's paragraph names the command and the preset's numbers (SFT steps, RL steps, held-out problems)."""
    monkeypatch.setattr(agentic, "model_path", lambda: Path("model"))  # no model creation
    monkeypatch.setattr(agentic, "cpu_threads", lambda: None)  # leave this process's thread count alone
    cfg = presets.get_preset("agentic-quickstart")
    text = (ROOT / "README.md").read_text()
    start = text.index("## Quickstart")
    section = " ".join(text[start : text.index("\n## ", start + 1)].split())
    assert "areno train --preset agentic-quickstart" in section
    paragraph = section.split("areno train --preset agentic-quickstart", 1)[1]
    assert f"SFT warm-up ({cfg.sft_warmup_steps} steps)" in paragraph and f"{cfg.max_steps} GRPO steps" in paragraph
    assert f"{task.DEFAULTS['n_eval']} held-out problems" in paragraph


def test_agentic_quickstart_short_run(areno_home, tmp_path):
    """The preset through the real command, shortened: the reward rises and held-out success gains >= 20 points."""
    save, work = tmp_path / "run", tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "ARENO_HOME": str(areno_home), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "areno", "train", "--preset", "agentic-quickstart", "--save-path", str(save), *SHORT]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "held-out accuracy before RL" in out and os.listdir(work) == []
    records = [json.loads(line) for line in (save / "metrics" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records if r.get("reward_mean") is not None]
    assert len(rewards) == 4 and all(r.get("reward_failures", 0) == 0 for r in records), records
    assert rewards[-1] > rewards[0] and sum(rewards[-2:]) > sum(rewards[:2]), rewards
    final = records[-1]
    before, after = final["eval_accuracy_before"], final["eval_accuracy_after"]
    assert after >= before + 0.20, (before, after, rewards)
    assert (save / "step-4" / "model.safetensors").exists()

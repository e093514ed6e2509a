"""`areno train --preset quickstart` through the real command: the reward rises, held-out accuracy rises into the
ranges below (the README quotes them: tests/test_readme.py), metrics.jsonl and the reward-curve PNG are written under
--save-path, and the checkpoint loads in areno, transformers and the server.

The end-to-end test runs the README's own command (only --save-path added) on the default seed. The exact accuracy
varies with the CPU (the SFT stage's float rounding follows its math library: seed 0 has printed 66.5%, 68.5% and
76.0% before RL on three machines, 100.0% after), so the README quotes these ranges, not one machine's figures.
3 to 3.5 minutes of CPU on one core.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areno import presets
from areno.cli import make_parser, parse_config
from areno.config import TrainConfig
from areno.quickstart import task
from areno.training.metrics import eval_points

ROOT = Path(__file__).resolve().parents[2]
# Held-out accuracy (%) of the default seed that the end-to-end test accepts: before RL, after RL.
BEFORE_RL = (55.0, 85.0)
AFTER_RL = (90.0, 100.0)


def test_task_teacher_forgets_carries_and_the_reward_checks_the_true_sum():
    assert task.carry_forgotten(47, 85) == "122" and task.true_sum(47, 85) == "132"
    assert task.carry_forgotten(23, 19) == "32" and task.carry_forgotten(12, 34) == "46"
    rows = task.load_training_dataset("n_eval=50,teacher_error=0.6")
    train = [r for r in rows if r.get("split") != "eval"]
    held_out = [r for r in rows if r.get("split") == "eval"]
    assert len(held_out) == 50 and len(train) == 90 * 90 - 50
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in held_out}
    assert all(r["response"] == r["answer"] for r in held_out)
    carry = [r for r in train if task.carries(*map(int, r["prompt"][0]["content"][:-1].split("+")))]
    sloppy = sum(r["response"] != r["answer"] for r in carry) / len(carry)
    assert 0.55 < sloppy < 0.65 and all(r["response"] == r["answer"] for r in train if r not in carry)
    assert rows == task.load_training_dataset("n_eval=50,teacher_error=0.6")  # deterministic
    assert task.reward_fn({"completion": " 132\n", "answer": "132"}) == 1.0
    assert task.reward_fn({"completion": "122", "answer": "132"}) == 0.0
    with pytest.raises(ValueError, match="keys"):
        task.parse_spec("digit=3")


def test_flags_override_the_quickstart_preset(areno_home):
    parser = make_parser("train", TrainConfig)
    cfg = parse_config(parser, TrainConfig, ["--preset", "quickstart", "--max-steps", "3", "--seed", "7"])
    base = presets.get_preset("quickstart")
    assert (cfg.max_steps, cfg.seed) == (3, 7) and (base.max_steps, base.seed) != (3, 7)
    assert cfg.preset == "quickstart" and cfg.algo == "grpo" and cfg.sft_warmup_steps == base.sft_warmup_steps
    assert Path(cfg.ckpt).parent == areno_home / "quickstart" and (Path(cfg.ckpt) / "model.safetensors").exists()
    assert "quickstart" in presets.preset_names()


def test_metrics_follow_the_save_path(areno_home):
    """The preset names no metrics folder: it follows --save-path (<save path>/metrics), never ./runs/quickstart when
    the run is saved elsewhere; an explicit --metrics-dir still wins."""
    parser = make_parser("train", TrainConfig)

    def folder(*argv):
        return parse_config(parser, TrainConfig, ["--preset", "quickstart", *argv]).metrics_folder

    assert presets.get_preset("quickstart").metrics_dir is None
    assert folder() == os.path.join("runs/quickstart", "metrics")
    assert folder("--save-path", "/elsewhere/run") == "/elsewhere/run/metrics"
    assert folder("--save-path", "/elsewhere/run", "--metrics-dir", "/m") == "/m"


def test_quickstart_end_to_end(quickstart_home, tmp_path):
    """The README's command as it runs (CPU, the default seed), with only --save-path added (its SFT warm-up may come
    from the cache of another quickstart run of the session: the same bits)."""
    save, work = tmp_path / "run", tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "ARENO_HOME": str(quickstart_home), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "areno", "train", "--preset", "quickstart", "--save-path", str(save)]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "resolved configuration" in out and "held-out accuracy: before RL" in out
    assert os.listdir(work) == [], "the run wrote into the working folder (./runs) although --save-path is elsewhere"

    metrics = save / "metrics"
    rl_steps = presets.get_preset("quickstart").max_steps
    records = [json.loads(line) for line in (metrics / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in records if r.get("reward_mean") is not None]
    assert len(rewards) == rl_steps
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    final = records[-1]
    before, after = round(100 * final["eval_accuracy_before"], 1), round(100 * final["eval_accuracy_after"], 1)
    assert last > first and after >= before + 5, (rewards, before, after)
    png = metrics / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the plot carries the headline: before RL at step 0, every evaluation, after RL at the last step
    points = eval_points(records)
    every = presets.get_preset("quickstart").eval_interval
    assert points[0] == (0, final["eval_accuracy_before"]) and points[-1] == (rl_steps, final["eval_accuracy_after"])
    assert [x for x, _ in points[1:-1]] == list(range(every, rl_steps, every))
    assert "matplotlib" not in out, out[-2000:]
    # the ranges the README quotes
    assert BEFORE_RL[0] <= before <= BEFORE_RL[1] and AFTER_RL[0] <= after <= AFTER_RL[1], (
        f"the quickstart now prints {before:.1f}% -> {after:.1f}%, outside {BEFORE_RL} -> {AFTER_RL}: if the change "
        "is intended, measure again and update these ranges and the README's")

    ckpt = save / f"step-{rl_steps}"
    from areno.models import load_model

    model = load_model(str(ckpt), dtype=torch.float32, device=torch.device("cpu"))
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    text = tok.apply_chat_template([{"role": "user", "content": "47+85="}], add_generation_prompt=True,
                                   tokenize=False)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids)[0, -1], hf(ids).logits[0, -1].float(), atol=1e-3, rtol=1e-3)

    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from tests.serve.conftest import RunningServer

    server = RunningServer(ckpt)
    try:
        reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "47+85="}], "max_tokens": 6,
            "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"].strip().isdigit()
    finally:
        server.stop()

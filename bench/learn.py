"""Proof of learning on the GPU: a model trained from scratch with SFT on three-digit addition demonstrated by a
sloppy teacher, then GRPO and GSPO (each from the SFT checkpoint) against the exact-sum verifier.

    python bench/learn.py              # H200: ~20M-parameter qwen3, about 4 minutes
    python bench/learn.py --smoke      # CPU: tiny model, a few steps (checks the script; numbers meaningless)
    python bench/learn.py --algos grpo --rollout-dtypes bf16,fp8   # issue 41: FP8 rollout learns as bf16 does

The task is ``areno/quickstart/task.py`` with ``digits=3``: the teacher forgets every carry in ``--teacher-error``
of its demonstrations (``478+385=753`` instead of 863), held-out problems are never trained on, and the reward is 1
for exactly the true sum. Every stage runs through ``areno train`` itself (in this process), so the numbers are
what a user gets:

1. ``--algo sft`` from random weights on the demonstrations (held-out greedy accuracy before and after);
2. ``--algo grpo --ckpt <SFT checkpoint>``; 3. ``--algo gspo --ckpt <SFT checkpoint>``.

Held-out accuracy before/after each stage goes to bench/results/learn.jsonl, the RL stages' reward curves to
bench/results/learn_grpo.png and learn_gspo.png, their per-step metrics to bench/results/learn_<algo>.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import append_jsonl, env_info  # noqa: E402

TASK = str(ROOT / "areno" / "quickstart" / "task.py")
RESULTS = ROOT / "bench" / "results"


def model_kwargs(smoke: bool) -> dict:
    if smoke:
        return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)
    return dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64)


def accuracy(metrics_dir: Path) -> tuple[float | None, float | None]:
    before = after = None
    for line in (metrics_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        before = rec.get("eval_accuracy_before", before)
        after = rec.get("eval_accuracy_after", after)
    return before, after


def latest(save_path: Path) -> Path:
    steps = sorted(save_path.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return steps[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--teacher-error", type=float, default=0.6)
    ap.add_argument("--sft-steps", type=int, default=1500)
    ap.add_argument("--sft-lr", type=float, default=1e-3)
    ap.add_argument("--rl-steps", type=int, default=60)
    ap.add_argument("--rl-lr", type=float, default=2e-4)
    ap.add_argument("--algos", default="grpo,gspo")
    ap.add_argument("--rollout-dtypes", default="bf16", help="each RL stage once per --rollout-dtype (bf16,fp8: "
                    "issue 41's learning check, FP8 rollout within 2 points of bf16's held-out accuracy)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if args.rollout_dtypes != "bf16" and not [a for a in args.algos.split(",") if a]:
        ap.error("--rollout-dtypes applies to the RL stages (--algos)")
    from areno.cli import main as areno
    from areno.testing import make_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="areno-learn-"))
    n_train, n_eval = (2000, 64) if args.smoke else (200_000, 500)
    sft_steps, rl_steps = (20, 4) if args.smoke else (args.sft_steps, args.rl_steps)
    data = f"digits=3,n_train={n_train},n_eval={n_eval},teacher_error={args.teacher_error}"
    common = ["--dataset-loader-fn", TASK, "--reward-fn-path", TASK, "--dataset-path", data, "--no-tensorboard",
              "--max-new-tokens", "6", "--seed", "0", "--no-activation-checkpointing"]
    model = make_tiny_checkpoint(work / "init", "qwen3", 0, initializer_range=0.02, **model_kwargs(args.smoke))
    records = []

    def stage(name, extra):
        out = work / name
        t0 = time.perf_counter()
        rc = areno(["train", *common, "--save-path", str(out), "--metrics-dir", str(out / "metrics"), *extra])
        wall = time.perf_counter() - t0
        if rc != 0:
            raise SystemExit(f"stage {name} failed with exit code {rc}")
        before, after = accuracy(out / "metrics")
        rec = {"bench": "learn", "stage": name, "accuracy_before": before, "accuracy_after": after,
               "gain_points": None if before is None else round(100 * (after - before), 1), "wall_s": round(wall, 1),
               "task": data, "model": model_kwargs(args.smoke), "args": extra}
        print(json.dumps(rec), flush=True)
        records.append(rec)
        return out

    sft = stage("sft", ["--algo", "sft", "--ckpt", str(model), "--batch-size", "256", "--mini-bs", "256",
                        "--lr", str(args.sft_lr), "--lr-decay-style", "cosine", "--warmup-steps", "50",
                        "--max-steps", str(sft_steps), "--eval-interval", str(max(1, sft_steps // 5))])
    sft_ckpt = latest(sft)
    for algo, dtype in [(a, d) for a in args.algos.split(",") if a for d in args.rollout_dtypes.split(",")]:
        name = algo if dtype == "bf16" else f"{algo}-{dtype}"  # the same seed: only the rollout's weights differ
        out = stage(name, ["--algo", algo, "--ckpt", str(sft_ckpt), "--batch-size", "128", "--n-samples", "8",
                           "--mini-bs", "1024", "--lr", str(args.rl_lr), "--max-steps", str(rl_steps),
                           "--temperature", "1.0", "--eval-interval", "10", "--rollout-dtype", dtype])
        if not args.smoke and not args.no_save:
            RESULTS.mkdir(parents=True, exist_ok=True)
            png = out / "metrics" / "reward_curve.png"
            if png.exists():
                shutil.copy(png, RESULTS / f"learn_{name}.png")
            shutil.copy(out / "metrics" / "metrics.jsonl", RESULTS / f"learn_{name}.jsonl")
    for rec in records:
        ok = rec["gain_points"] is not None and rec["gain_points"] >= 10
        bar = "" if rec["stage"] == "sft" else " bar >= +10: " + ("pass" if ok else "FAIL")
        print(f"{rec['stage']:5s} held-out accuracy {rec['accuracy_before']:.1%} -> {rec['accuracy_after']:.1%} "
              f"({rec['gain_points']:+.1f} points){bar}")
    after = {r["stage"]: r["accuracy_after"] for r in records}
    for name, acc in after.items():  # FP8 rollout's runs against bf16's, same algorithm and seed
        base = after.get(name.rsplit("-", 1)[0]) if "-" in name else None
        if base is not None and acc is not None:
            gap = round(100 * (acc - base), 1)
            next(r for r in records if r["stage"] == name)["gap_vs_bf16_points"] = gap
            print(f"{name}: {gap:+.1f} points against bf16 rollout (bar: within 2): " + ("pass" if abs(gap) <= 2 else
                                                                                          "FAIL"))
    if not args.smoke and not args.no_save:
        append_jsonl("learn", records, env_info())
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

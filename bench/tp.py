"""Tensor- and data-parallel runs on several GPUs (issue: TP serving and DP x TP training).

    python bench/tp.py --gpus 2     # nvidia-h200-x2: TP=2 serving, 2 replicas, train --world-size 2 --tp-size 2
    python bench/tp.py --gpus 4     # nvidia-h200-x4: TP=4 serving, 2 replicas of TP=2, train --world-size 4 --tp-size 2

1. Serving (``bench/serve.py``, Qwen3-0.6B shape, random bf16 weights, ``--requests`` prompts of 512 tokens, 128
   streamed tokens each, all at once): one TP=1 server, one ``--world-size G --tp-size G`` server and one
   data-parallel server (``--world-size G --tp-size 1``, or ``--tp-size 2`` replicas when G = 4). Output tokens/s
   of each against TP=1, and the greedy completions (32 prompts x 64 tokens) of TP=G compared with TP=1's: the
   number of identical completions and the mean length of the common prefix (bf16: a different reduction order
   can flip a near-tie and the completions part there).
2. Training: ``areno train --algo grpo`` for 3 steps on the quickstart task with a small qwen3 in fp32, once with
   ``--world-size 1`` and once with ``--world-size G --tp-size 2`` (same data and seed): the per-step loss and
   reward and the final weights compared.
One JSON line per comparison goes to bench/results/tp.jsonl.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import append_jsonl, env_info  # noqa: E402

TASK = str(ROOT / "areno" / "quickstart" / "task.py")


def serve(label, server_args, requests, work) -> dict:
    greedy = work / f"greedy-{label}.json"
    cmd = [sys.executable, str(ROOT / "bench" / "serve.py"), "--rates", "inf", "--requests", str(requests),
           "--server-args", server_args, "--greedy-out", str(greedy), "--no-save"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    print(out.stdout[-2500:], out.stderr[-2500:], sep="\n", flush=True)
    rec = None
    for line in out.stdout.splitlines():
        if line.startswith("{'load': 'unlimited'"):
            import ast

            rec = ast.literal_eval(line)
    texts = json.loads(greedy.read_text()) if greedy.exists() else None
    return {"label": label, "server_args": server_args, "tok_s": rec and rec.get("tok_s"),
            "tpot_p50_ms": rec and rec.get("tpot_p50_ms"), "ttft_p50_ms": rec and rec.get("ttft_p50_ms"),
            "error": (rec or {}).get("error") or (None if rec else "no result"), "greedy": texts}


def common_prefix(a: str, b: str) -> int:
    wa, wb = a.split(), b.split()
    n = 0
    while n < min(len(wa), len(wb)) and wa[n] == wb[n]:
        n += 1
    return n


def train(label, world, tp, work) -> dict:
    import torch

    out = work / f"train-{label}"
    cmd = [sys.executable, "-m", "areno", "train", "--ckpt", str(work / "small"), "--algo", "grpo",
           "--dataset-loader-fn", TASK, "--reward-fn-path", TASK, "--dataset-path", "n_eval=32", "--batch-size", "16",
           "--n-samples", "4", "--mini-bs", "64", "--max-steps", "3",
           "--sft-warmup-steps", "60", "--sft-warmup-lr", "3e-3",
           "--max-new-tokens", "6", "--lr", "1e-3",
           "--dtype", "float32", "--seed", "0", "--no-tensorboard", "--world-size", str(world), "--tp-size", str(tp),
           "--save-path", str(out), "--metrics-dir", str(out / "metrics"), "--eval-interval", "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    print(res.stdout[-1500:], res.stderr[-3000:], sep="\n", flush=True)
    if res.returncode != 0:
        return {"label": label, "error": f"exit {res.returncode}"}
    lines = [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x.get("step", 0) > 0 and "loss" in x]
    from safetensors.torch import load_file

    weights = {}
    for f in sorted((out / "step-3").glob("*.safetensors")):
        weights.update(load_file(f))
    return {"label": label, "loss": [x["loss"] for x in steps], "reward": [x["reward_mean"] for x in steps],
            "weights": {k: v.to(torch.float32) for k, v in weights.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: serve, train")
    args = ap.parse_args()
    g = args.gpus
    work = Path(tempfile.mkdtemp(prefix="areno-tp-"))
    records = []
    if "serve" not in args.skip:
        base = serve("tp1", "", args.requests, work)
        tp = serve(f"tp{g}", f"--world-size {g} --tp-size {g}", args.requests, work)
        dp_tp = 1 if g == 2 else 2
        dp = serve(f"dp{g // dp_tp}xtp{dp_tp}", f"--world-size {g} --tp-size {dp_tp}", args.requests, work)
        same = prefix = None
        if base["greedy"] and tp["greedy"]:
            same = sum(a == b for a, b in zip(base["greedy"], tp["greedy"]))
            prefix = sum(common_prefix(a, b) for a, b in zip(base["greedy"], tp["greedy"])) / len(base["greedy"])
        for r in (base, tp, dp):
            rec = {k: v for k, v in r.items() if k != "greedy"}
            rec.update(part="serve", gpus=g, speedup_vs_tp1=(r["tok_s"] / base["tok_s"]) if r["tok_s"] and
                       base["tok_s"] else None)
            if r is tp:
                rec.update(greedy_identical=same, greedy_prompts=32, greedy_common_prefix_mean=prefix)
            print(json.dumps(rec), flush=True)
            records.append(rec)
    if "train" not in args.skip:
        from areno.testing import make_tiny_checkpoint

        make_tiny_checkpoint(work / "small", "qwen3", 0, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=32, initializer_range=0.05)
        one = train("tp1", 1, 1, work)
        many = train(f"ws{g}-tp2", g, 2, work)
        rec = {"part": "train", "gpus": g, "world_size": g, "tp_size": 2,
               "error": one.get("error") or many.get("error")}
        if not rec["error"]:
            diff = max((one["weights"][k] - many["weights"][k]).abs().max().item() for k in one["weights"])
            rec.update(loss_tp1=one["loss"], loss_tp=many["loss"], reward_tp1=one["reward"], reward_tp=many["reward"],
                       max_abs_weight_diff=diff, max_abs_loss_diff=max(abs(a - b) for a, b in zip(one["loss"],
                                                                                              many["loss"])))
        print(json.dumps(rec), flush=True)
        records.append(rec)
    append_jsonl("tp", records, env_info())


if __name__ == "__main__":
    main()

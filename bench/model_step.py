"""T1/T2 model step without the optimizer: forward+backward of areno's Qwen3 adapter vs transformers (sdpa).

    python bench/model_step.py             # H200: Qwen3-0.6B shape, random bf16 weights, 8x1024 and 4x4096 tokens
    python bench/model_step.py --smoke     # CPU: a tiny shape, checks the script (times meaningless)

Each implementation runs the same token batch, with and without activation checkpointing:
- areno: the packed batch (``cu_seqlens``) -> final hidden states -> ``linear_logprobs`` of the next tokens (no
  ``[tokens, vocab]`` logits) -> mean negative log-likelihood -> backward. Kernels: Triton (the dispatch rule).
- transformers: ``model(input_ids, labels=input_ids).loss`` (its standard shifted cross-entropy) -> backward, sdpa
  attention; checkpointing through ``gradient_checkpointing_enable`` (non-reentrant).
Gradients are dropped (``grad = None``) before each step; no optimizer.

FLOPs: ``6 * N * tokens`` with N = non-embedding parameters + the LM head matrix; for the tied Qwen3-0.6B this is
all 596,049,920 parameters (the head multiplies by the embedding matrix; the embedding lookup itself is free).
``mfu`` uses that count against the H200's 790 TFLOP/s bf16 peak (BENCH.md); ``mfu_attn`` adds attention's
causal score/value FLOPs (forward ``2 * 2 * L * Hq * D * sum(len^2) / 2``, backward 2.5x forward). Recomputation
under checkpointing is not counted (MFU, not hardware FLOP/s). Peak memory: ``torch.cuda.max_memory_allocated``
over one step with only that model resident (weights, gradients and activations included).
One JSON line per measurement goes to bench/results/model_step.jsonl.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import append_jsonl, env_info, gpu_time_ms, print_table  # noqa: E402
from models import PEAK_FLOPS, QWEN3_06B, SMOKE  # noqa: E402

WORKLOADS = {"T1": (8, 1024), "T2": (4, 4096)}
SMOKE_WORKLOADS = {"T1": (2, 64), "T2": (1, 128)}


def model_flops(shape: dict, batch: int, seqlen: int) -> tuple[float, float]:
    """(6 * N * tokens, attention FLOPs fwd+bwd) for one step."""
    h, i, v, layers = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    hq, hkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i + 2 * h + 2 * d
    n = layers * per_layer + h + v * h  # + final norm + LM head (the tied embedding matrix)
    tokens = batch * seqlen
    attn_fwd = 2 * 2 * layers * hq * d * batch * seqlen**2 / 2
    return 6 * n * tokens, 3.5 * attn_fwd


def areno_step(model, batch, seqlen, device):
    ids = torch.randint(0, model.config.vocab_size, (batch, seqlen), device=device)
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    targets = targets.reshape(-1)
    flat, positions = ids.reshape(-1), torch.arange(seqlen, device=device).repeat(batch)
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
    params = list(model.parameters())
    count = (targets >= 0).sum()

    def step():
        for p in params:
            p.grad = None
        hidden = model(flat, positions, cu, seqlen)
        loss = -model.token_logprobs(hidden, targets).sum() / count
        loss.backward()

    return step


def hf_step(model, batch, seqlen, device):
    ids = torch.randint(0, model.config.vocab_size, (batch, seqlen), device=device)
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        model(input_ids=ids, labels=ids).loss.backward()

    return step


def load(impl, path, device, attn_backend):
    if impl == "areno":
        from areno.models import load_model

        return load_model(path, device=device, attn_backend=attn_backend).train()
    import transformers

    attn = "sdpa"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=attn)
    return model.to(device).train()


def set_checkpointing(impl, model, enabled):
    if impl == "areno":
        model.set_activation_checkpointing(enabled)
    elif enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def measure(impl, model, shape, workload, batch, seqlen, ckpt, device, args):
    set_checkpointing(impl, model, ckpt)
    make = areno_step if impl == "areno" else hf_step
    rec = dict(impl=impl, workload=workload, batch=batch, seqlen=seqlen, tokens=batch * seqlen, checkpointing=ckpt)
    try:
        step = make(model, batch, seqlen, device)
        ms = gpu_time_ms(step, warmup=args.warmup, iters=args.iters)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.cuda.OutOfMemoryError as e:
        rec["error"] = f"OOM: {str(e).splitlines()[0]}"
        return rec
    finally:
        for p in model.parameters():
            p.grad = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    flops, attn = model_flops(shape, batch, seqlen)
    rec.update(step_ms=ms, tokens_per_s=batch * seqlen / (ms / 1e3))
    rec.update(mfu=flops / (ms / 1e3) / PEAK_FLOPS, mfu_attn=(flops + attn) / (ms / 1e3) / PEAK_FLOPS)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on any device (checks the script)")
    ap.add_argument("--workloads", default="T1,T2")
    ap.add_argument("--impls", default="areno,transformers")
    ap.add_argument("--checkpointing", default="off,on", help="off, on or off,on")
    ap.add_argument("--attn-backend", default="flash", choices=["flash", "native"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/model_step.jsonl")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape, workloads = (SMOKE, SMOKE_WORKLOADS) if args.smoke else (QWEN3_06B, WORKLOADS)
    if args.smoke:
        args.warmup, args.iters = 1, 2
    from areno.testing import make_tiny_checkpoint

    records = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_checkpoint(tmp, "qwen3", dtype=torch.bfloat16, **shape))
        for impl in args.impls.split(","):
            model = load(impl, path, device, args.attn_backend)
            for name in args.workloads.split(","):
                batch, seqlen = workloads[name]
                for ckpt in args.checkpointing.split(","):
                    rec = measure(impl, model, shape, name, batch, seqlen, ckpt == "on", device, args)
                    print({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}, flush=True)
                    records.append(rec)
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    base = {(r["workload"], r["checkpointing"]): r for r in records if r["impl"] == "transformers" and "step_ms" in r}
    for r in records:
        ref = base.get((r["workload"], r["checkpointing"]))
        if r["impl"] == "areno" and ref is not None and "step_ms" in r:
            r["speedup_vs_hf"] = ref["step_ms"] / r["step_ms"]
            if "peak_gib" in r and "peak_gib" in ref:
                r["memory_vs_hf"] = r["peak_gib"] / ref["peak_gib"]
    cols = ["impl", "workload", "checkpointing", "step_ms", "tokens_per_s", "mfu", "mfu_attn", "peak_gib",
            "speedup_vs_hf", "memory_vs_hf", "error"]  # fmt: skip
    print_table(records, cols)
    bar = [r for r in records if r["impl"] == "areno" and r["workload"] == "T1" and not r["checkpointing"]]
    for r in bar:
        if "speedup_vs_hf" in r:
            ok = r["speedup_vs_hf"] >= 1.5 and r.get("memory_vs_hf", 0) <= 0.7
            print(f"T1 bar (>= 1.5x transformers tok/s, <= 0.7x its peak memory): {'PASS' if ok else 'FAIL'} "
                  f"({r['speedup_vs_hf']:.2f}x, {r.get('memory_vs_hf', float('nan')):.2f}x memory, "
                  f"MFU {r['mfu']:.1%}; goal 50% MFU, <= 0.5x memory)")  # fmt: skip
    if not args.no_save and not args.smoke:
        env = env_info()
        env["shape"] = "qwen3-0.6b"
        print("results:", append_jsonl("model_step", records, env))


if __name__ == "__main__":
    main()

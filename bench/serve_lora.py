"""Serving LoRA adapters: the real ``areno serve`` process under 500 streamed completions spread over 4 adapters of
rank 16 (all-linear), against the same server and load on the base model alone, in the same run.

    python bench/serve_lora.py             # H200: Qwen3-0.6B shape, random bf16 weights and adapters
    python bench/serve_lora.py --smoke     # CPU: a tiny shape, 20 short requests (times meaningless)

Acceptance (issue 39): the adapters' output tokens/s >= 0.7 x the base model's (``vs_base``). The load is
``bench/serve.py``'s unlimited one (all requests at once; prompts of 512 random token ids, 128 tokens each,
``ignore_eos``, streamed, ``--clients`` load-generator processes), request i asking for adapter ``l{i % 4}``, so every
engine step mixes the four. The adapters are written in PEFT's format by ``areno.models.lora`` with random A and B
(std 0.02) into the bench cache; the LoRA server runs with ``--lora-modules l0=... l3=... --max-lora-rank 16``
(``--max-loras`` 4), the base server with the same other flags. Each server gets a warm-up round of the same load
first (graph capture, kernel compilation). One JSON line per server goes to bench/results/serve_lora.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
import serve as serve_bench  # noqa: E402
from common import append_jsonl, env_info, print_table  # noqa: E402

ADAPTERS, RANK = 4, 16


def make_adapters(path, smoke: bool) -> list:
    """Four rank-16 all-linear PEFT adapters of the checkpoint (random, seeds 0..3), made once in the bench cache."""
    import torch

    from areno.models import load_model
    from areno.models.lora import LoraSpec, attach

    root = models.cache_root() / f"lora-adapters-{'smoke' if smoke else 'qwen3-0.6b'}-r{RANK}"
    folders = [root / f"l{i}" for i in range(ADAPTERS)]
    if all((f / "adapter_model.safetensors").is_file() for f in folders):
        return folders
    model = load_model(path, dtype=torch.float32, device="cpu", attn_backend="native")
    adapter = attach(model, LoraSpec(rank=RANK, alpha=2.0 * RANK, target_modules="all-linear"))
    for i, folder in enumerate(folders):
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in adapter.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        adapter.save(folder, base=str(path))
    return folders


def measure(path, args, server_args: str, names, prompts, warm) -> dict:
    """One server: a warm-up round, then the measured one (all at once); its summary record."""
    port = serve_bench.free_port()
    base = f"http://127.0.0.1:{port}"
    opts = SimpleNamespace(max_running_prompts=args.max_running_prompts, eager=args.eager, server_args=server_args)
    log = tempfile.NamedTemporaryFile("w+", prefix="areno-serve-lora-", suffix=".log", delete=False)
    proc = serve_bench.start_server(path, port, opts, log)
    try:
        base_name = serve_bench.wait_ready(proc, base, args.startup_timeout_s)
        names = names or [base_name]
        serve_bench.run_load(base, names, warm, args.max_tokens, None, args.clients, seed=99)
        res, origin = serve_bench.run_load(base, names, prompts, args.max_tokens, None, args.clients)
        rec = serve_bench.summarize("unlimited", res, origin, args.max_tokens)
    except Exception as e:  # noqa: BLE001 - the record says what failed; the log tail follows
        log.seek(0)
        print(log.read()[-3000:], flush=True)
        rec = {"load": "unlimited", "error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        serve_bench.stop_server(proc)
        log.close()
    rec.update(server_args=server_args, models=len(names or [1]), prompt_tokens=args.prompt_tokens,
               max_tokens=args.max_tokens, max_running_prompts=args.max_running_prompts, clients=args.clients)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve_bench.add_load_args(ap)
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/serve_lora.jsonl")
    args = ap.parse_args()
    serve_bench.fill_load_defaults(args)
    t_start = time.perf_counter()
    path = models.checkpoint(args.smoke)
    folders = make_adapters(path, args.smoke)
    vocab = models.shape_of(args.smoke)["vocab_size"]
    warm = models.random_prompts(args.requests, args.prompt_tokens, vocab, seed=99)
    prompts = models.random_prompts(args.requests, args.prompt_tokens, vocab, seed=0)
    names = [f"l{i}" for i in range(ADAPTERS)]
    lora_args = "--lora-modules " + " ".join(f"{n}={f}" for n, f in zip(names, folders)) + f" --max-lora-rank {RANK}"
    records = [measure(path, args, "", None, prompts, warm), measure(path, args, lora_args, names, prompts, warm)]
    records[0]["server"], records[1]["server"] = "base", f"{ADAPTERS} adapters r{RANK}"
    if records[0].get("tok_s") and records[1].get("tok_s"):
        records[1]["vs_base"] = records[1]["tok_s"] / records[0]["tok_s"]
    print_table(records, ["server", "requests", "failed", "output_tokens", "wall_s", "tok_s", "vs_base",
                          "ttft_p50_ms", "tpot_p50_ms", "tpot_p99_ms", "error"])
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    if not args.no_save and not args.smoke:
        env = env_info()
        env["shape"] = "qwen3-0.6b"
        print("results:", append_jsonl("serve_lora", records, env))


if __name__ == "__main__":
    main()

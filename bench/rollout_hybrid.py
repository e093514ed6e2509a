"""Rollout tokens/s of a Ling-3.0-Flash-shaped model with fewer layers, latent MLA cache against the expanded one.

    python bench/rollout_hybrid.py              # H200: 12 layers, 512 experts, random bf16 weights (about 5 minutes)
    python bench/rollout_hybrid.py --smoke      # CPU: a tiny shape, checks the script (times meaningless)

The shape: every width of Ling-3.0-Flash (transformers' ``BailingHybridConfig`` defaults, whose docstring names
``inclusionAI/Ling-3.0-Flash``, agreeing with the published 124B total / 5.1B active, 512 routed experts top-8 plus
one shared, KDA:MLA 5:1): hidden 2560, 32 heads, KDA head dim 128, MLA ``kv_lora_rank`` 512, d_nope 128, d_rope 64,
d_v 128, 512 experts of width 768 in 8 groups (top-4 groups), dense MLP 6144 for the first 2 layers, vocab 157,184.
Fewer layers: 12 = two groups of ``layer_group_size`` 6 (5 KDA + 1 MLA each), so 10 sparse-MoE layers (about
31B parameters, 62 GB in bf16). The weights are drawn on the GPU (N(0, 0.02), norms 1, expert bias 0): no checkpoint
is written (the device's disk could not hold one and writing it would take minutes); no MTP layers (decode does not
use them).

Workloads (sampling at temperature 1, ``ignore_eos``, log-probs returned), each run once per MLA cache layout on one
engine (block 16, 256 running, 8192 batched tokens, k = 8 decode steps per round, every decode graph captured first):
- H1: 256 prompts of 128 random tokens, 256 new tokens each (the R1 shape: weight-bound decode);
- H2: 64 prompts of 4,096 tokens, 128 new tokens each (long context: the MLA cache is read at every step);
- H3: 1 prompt of 128 tokens, 256 new tokens (latency); its sampled tokens also go through the training forward
  and the mean |log-prob difference| from the engine's is reported (the absorbed decode's correctness at scale).
MLA cache (``bailing_hybrid.set_mla_cache``, env ``ARENO_MLA_CACHE``): ``latent`` stores c and k_rope once per token
(576 values, absorbed decode through ``mla_decode``); ``expanded`` stores K and V per head (2 x 32 x 192 values,
``paged_attention``). Limit per decode step (H200, 4.3 TB/s): the weights read (dense ones, the lm head, and the
experts the step's rows touch: E * (1 - (1 - k/E)^rows) per MoE layer), the KDA states read and written (fp32
32 x 128 x 128 per layer and row) and the MLA cache at the workload's mean context. One JSON line per measurement
goes to bench/results/rollout_hybrid.jsonl.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
from common import append_jsonl, env_info, print_table  # noqa: E402

LING3_FLASH = dict(  # a config.json of Ling-3.0-Flash's widths (num_hidden_layers and num_local_experts set by flags)
    architectures=["BailingMoeV3ForCausalLM"], model_type="bailing_hybrid", vocab_size=157184, hidden_size=2560,
    intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, n_shared_experts=1,
    first_k_dense_replace=2, layer_group_size=6, short_conv_kernel_size=4, kda_safe_gate=True, kda_lower_bound=-5.0,
    rope_theta=6e6, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False, num_mtp_layers=0,
    hidden_act="silu", norm_topk_prob=True,
)  # fmt: skip
SMOKE = dict(LING3_FLASH, vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             num_attention_heads=4, num_key_value_heads=4, head_dim=16, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, num_experts_per_tok=2, n_group=4, topk_group=2,
             first_k_dense_replace=1, layer_group_size=3, max_position_embeddings=4096)
WORKLOADS = {  # name: (prompts, prompt length, new tokens), full and --smoke
    "H1": ((256, 128, 256), (8, 16, 16)),
    "H2": ((64, 4096, 128), (4, 64, 8)),
    "H3": ((1, 128, 256), (1, 16, 16)),
}
HBM_BYTES_PER_S = models.HBM_BYTES_PER_S


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_model(shape: dict, layers: int, experts: int, dtype, device, seed: int = 0, std: float = 0.02):
    """The areno model of ``shape`` with random weights drawn on ``device`` (built as ``load_model`` builds one)."""
    raw = dict(shape, num_hidden_layers=layers, num_local_experts=experts)
    return models.random_model(raw, dtype, device, seed=seed, unit_norms=True, std=std)


def decode_limit_tok_s(model, rows: int, context: float, kv_bytes_per_token: float) -> float:
    """Tokens/s if a decode step only moved its bytes at HBM speed (see the module docstring)."""
    cfg = model.config
    dense = expert = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts.w" in name:
            expert += nbytes
        elif not name.startswith("embed_tokens"):  # the embedding reads only the rows' vectors
            dense += nbytes
    touched = 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.num_experts) ** rows
    shapes = model.recurrent_state_shapes()
    state = 0
    if shapes:
        hh, d, _ = shapes["recurrent"]
        state = 2 * len(shapes["layers"]) * hh * d * d * 4  # fp32 delta-rule state read and written per row
    step_bytes = dense + expert * touched + rows * (state + context * kv_bytes_per_token)
    return rows / (step_bytes / HBM_BYTES_PER_S)


def generate(engine, prompts, new, device):
    from areno.config import SamplingParams

    opts = [SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True) for n in new]
    sync(device)
    t0 = time.perf_counter()
    out = engine.generate(prompts, opts)
    sync(device)
    return out, time.perf_counter() - t0


def run_layout(model, kind: str, device, args, vocab: int) -> list[dict]:
    from rollout import logprob_diff

    from areno.engine.engine import Engine, EngineConfig
    from areno.engine.kv_cache import kv_bytes_per_block

    model.set_mla_cache(kind)
    cfg = EngineConfig(block_size=16, max_running=args.max_running, max_batched_tokens=args.max_batched_tokens,
                       max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                       eager_decode=args.eager, decode_steps=args.decode_steps)
    engine = Engine(model, None, cfg, eos_token_ids=[models.EOS_ID])
    per_token = kv_bytes_per_block(model, 16, next(model.parameters()).dtype) / 16
    t0 = time.perf_counter()
    graphs = engine.runner.capture_graphs((args.decode_steps,))
    capture_s = time.perf_counter() - t0
    generate(engine, models.random_prompts(8, 32, vocab, seed=9), [16] * 8, device)  # compile the prefill kernels
    print(f"[{kind}] {engine.blocks.num_blocks} KV blocks of 16, {per_token:.0f} MLA cache bytes a token, "
          f"{graphs} graphs captured in {capture_s:.1f}s", flush=True)
    records = []
    for name in args.workloads.split(","):
        n, plen, new = WORKLOADS[name][1 if args.smoke else 0]
        rec = dict(workload=name, mla_cache=kind, sequences=n, prompt_len=plen, new_tokens=new,
                   kv_blocks=engine.blocks.num_blocks, kv_bytes_per_token=per_token)
        try:
            prompts = models.random_prompts(n, plen, vocab, seed=2)
            out, dt = generate(engine, prompts, [new] * n, device)
            tokens = sum(len(c.token_ids) for g in out for c in g)
            rec.update(output_tokens=tokens, wall_s=dt, tok_s=tokens / dt, complete=tokens == n * new,
                       preemptions=engine.scheduler.num_preemptions)
            if not args.smoke:
                rec["limit_tok_s"] = decode_limit_tok_s(model, n, plen + new / 2, per_token)
                rec["frac_limit"] = rec["tok_s"] / rec["limit_tok_s"]
            if name == "H3":
                rec.update(logprob_diff(model, out, device))
        except Exception as e:  # a failing workload is reported, the others still run
            traceback.print_exc()
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
            engine.abort(list(engine.scheduler.running) + list(engine.scheduler.waiting))
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}, flush=True)
        records.append(rec)
    engine.drop_rollout_state()
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on any device (checks the script)")
    ap.add_argument("--layers", type=int, default=12, help="decoder layers (default: two groups of 6)")
    ap.add_argument("--experts", type=int, default=512, help="routed experts per MoE layer (Ling-3.0-Flash: 512)")
    ap.add_argument("--workloads", default="H1,H2,H3")
    ap.add_argument("--mla-cache", default="latent,expanded", help="MLA cache layouts to run, in this order")
    ap.add_argument("--eager", action="store_true", help="without CUDA graphs (--eager-decode)")
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps chained per scheduling round")
    ap.add_argument("--max-model-len", type=int, default=4096 + 256 + 16)
    ap.add_argument("--kv-cache-memory", type=float, default=None, help="fraction of free memory or bytes")
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/rollout_hybrid.jsonl")
    args = ap.parse_args()
    kinds = args.mla_cache.split(",")
    unknown = sorted(set(kinds) - {"latent", "expanded"}) + sorted(set(args.workloads.split(",")) - set(WORKLOADS))
    if unknown:
        ap.error(f"unknown --mla-cache / --workloads entries {unknown}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SMOKE if args.smoke else LING3_FLASH
    if args.smoke:
        args.layers, args.experts, args.max_running, args.max_model_len = 6, 8, 16, 128
        if device.type == "cpu":  # tiny matmuls: extra threads only spin against the other processes of a busy host
            torch.set_num_threads(1)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    t_start = time.perf_counter()
    model = build_model(shape, args.layers, args.experts, dtype, device)
    sync(device)
    params = sum(p.numel() for p in model.parameters())
    types = "".join("M" if t == "full_attention" else "K" for t in model.config.layer_types)
    print(f"Ling-3.0-Flash shape, {args.layers} layers ({types}), {args.experts} experts: {params / 1e9:.2f}B "
          f"parameters, built in {time.perf_counter() - t_start:.1f}s", flush=True)
    records = []
    for kind in kinds:
        records += run_layout(model, kind, device, args, shape["vocab_size"])
    latent = {r["workload"]: r for r in records if r["mla_cache"] == "latent" and "tok_s" in r}
    for r in records:
        if r["mla_cache"] == "expanded" and "tok_s" in r and r["workload"] in latent:
            latent[r["workload"]]["latent_vs_expanded"] = latent[r["workload"]]["tok_s"] / r["tok_s"]
    cols = ["workload", "mla_cache", "sequences", "output_tokens", "wall_s", "tok_s", "limit_tok_s", "frac_limit",
            "latent_vs_expanded", "kv_blocks", "kv_bytes_per_token", "preemptions", "logprob_diff_mean", "error"]
    print_table(records, cols)
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    if not args.no_save and not args.smoke:
        env = env_info()
        env.update(shape=f"ling3-flash-{args.layers}l-{args.experts}e", parameters=params)
        print("results:", append_jsonl("rollout_hybrid", records, env))


if __name__ == "__main__":
    main()

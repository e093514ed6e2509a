"""Issue 38's speed bench: Qwen3.5-9B-shaped (dense hybrid) and Qwen3.5-35B-A3B-shaped (MoE hybrid) random models,
rollout at R1's shape and a train step, areno against transformers in the same run.

    python bench/families.py            # H200: both shapes, rollout then train step (about 8 minutes)
    python bench/families.py --smoke    # CPU: tiny shapes of both families, checks the script (times meaningless)
    python bench/families.py --parts rollout --state-dtypes float32,bfloat16   # R1 with the bf16 state pool too
    python bench/families.py --parts train --shapes qwen3_5-35b-a3b --adamw8bit-tiles 8x8,2x8   # a T1 row per tile

Shapes (the published text configs): Qwen3.5-9B: hidden 4096, 32 layers of [GDN, GDN, GDN, gated attention] x 8,
16 query / 4 KV heads of 256 (partial RoPE 0.25, theta 1e7), gated delta net 16 key / 32 value heads of 128, short
conv 4, MLP 12288, vocab 248,320, untied head. Qwen3.5-35B-A3B: hidden 2048, 40 layers of the same pattern, 16 / 2
heads of 256, the same delta net, 256 experts of width 512 top-8 plus a gated shared expert of 512, vocab 248,320.
No MTP layers (decode and the train step do not use them). The weights are drawn on the GPU (``models.random_model``:
N(0, 0.02), zero-centred norms 0); no checkpoint is written. transformers' model is built from the same config
(sdpa attention, bf16, its default experts implementation; its rows say whether flash-linear-attention and
causal-conv1d were installed or it ran its PyTorch reference delta rule) and gets areno's weights copied in (its fused
``gate_up_proj`` / ``down_proj`` experts stacked from the per-expert tensors), so both run the same model.

Layers (flags): the rollout runs the whole 9B (32 layers) and 8 layers (two groups) of the 35B-A3B (the whole is
70 GB in bf16 and would not fit twice while its weights are copied). The train step does not fit whole: areno's
``MasterAdamW`` holds 16 bytes a parameter (bf16 weights and gradients, fp32 master and moments), 144 GB for 9B, so
it runs 8 layers of the 9B and 4 layers of the 35B-A3B (one group), at full width, with the full embedding and head.

- R1 (``bench/rollout.py``'s definition): 256 prompts of 128 random tokens, 256 new tokens each, temperature 1,
  ``ignore_eos``, log-probs returned. areno: one ``Engine`` (block 16, 256 running, 8192 batched tokens, CUDA-graph
  decode, ``--decode-steps`` per round); the first call includes graph capture and compilation, a second call on
  fresh prompts is the headline (``call`` warm), whose tokens also go through the training forward (mean |log-prob
  difference|). transformers: ``generate(do_sample, min_new_tokens = max_new_tokens)`` on ``--hf-prompts`` of the
  same prompts (all 256 by default) as one batch after a short warm-up, capped by ``--hf-max-time-s`` (its tok/s
  counts the tokens it made; a note says when it stopped early or ran fewer prompts). Target: >= 10x. areno's rows
  split their wall time by step kind (``step_s_single``: prefill and mixed steps; ``step_s_chained``: the decode
  chains; ``steps_*`` the counts), and a chained decode step's time (``decode_ms``) beside its HBM floor
  (``decode_floor_ms``: every weight read, each row's recurrent states read and written and its K/V at the mean
  context read, at the card's bandwidth; ``decode_frac_floor`` their ratio).
- T1 (``bench/train_step.py``'s T1: 8 x 1024 tokens, every next token a target): areno's ``PolicyTrainer.train``
  with ``MasterAdamW`` (grad clip 1.0, no activation checkpointing, eager by default; fp32 master weights, its
  moments fp32 and, in a second row, 8-bit: ``--optimizer-states``; ``--adamw8bit-tiles``: an 8-bit row per tile
  of its kernel, ``adamw8bit.TILE``, each row naming its ``adamw8bit_tile``) against transformers'
  ``model(ids, labels=ids).loss.backward(); torch.optim.AdamW.step()`` on the bf16 parameters, timed by
  ``train_step.measure`` (median step, back-to-back loop, peak allocated memory with one model resident). MFU:
  6 x active parameters x tokens / step time / 790 TFLOP/s, the active parameters being every matrix but the
  embedding, with the routed experts counted at top-k / experts (attention and delta-rule FLOPs not counted).
  Target: >= 1.5x transformers + AdamW at no more peak memory.

transformers >= 5.24 has ``qwen3_5``; on an older one its rows are skipped with the reason printed. Every row is
printed as soon as it is measured; one JSON line per row goes to bench/results/families.jsonl.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
import rollout  # noqa: E402
import train_step  # noqa: E402
from common import append_jsonl, env_info, print_table, step_times, tiles  # noqa: E402

ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
              max_position_embeddings=262144, rope_parameters=ROPE, rope_theta=1e7, partial_rotary_factor=0.25,
              linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, full_attention_interval=4, mtp_num_hidden_layers=0, vocab_size=248320,
              num_attention_heads=16, head_dim=256, bos_token_id=models.PAD_ID, eos_token_id=models.EOS_ID,
              pad_token_id=models.PAD_ID)  # fmt: skip
SHAPES = {  # name: (config.json text config, layers for the rollout, layers for the train step)
    "qwen3_5-9b": (dict(COMMON, model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288,
                        num_hidden_layers=32, num_key_value_heads=4), 32, 8),
    "qwen3_5-35b-a3b": (dict(COMMON, model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                             num_key_value_heads=2, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                             shared_expert_intermediate_size=512), 8, 4),
}  # fmt: skip
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, max_position_embeddings=4096)  # fmt: skip
HF_CLASSES = {"qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
              "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM")}
EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def config_of(name: str, layers: int, smoke: bool) -> dict:
    """The text config.json of shape ``name`` with ``layers`` decoder layers (``--smoke``: tiny widths)."""
    raw = dict(SHAPES[name][0], num_hidden_layers=layers)
    if smoke:
        raw.update({k: v for k, v in TINY.items() if k in raw})
    raw["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return raw


def active_params(model) -> int:
    """The parameters a token's FLOPs go through: every matrix but the embedding; routed experts at k / E."""
    cfg = model.config
    share = cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 1.0
    total = 0.0
    for name, p in model.named_parameters():
        if name.startswith("embed_tokens") and not cfg.tie_word_embeddings:
            continue
        total += p.numel() * (share if ".experts." in name else 1.0)
    return int(total)


def hf_missing(raw: dict) -> str | None:
    """Why transformers cannot build this model here (None when it can)."""
    import transformers

    cls = HF_CLASSES[raw["model_type"]][0]
    if not hasattr(transformers, cls):
        return f"transformers {transformers.__version__} has no {cls} (qwen3_5 needs >= 5.24): its rows are skipped"
    return None


@torch.no_grad()
def hf_model(raw: dict, model, dtype, device):
    """transformers' model of ``raw`` on ``device`` (sdpa) holding a copy of areno ``model``'s weights."""
    import transformers

    from areno.models.saver import iter_hf_tensors

    config_name, model_name = HF_CLASSES[raw["model_type"]]
    config = getattr(transformers, config_name)(**{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device(device):
        hf = getattr(transformers, model_name)._from_config(config, dtype=dtype, attn_implementation="sdpa")
    params = dict(hf.named_parameters())
    filled = set()
    for name, tensor in iter_hf_tensors(model):
        m = EXPERT.match(name)
        if m is None:
            params[name].copy_(tensor)
            filled.add(name)
            continue
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        key = f"{prefix}.down_proj" if kind == "down" else f"{prefix}.gate_up_proj"  # gate rows, then up rows
        fused, inter = params[key], params[f"{prefix}.gate_up_proj"].shape[1] // 2
        part = fused[e] if kind == "down" else fused[e, :inter] if kind == "gate" else fused[e, inter:]
        part.copy_(tensor)
        filled.add(key)
    missing = sorted(set(params) - filled)
    if missing:
        raise KeyError(f"transformers' model has {len(missing)} parameters areno's lacks, e.g. {missing[:3]}")
    return hf


def hf_fields(hf) -> dict:
    """What transformers ran on: its version, experts implementation, and whether its delta-rule and short-conv
    kernels were there (flash-linear-attention, causal-conv1d) or it fell back to its PyTorch reference code."""
    import importlib.util

    import transformers

    have = {name: importlib.util.find_spec(mod) is not None for name, mod in
            (("flash-linear-attention", "fla"), ("causal-conv1d", "causal_conv1d"))}  # fmt: skip
    return dict(transformers=transformers.__version__,
                experts_implementation=getattr(hf.config, "_experts_implementation", None),
                hf_linear_attention=", ".join(k for k, v in have.items() if v) or "PyTorch reference (no fla, "
                "no causal-conv1d)")


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def show(rec: dict) -> dict:
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}, flush=True)
    return rec


def failed(rec: dict, e: Exception) -> dict:
    traceback.print_exc()
    return show({**rec, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]})


def decode_floor_ms(engine, rows: int, context: float, device) -> float | None:
    """The HBM floor of one decode step of ``rows`` sequences ``context`` tokens long (ms; None off a known GPU,
    areno.platform.roofline's bandwidth): every weight read once (the input embedding but its rows not: untied),
    each row's recurrent states read and written, its K/V read."""
    from areno.engine.state_cache import RecurrentStates
    from areno.platform.roofline import device_roofline

    roof = device_roofline(device)
    if roof is None:
        return None
    r, model = engine.runner, engine.runner.model
    skip = {id(model.embed_tokens.weight)} if model.lm_head is not None else set()
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    kv = r.kv_cache.numel() * r.kv_cache.element_size() / (r.num_blocks * r.block_size)  # every layer's, a token
    shapes = model.recurrent_state_shapes()
    state = RecurrentStates.bytes_per_slot(shapes, r.dtype, r.states.recurrent.dtype) if shapes else 0
    return (weights + rows * (2 * state + context * kv)) / roof.bytes_per_s * 1e3


def rollout_areno(model, args, device, base: dict, state_dtype: str = "float32") -> list[dict]:
    """R1 twice on one engine (first: capture and compile; warm: fresh prompts, the headline), the recurrent state
    pool at ``state_dtype`` (--mamba-ssm-cache-dtype)."""
    from areno.engine.engine import Engine, EngineConfig

    cfg = EngineConfig(block_size=16, max_running=args.max_running, max_batched_tokens=args.max_batched_tokens,
                       max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory,
                       eager_decode=args.eager, decode_steps=args.decode_steps, mamba_ssm_cache_dtype=state_dtype)
    engine = Engine(model, None, cfg, eos_token_ids=[models.EOS_ID])
    records = []
    for call, seed in (("first", 1), ("warm", 2)):
        rec = dict(base, impl="areno", call=call, decode_steps=args.decode_steps, mamba_ssm_cache_dtype=state_dtype)
        try:
            prompts, new = rollout.workload("R1", args.smoke, model.config.vocab_size, seed)
            counts = dict(engine.step_counts)
            with step_times(engine) as spent:  # where the call's time goes: prefill and mixed steps, decode chains
                out, dt = rollout.areno_generate(engine, prompts, new, device)
            tokens = sum(len(c.token_ids) for g in out for c in g)
            rec.update(sequences=len(prompts), output_tokens=tokens, wall_s=dt, tok_s=tokens / dt,
                       complete=tokens == sum(new), kv_blocks=engine.blocks.num_blocks,
                       **{k: v for k, v in spent.items() if k != "step_s_verify"},
                       **{f"steps_{k}": v - counts.get(k, 0) for k, v in engine.step_counts.items()})
            if rec["steps_chained"]:  # a chained decode step's wall time against its HBM floor (mean context)
                rec["decode_ms"] = rec["step_s_chained"] / rec["steps_chained"] * 1e3
                floor = decode_floor_ms(engine, len(prompts), len(prompts[0]) + max(new) / 2, device)
                if floor is not None:
                    rec.update(decode_floor_ms=floor, decode_frac_floor=floor / rec["decode_ms"])
            if call == "warm":
                rec.update(rollout.logprob_diff(model, out, device))
            records.append(show(rec))
        except Exception as e:  # a failing call is reported, the rest still runs
            records.append(failed(rec, e))
            engine.abort(list(engine.scheduler.running) + list(engine.scheduler.waiting))
    engine.drop_rollout_state()
    del engine
    free(device)
    return records


def rollout_hf(hf, args, device, base: dict) -> dict:
    """transformers' ``generate`` on the first ``--hf-prompts`` of the warm call's prompts."""
    rec = dict(base, impl="transformers", call="warm", **hf_fields(hf))
    try:
        prompts, new = rollout.workload("R1", args.smoke, hf.config.vocab_size, seed=2)
        prompts, new = prompts[: args.hf_prompts], new[: args.hf_prompts]
        rollout.hf_generate(hf, [p[:32] for p in prompts[:8]], [4] * min(8, len(prompts)), device)  # warm-up
        tokens, steps, dt = rollout.hf_generate(hf, prompts, new, device, max_time=args.hf_max_time_s)
        rec.update(sequences=len(prompts), output_tokens=tokens, wall_s=dt, tok_s=tokens / dt,
                   complete=steps >= max(new), decode_steps=steps)
        notes = []
        if steps < max(new):
            notes.append(f"stopped by max_time {args.hf_max_time_s}s after {steps} of {max(new)} steps")
        if len(prompts) < (8 if args.smoke else 256):
            notes.append(f"{len(prompts)} of the prompts (tok/s per token made)")
        if notes:
            rec["note"] = "; ".join(notes)
        return show(rec)
    except Exception as e:
        return failed(rec, e)


def run_rollout(name: str, args, device, dtype) -> list[dict]:
    layers = args.layers_rollout.get(name, 4 if args.smoke else SHAPES[name][1])
    raw = config_of(name, layers, args.smoke)
    t0 = time.perf_counter()
    model = models.random_model(raw, dtype, device, unit_norms=True, attn_backend=args.attn_backend)
    base = dict(workload="R1", shape=name, layers=layers, parameters=sum(p.numel() for p in model.parameters()))
    print(f"{name}: {layers} layers, {base['parameters'] / 1e9:.2f}B parameters, built in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    records = [r for sd in args.state_dtypes.split(",") for r in rollout_areno(model, args, device, base, sd)]
    why = hf_missing(raw) if "transformers" in args.impls else "not asked (--impls)"
    if why is None:
        try:
            hf = hf_model(raw, model, dtype, device)
        except Exception as e:
            records.append(failed(dict(base, impl="transformers", call="warm"), e))
            hf = None
        del model
        free(device)
        if hf is not None:
            records.append(rollout_hf(hf.eval(), args, device, base))
            del hf
    else:
        print(f"{name} R1 transformers: {why}", flush=True)
        del model
    free(device)
    return records


def train_areno(model, args, device, base: dict, n_active: int, states: str) -> dict:
    """One T1 row of areno's trainer with ``MasterAdamW`` keeping its moments in ``states`` (fp32 or 8bit)."""
    from areno.training.optimizer import MasterAdamW

    opt = MasterAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, states=states)
    state = (model.train(), opt, {})
    batch, seqlen = base["batch"], base["seqlen"]
    try:
        rec = train_step.measure("areno", state, "T1", batch, seqlen, False, device, args, model.config.vocab_size,
                                 n_active, graphs=args.graphs, head="fused")
    finally:
        for t in state[2].values():
            if t.graphs is not None:
                t.graphs.close()
        opt.close()
        for p in model.parameters():
            p.grad = None
    return show({**base, **rec, "optimizer_states": states})


def train_8bit_tile(tile, model, args, device, base: dict, n_active: int, states: str) -> dict:
    """``train_areno`` with the 8-bit kernel's tile (``adamw8bit.TILE``) set to ``tile`` ((rows, warps); None: as it
    is) for the row and put back after; an 8-bit row names its tile (``adamw8bit_tile``)."""
    from areno.kernels import adamw8bit

    default = dict(adamw8bit.TILE)
    if tile is not None:
        adamw8bit.TILE.update(rows=tile[0], num_warps=tile[1])
    try:
        rec = train_areno(model, args, device, base, n_active, states)
        if states == "8bit":
            rec["adamw8bit_tile"] = f"{adamw8bit.TILE['rows']}x{adamw8bit.TILE['num_warps']}"
        return rec
    finally:
        adamw8bit.TILE.update(default)


def train_hf(hf, args, device, base: dict, n_active: int) -> dict:
    state = (hf.train(), torch.optim.AdamW(hf.parameters(), lr=1e-6))
    rec = train_step.measure("transformers", state, "T1", base["batch"], base["seqlen"], False, device, args,
                             hf.config.vocab_size, n_active)
    return show({**base, **rec, **hf_fields(hf)})


def run_train(name: str, args, device, dtype) -> list[dict]:
    layers = args.layers_train.get(name, 4 if args.smoke else SHAPES[name][2])
    raw = config_of(name, layers, args.smoke)
    batch, seqlen = (train_step.SMOKE_WORKLOADS if args.smoke else train_step.WORKLOADS)["T1"]
    model = models.random_model(raw, dtype, device, unit_norms=True, attn_backend=args.attn_backend)
    n_active = active_params(model)
    base = dict(workload="T1", shape=name, layers=layers, batch=batch, seqlen=seqlen,
                parameters=sum(p.numel() for p in model.parameters()), active_parameters=n_active)
    records = []
    for states in args.optimizer_states.split(","):
        for tile in (args.adamw8bit_tiles or [None]) if states == "8bit" else [None]:
            records.append(train_8bit_tile(tile, model, args, device, base, n_active, states))
            free(device)
    why = hf_missing(raw) if "transformers" in args.impls else "not asked (--impls)"
    if why is None:
        try:
            hf = hf_model(raw, model, dtype, device)
            del model
            free(device)
            records.append(train_hf(hf, args, device, base, n_active))
            del hf
        except Exception as e:
            records.append(failed(dict(base, impl="transformers"), e))
    else:
        print(f"{name} T1 transformers: {why}", flush=True)
    free(device)
    return records


def compare(records: list[dict]) -> None:
    """areno's rows get ``speedup_vs_hf`` (and ``memory_vs_hf`` for T1) against transformers' row of the shape and
    workload (within one part's rows)."""
    hf = {(r["workload"], r["shape"]): r for r in records if r.get("impl") == "transformers" and "error" not in r}
    for r in records:
        ref = hf.get((r.get("workload"), r.get("shape")))
        if r.get("impl") != "areno" or ref is None or "error" in r:
            continue
        if r["workload"] == "R1" and "tok_s" in r and "tok_s" in ref:
            r["speedup_vs_hf"] = r["tok_s"] / ref["tok_s"]
        if r["workload"] == "T1" and "step_ms" in r and "step_ms" in ref:
            r["speedup_vs_hf"] = ref["step_ms"] / r["step_ms"]
            if "loop_ms" in r and "loop_ms" in ref:
                r["loop_speedup_vs_hf"] = ref["loop_ms"] / r["loop_ms"]
            if "peak_gib" in r and "peak_gib" in ref:
                r["memory_vs_hf"] = r["peak_gib"] / ref["peak_gib"]


def verdicts(records: list[dict]) -> None:
    for r in records:
        if r.get("impl") != "areno" or "speedup_vs_hf" not in r:
            continue
        if r["workload"] == "R1" and r.get("call") == "warm":
            sd = r.get("mamba_ssm_cache_dtype", "float32")
            print(f"{r['shape']} R1 target (>= 10x transformers' generate): {r['speedup_vs_hf']:.1f}x "
                  f"({r['tok_s']:.0f} tok/s, {sd} states)")
        elif r["workload"] == "T1":
            mem = r.get("memory_vs_hf", float("nan"))
            ok = r["speedup_vs_hf"] >= 1.5 and mem <= 1.0
            tile = f", tile {r['adamw8bit_tile']}" if r.get("adamw8bit_tile") else ""
            print(f"{r['shape']} T1 ({r['optimizer_states']} moments{tile}) target (>= 1.5x transformers + AdamW, "
                  "no more memory): "
                  f"{'PASS' if ok else 'FAIL'} ({r['speedup_vs_hf']:.2f}x, {mem:.2f}x peak memory, MFU {r['mfu']:.1%})")


def layer_counts(text: str) -> dict:
    """``shape=layers,...`` (e.g. ``qwen3_5-9b=16``) -> {shape: layers}."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, n = item.partition("=")
        if name not in SHAPES or not n.isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(f"expected SHAPE=LAYERS with SHAPE in {sorted(SHAPES)}, got {item!r}")
        out[name] = int(n)
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"any of {','.join(SHAPES)}")
    ap.add_argument("--parts", default="rollout,train", help="rollout (R1), train (T1) or both")
    ap.add_argument("--impls", default="areno,transformers", help="areno always runs; transformers: the baseline")
    ap.add_argument("--layers-rollout", type=layer_counts, default={}, help="SHAPE=LAYERS,... (defaults: 32 and 8)")
    ap.add_argument("--layers-train", type=layer_counts, default={}, help="SHAPE=LAYERS,... (defaults: 8 and 4)")
    ap.add_argument("--attn-backend", default=None, help="areno's attention backend (default: load_model's choice)")
    ap.add_argument("--eager", action="store_true", help="areno's rollout without CUDA graphs")
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps chained per scheduling round")
    ap.add_argument("--state-dtypes", default="float32", help="R1: areno's recurrent state pool, each of float32, "
                    "bfloat16 (--mamba-ssm-cache-dtype; the default float32 is the trainer's precision)")
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=128 + 256 + 16)
    ap.add_argument("--kv-cache-memory", type=float, default=None, help="fraction of free memory or bytes")
    ap.add_argument("--hf-prompts", type=int, default=256, help="R1 prompts transformers generates for")
    ap.add_argument("--hf-max-time-s", type=float, default=60.0, help="cap on transformers' generate call")
    ap.add_argument("--graphs", default="off", choices=["off", "on"], help="areno's train step as CUDA graphs")
    ap.add_argument("--optimizer-states", default="fp32,8bit",
                    help="areno's AdamW moments, one T1 row each: fp32, 8bit or fp32,8bit (--optimizer-states)")
    ap.add_argument("--adamw8bit-tiles", type=tiles, default=[], help="T1 8bit: one row per tile of the 8-bit "
                    "AdamW kernel, ROWSxWARPS,... (adamw8bit.TILE; default: the module's)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--hf-warmup", type=int, default=1)
    ap.add_argument("--hf-iters", type=int, default=3)
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/families.jsonl")
    args = ap.parse_args(argv)
    bad = sorted(set(args.shapes.split(",")) - set(SHAPES)) + sorted(set(args.parts.split(",")) - {"rollout", "train"})
    bad += sorted(set(args.impls.split(",")) - {"areno", "transformers"})
    bad += sorted(set(args.optimizer_states.split(",")) - {"fp32", "8bit"})
    if bad:
        ap.error(f"unknown --shapes / --parts / --impls entries {bad}")
    t1_8bit = "8bit" in args.optimizer_states.split(",") and "train" in args.parts.split(",")
    if args.adamw8bit_tiles and not t1_8bit:
        ap.error("--adamw8bit-tiles: T1's 8-bit moments' kernel; needs train in --parts, 8bit in --optimizer-states")
    if args.smoke:
        args.max_running, args.max_model_len, args.hf_prompts = 16, 128, min(args.hf_prompts, 8)
        args.warmup, args.iters, args.hf_warmup, args.hf_iters = 1, 1, 1, 1
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":  # tiny matmuls: extra threads only spin against the other processes of a busy host
        torch.set_num_threads(1)
    if args.attn_backend is None:  # as load_model picks it
        from areno.platform import default_attn_backend

        args.attn_backend = default_attn_backend() if device.type == "cuda" else "flash"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    t_start, env = time.perf_counter(), env_info()
    records = []
    for name in args.shapes.split(","):
        for part in args.parts.split(","):
            t0 = time.perf_counter()
            try:
                rows = (run_rollout if part == "rollout" else run_train)(name, args, device, dtype)
            except Exception as e:  # e.g. the model does not fit: report it, run the other parts
                rows = [failed(dict(workload="R1" if part == "rollout" else "T1", shape=name, impl="areno"), e)]
                free(device)
            compare(rows)
            print(f"{name} {part} done in {time.perf_counter() - t0:.1f}s", flush=True)
            if not args.no_save and not args.smoke:  # each part's rows kept at once (a run cut short keeps them)
                print("results:", append_jsonl("families", rows, env), flush=True)
            records += rows
    cols = ["shape", "workload", "impl", "layers", "call", "optimizer_states", "adamw8bit_tile",
            "mamba_ssm_cache_dtype", "sequences",
            "tok_s", "wall_s", "decode_ms", "decode_frac_floor",
            "step_ms", "mfu", "peak_gib", "speedup_vs_hf", "memory_vs_hf", "logprob_diff_mean", "note",
            "error"]  # fmt: skip
    print_table(records, cols)
    verdicts(records)
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    return records


if __name__ == "__main__":
    main()

"""Rollout with images: 256 prompts with one 448x448 image each through areno's engine, Qwen3-VL-2B shape.

    python bench/rollout_vl.py             # H200: Qwen3-VL-2B shape, random bf16 weights (a few minutes)
    python bench/rollout_vl.py --smoke     # CPU: a tiny shape, checks the script (times meaningless)

Model: Qwen3-VL-2B's shape with random bf16 weights (std 0.02, as bench/models.py does for Qwen3), written once by
``make_tiny_checkpoint(family="qwen3_vl")`` and cached beside the other bench checkpoints: text 28 layers, hidden
2048, MLP 6144, 16/8 heads of 128, vocab 151,936, tied embeddings, M-RoPE sections [24, 20, 20]; vision 24 blocks,
hidden 1024, MLP 4096, 16 heads, patch 16, merge 2, DeepStack after blocks 5, 11, 17 (max_position_embeddings cut to
32,768: the RoPE tables only).

Workload V-R1: 256 prompts, each ``16 random text tokens <|vision_start|> 196 image tokens <|vision_end|> 48 random
text tokens`` (one 448x448 image: a 28x28 patch grid of random normalised pixels, so every image differs and the
prefix cache cannot help), 256 new tokens each, temperature 1.0, no early stop, log-probs returned. Measured:
- areno, a first call (graph capture, compilation) and a warm call on fresh prompts and images (the headline);
- areno on the same prompts with the image tokens replaced by text tokens (same lengths, no tower, plain RoPE):
  what the images cost (``vs_text``);
- the tower alone on the warm call's 256 images (in the engine's grouping: the images of the prompts admitted in
  one step go through the tower together; here in groups of ``--tower-group``);
- after the warm call, the sampled tokens through the training forward (packed, [3, T] positions, the tower inside)
  and ``linear_logprobs``: the mean |difference| from the engine's log-probs (rows whose output holds the image
  placeholder id are left out: a packed training row would read it as an image);
- transformers ``Qwen3VLForConditionalGeneration.generate`` (sdpa, bf16, do_sample, min_new_tokens) on the first
  ``--hf-prompts`` prompts as one left-padded batch, capped by ``--hf-max-time-s``.
One JSON line per measurement goes to bench/results/rollout_vl.jsonl.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import models  # noqa: E402
from common import append_jsonl, env_info, print_table  # noqa: E402

QWEN3_VL_2B = dict(
    text_config=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=32768,
                     initializer_range=0.02, rope_parameters=dict(rope_type="default", rope_theta=5e6,
                                                                  mrope_section=[24, 20, 20], mrope_interleaved=True)),
    vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16,
                       temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2048, num_position_embeddings=2304,
                       deepstack_visual_indexes=[5, 11, 17], initializer_range=0.02),
    tie_word_embeddings=True,
)  # fmt: skip
SMOKE = dict(
    text_config=dict(vocab_size=2048, max_position_embeddings=2048),
    vision_config=dict(patch_size=16, num_position_embeddings=64),
)
FIRST_TEXT_ID = 1100  # random text ids from here: above the tiny tokenizer's special and vision tokens


def checkpoint(smoke: bool) -> Path:
    """The cached random checkpoint (written into a temp folder and renamed, so a killed run leaves none half)."""
    from areno.testing import make_tiny_checkpoint

    path = models.cache_root() / ("qwen3-vl-smoke" if smoke else "qwen3-vl-2b-std002-seed0")
    if (path / "model.safetensors").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
    try:
        dtype = torch.float32 if smoke else torch.bfloat16
        make_tiny_checkpoint(tmp, "qwen3_vl", seed=0, dtype=dtype, **(SMOKE if smoke else QWEN3_VL_2B))
        try:
            tmp.rename(path)
        except OSError:  # another process made it meanwhile
            if not (path / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


class Prompt:
    """A ``MultimodalPrompt``-like prompt (what ``Engine.generate`` takes): ids, one image's patches and grid."""

    def __init__(self, input_ids, pixel_values, image_grid_thw):
        self.input_ids, self.pixel_values, self.image_grid_thw = input_ids, pixel_values, image_grid_thw


def workload(cfg, n: int, image_px: int, seed: int, text: tuple[int, int] = (16, 48)) -> list[Prompt]:
    vc = cfg.vision
    side = image_px // vc.patch_size
    grid = torch.tensor([[1, side, side]])
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        before, after = (torch.randint(FIRST_TEXT_ID, cfg.vocab_size, (k,), generator=gen).tolist() for k in text)
        ids = before + [cfg.vision_start_token_id] + [cfg.image_token_id] * (side * side // vc.spatial_merge_size**2)
        ids += [cfg.vision_end_token_id] + after
        out.append(Prompt(ids, torch.randn(side * side, vc.patch_dim, generator=gen), grid))
    return out


def as_text(prompts: list[Prompt], cfg, seed: int) -> list[list[int]]:
    """The same prompts with every image token replaced by a random text token (same lengths)."""
    gen = torch.Generator().manual_seed(seed)
    return [[int(torch.randint(FIRST_TEXT_ID, cfg.vocab_size, (1,), generator=gen)) if t == cfg.image_token_id else t
             for t in p.input_ids] for p in prompts]  # fmt: skip


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_generate(engine, prompts, new, device):
    from areno.config import SamplingParams

    sync(device)
    t0 = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True))
    sync(device)
    return out, time.perf_counter() - t0


@torch.no_grad()
def tower_time(model, prompts, group: int, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), group):
        chunk = prompts[i : i + group]
        model.encode_images(torch.cat([p.pixel_values for p in chunk]).to(device),
                            torch.cat([p.image_grid_thw for p in chunk]).to(device))  # fmt: skip
    sync(device)
    return time.perf_counter() - t0


@torch.no_grad()
def logprob_diff(model, prompts, completions, device, max_tokens=16384) -> dict:
    """Mean/max |rollout log-prob - training-forward log-prob| (packed rows, [3, T] positions, the tower inside)."""
    from areno.kernels.logprobs import linear_logprobs

    image_id = model.config.image_token_id
    rows = [(p, c) for p, g in zip(prompts, completions) for c in g if image_id not in c.token_ids]
    diffs, i = [], 0
    while i < len(rows):
        chunk, n = [], 0
        while i < len(rows) and (not chunk or n + len(rows[i][1].prompt_ids) + len(rows[i][1].token_ids) <= max_tokens):
            chunk.append(rows[i])
            n += len(rows[i][1].prompt_ids) + len(rows[i][1].token_ids)
            i += 1
        seqs = [c.prompt_ids + c.token_ids for _, c in chunk]
        lens = torch.tensor([len(s) for s in seqs])
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32)
        ids = torch.tensor([t for s in seqs for t in s])
        grid = torch.cat([p.image_grid_thw for p, _ in chunk])
        positions, _ = model.mrope_positions(ids, grid, cu)
        targets = torch.full_like(ids, -100)
        for (_, c), start in zip(chunk, cu[:-1].tolist()):
            p = len(c.prompt_ids)
            targets[start + p - 1 : start + p - 1 + len(c.token_ids)] = torch.tensor(c.token_ids)
        hidden = model(ids.to(device), positions.to(device), cu.to(device), int(lens.max()),
                       pixel_values=torch.cat([p.pixel_values for p, _ in chunk]).to(device),
                       image_grid_thw=grid.to(device))  # fmt: skip
        mask = targets >= 0
        lp = linear_logprobs(hidden[mask.to(device)], model.lm_head_weight, targets[mask].to(device), temperature=1.0)
        diffs += (lp.double().cpu() - torch.tensor([x for _, c in chunk for x in c.logprobs]).double()).abs().tolist()
    return {"logprob_diff_mean": sum(diffs) / max(1, len(diffs)), "logprob_diff_max": max(diffs, default=0.0),
            "logprob_tokens": len(diffs), "logprob_rows_skipped": sum(len(g) for g in completions) - len(rows)}


def run_areno(path, device, args) -> list[dict]:
    from areno.engine.engine import Engine, EngineConfig
    from areno.models import load_model

    model = load_model(path, device=device)
    cfg = model.config
    engine = Engine(model, None, EngineConfig(
        block_size=16, max_running=args.prompts, max_batched_tokens=args.max_batched_tokens,
        max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_memory, eager_decode=args.eager,
        decode_steps=args.decode_steps), eos_token_ids=[])  # fmt: skip
    print(f"areno engine: {engine.blocks.num_blocks} KV blocks of 16, cuda graphs {'off' if args.eager else 'on'}, "
          f"decode steps per round {args.decode_steps}", flush=True)  # fmt: skip
    records = []
    for call, seed in (("first", 1), ("warm", 2), ("text", 2)):
        rec = dict(impl="areno", workload="V-R1" if call != "text" else "V-R1 as text", call=call,
                   decode_steps=args.decode_steps)  # fmt: skip
        try:
            prompts = workload(cfg, args.prompts, args.image_px, seed)
            batch = as_text(prompts, cfg, seed) if call == "text" else prompts
            out, dt = timed_generate(engine, batch, args.new_tokens, device)
            tokens = sum(len(c.token_ids) for g in out for c in g)
            rec.update(sequences=len(batch), prompt_tokens=sum(len(p.input_ids) for p in prompts),
                       output_tokens=tokens, wall_s=dt, tok_s=tokens / dt,
                       complete=tokens == args.prompts * args.new_tokens, graphs=len(engine.runner.graphs))  # fmt: skip
            if call == "warm":
                rec["tower_s"] = tower_time(model, prompts, args.tower_group, device)
                t0 = time.perf_counter()
                rec.update(logprob_diff(model, prompts, out, device))
                rec["logprob_check_s"] = time.perf_counter() - t0
            engine.reset_prefix_cache()
        except Exception as e:  # a failing call is reported, the others still run
            traceback.print_exc()
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
            engine.abort(list(engine.scheduler.running) + list(engine.scheduler.waiting))
        print(fmt(rec), flush=True)
        records.append(rec)
    engine.drop_rollout_state()
    del engine, model
    return records


@torch.no_grad()
def run_hf(path, device, args) -> list[dict]:
    import transformers

    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(path), dtype=dtype,
                                                                        attn_implementation="sdpa")  # fmt: skip
    model = model.to(device).eval()
    image_id = model.config.image_token_id
    rec = dict(impl="transformers", workload="V-R1", call="warm")
    try:
        from areno.models.registry import get_adapter

        acfg = get_adapter("qwen3_vl").config_from_hf(model.config)
        prompts = workload(acfg, args.hf_prompts, args.image_px, seed=2)

        def generate(batch, new, max_time=None):
            width = max(len(p.input_ids) for p in batch)
            ids = torch.tensor([[models.PAD_ID] * (width - len(p.input_ids)) + p.input_ids for p in batch])
            mask = (torch.arange(width)[None] >= torch.tensor([width - len(p.input_ids) for p in batch])[:, None])
            sync(device)
            t0 = time.perf_counter()
            out = model.generate(ids.to(device), attention_mask=mask.long().to(device),
                                 pixel_values=torch.cat([p.pixel_values for p in batch]).to(device, dtype),
                                 image_grid_thw=torch.cat([p.image_grid_thw for p in batch]).to(device),
                                 mm_token_type_ids=(ids == image_id).int().to(device), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 pad_token_id=models.PAD_ID, max_time=max_time)  # fmt: skip
            sync(device)
            return out.shape[1] - width, time.perf_counter() - t0

        generate(prompts[:2], 8)  # warm-up
        steps, dt = generate(prompts, args.new_tokens, args.hf_max_time_s)
        tokens = steps * len(prompts)
        rec.update(sequences=len(prompts), output_tokens=tokens, wall_s=dt, tok_s=tokens / dt,
                   complete=steps >= args.new_tokens)  # fmt: skip
        if steps < args.new_tokens:
            rec["note"] = f"stopped by max_time {args.hf_max_time_s}s after {steps} of {args.new_tokens} steps"
        elif len(prompts) < args.prompts:
            rec["note"] = f"{len(prompts)} of the {args.prompts} prompts"
    except Exception as e:
        traceback.print_exc()
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    print(fmt(rec), flush=True)
    return [rec]


def fmt(rec):
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on any device (checks the script)")
    ap.add_argument("--impls", default="areno,transformers")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--image-px", type=int, default=448, help="square image side in pixels (a multiple of 32)")
    ap.add_argument("--eager", action="store_true", help="areno without CUDA graphs (--eager-decode)")
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps chained per scheduling round (1 = off)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-memory", type=float, default=None, help="fraction of free memory or bytes")
    ap.add_argument("--tower-group", type=int, default=32, help="images per tower call in the tower-alone timing")
    ap.add_argument("--hf-prompts", type=int, default=32)
    ap.add_argument("--hf-max-time-s", type=float, default=120.0, help="cap on the transformers generate call")
    ap.add_argument("--no-save", action="store_true", help="do not append to bench/results/rollout_vl.jsonl")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.prompts, args.new_tokens, args.image_px, args.hf_prompts = 4, 8, 64, 2
        args.max_model_len, args.tower_group = 256, 2
    if args.image_px % 32:
        ap.error(f"--image-px {args.image_px} is not a multiple of 32 (patch 16, merge 2)")
    t_start = time.perf_counter()
    path = checkpoint(args.smoke)
    print(f"checkpoint {path} ({time.perf_counter() - t_start:.1f}s)", flush=True)
    records = []
    for impl in args.impls.split(","):
        t0 = time.perf_counter()
        try:
            records += {"areno": run_areno, "transformers": run_hf}[impl](path, device, args)
        except Exception as e:
            traceback.print_exc()
            records.append(dict(impl=impl, error=f"{type(e).__name__}: {e}"[:300]))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{impl} done in {time.perf_counter() - t0:.1f}s", flush=True)
    by = {(r["impl"], r.get("call")): r for r in records if "tok_s" in r}
    warm, text, hf = by.get(("areno", "warm")), by.get(("areno", "text")), by.get(("transformers", "warm"))
    if warm and text:
        warm["vs_text"] = warm["tok_s"] / text["tok_s"]
    if warm and hf:
        warm["speedup_vs_hf"] = warm["tok_s"] / hf["tok_s"]
    cols = ["impl", "workload", "call", "sequences", "output_tokens", "wall_s", "tok_s", "vs_text", "speedup_vs_hf",
            "tower_s", "logprob_diff_mean", "logprob_diff_max", "note", "error"]  # fmt: skip
    print_table(records, cols)
    print(f"total {time.perf_counter() - t_start:.0f}s", flush=True)
    if not args.no_save and not args.smoke:
        env = env_info()
        env["shape"] = "qwen3-vl-2b"
        print("results:", append_jsonl("rollout_vl", records, env))


if __name__ == "__main__":
    main()

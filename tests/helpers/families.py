"""Shared pieces of the per-family tests: tensor-parallel workers on gloo, the arithmetic data set of the `areno train`
tests, and the check that the engine's captured routes are those of a plain forward."""

from __future__ import annotations

import json
import random
import socket
import time

import torch
import torch.multiprocessing as mp

from areno.models.attention_metadata import AttentionMetadata


def spawn_tp(worker, args: tuple, nprocs: int = 2, timeout: float = 240) -> None:
    """Run ``worker(rank, nprocs, port, *args)`` in ``nprocs`` processes (a free local port), killed past
    ``timeout`` seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.spawn(worker, args=(nprocs, port, *args), nprocs=nprocs, join=False)
    deadline = time.time() + timeout
    while not ctx.join(timeout=5):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError("TP workers did not finish")


def write_arith_data(root, rows: int, seed: int = 0):
    """``a+b=`` prompts (SFT response, RL answer, DPO chosen/rejected) as ``data.jsonl`` and a length-based reward
    plugin ``reward.py`` under ``root``; returns their paths."""
    rng = random.Random(seed)
    lines = []
    for _ in range(rows):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        lines.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "response": str(a + b),
                      "answer": str(a + b), "chosen": str(a + b), "rejected": str(a + b + 1)})
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    reward = root / "reward.py"
    reward.write_text("def reward_fn(record):\n    return float(len(record.completion) % 3 == 0)\n")
    return data, reward


def assert_routes_match_forward(model, completions) -> None:
    """Each completion's ``routed_experts`` (per token and MoE layer, -1 for the last, never fed token) are the top-k
    experts a plain forward over the same tokens picks."""
    for c in completions:
        ids = c.prompt_ids + c.token_ids
        t = len(ids)
        cu = torch.tensor([0, t], dtype=torch.int32)
        meta = AttentionMetadata(None, True, cu, cu, t, t)
        meta.routing_out = torch.full((model.num_moe_layers, t, model.moe_top_k), -1, dtype=torch.int32)
        with torch.no_grad():
            model(torch.tensor(ids), torch.arange(t), attn_metadata=meta)
        got = torch.from_numpy(c.routed_experts).long()
        assert got.shape == (t, model.num_moe_layers, model.moe_top_k)
        assert (got[-1] == -1).all() and (got[:-1] >= 0).all()
        want = meta.routing_out.permute(1, 0, 2).long()[:-1]
        assert torch.equal(got[:-1].sort(-1).values, want.sort(-1).values)


def assert_preemption_keeps_tokens(model, tok, prompts, opts, engine, ref) -> None:
    """An engine (``engine(model, tok, **kw)``, block size 4) whose cache holds 12 blocks (and 6 state slots for a
    hybrid) must preempt, and gives the tokens of ``ref`` (the same requests' outputs without preemption)."""
    from areno.engine.kv_cache import kv_bytes_per_block, state_bytes

    budget = 12 * kv_bytes_per_block(model, 4, torch.float32) + state_bytes(model, 6, torch.float32)
    small = engine(model, tok, max_running=6, kv_cache_memory=budget)
    assert small.blocks.num_blocks == 12
    tight = small.generate(prompts, opts)
    assert small.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in g] for g in tight] == [[c.token_ids for c in g] for g in ref]
    assert small.blocks.num_free == small.blocks.num_blocks


def tiny_rl_files(root, rows: int = 32):
    """A tiny qwen3 checkpoint and the arithmetic data set under ``root``: (ckpt, data, reward) paths."""
    from areno.testing import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(root / "ckpt", family="qwen3", seed=0)
    return (ckpt, *write_arith_data(root, rows))

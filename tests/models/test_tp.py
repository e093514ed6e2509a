"""Tensor parallel on two gloo processes equals one process: logits, loss, gradients, and the saved checkpoint.

Covers qwen3 (KV heads split), qwen3_moe (experts' intermediate dim split, with activation checkpointing, routing
replicated), llama with one KV head and biases (KV head replicated: its gradient summed over the two ranks) and
qwen3_vl with two images (decoder sharded, vision tower and mergers replicated: every rank runs them and holds the
same gradient without a collective), olmo2 (its QK-norm weight split with the heads, sums of squares all-reduced)
olmo3 (olmo2 plus a sliding window shorter than the sequences), gpt_oss (sinks split with the query heads, the
experts' interleaved gate/up columns split in whole pairs, the down bias added after the all-reduce) and
gemma4_text (KV-shared layers, per-layer inputs, global layers' single KV head replicated, the MoE block's
experts replicated).
"""

import os

import torch
import torch.distributed as dist
from hf_reference import next_token_targets
from safetensors import safe_open

from areno.models import iter_hf_tensors, load_model, save_model
from areno.testing.gemma4 import EVERY_FEATURE
from tests.helpers.families import spawn_tp

CASES = {
    "qwen3": dict(),
    "qwen3_moe": dict(),
    "llama": dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    "qwen3_vl": dict(),
    "olmo2": dict(attention_bias=True),
    "olmo3": dict(),  # 13 tokens past its window of 4
    "gpt_oss": dict(),  # sinks split with the heads, interleaved gate/up columns split in pairs, window 4
    "gemma4_text": EVERY_FEATURE,  # global layers' one KV head replicated; experts replicated
}
CHECKPOINTING = {"qwen3": False, "qwen3_moe": True, "llama": False, "qwen3_vl": True, "olmo2": True, "olmo3": False,
                 "gpt_oss": True, "gemma4_text": True}
VL_GRID = torch.tensor([[1, 8, 8], [1, 6, 10]])  # two images: 16 and 15 tokens


def _vl_batch(cfg):
    """Token ids with two images' placeholders, and random pixel rows for them."""
    gen = torch.Generator().manual_seed(3)
    pixel_values = torch.randn(int(VL_GRID.prod(-1).sum()), cfg.vision.patch_dim, generator=gen)
    ids = torch.randint(0, 990, (4,), generator=gen).tolist()
    for t, h, w in VL_GRID.tolist():
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (t * h * w // 4) + [cfg.vision_end_token_id, 7]
    return torch.tensor(ids)[None], pixel_values


def _ids():
    return torch.randint(0, 1000, (2, 13), generator=torch.Generator().manual_seed(7))


def _run(model, family):
    """Logits, loss and HF-named gradients of one fwd+bwd (the same code for TP=1 and TP=2)."""
    ids = _ids()
    with torch.no_grad():
        logits = model.logits(ids)
    model.train()
    model.set_activation_checkpointing(CHECKPOINTING[family])
    if family == "qwen3_vl":
        ids, pv = _vl_batch(model.config)
        positions = model.mrope_positions(ids[0], VL_GRID)[0]
        hidden = model(ids[0], positions, pixel_values=pv, image_grid_thw=VL_GRID)
    else:
        b, t = ids.shape
        cu = torch.arange(0, (b + 1) * t, t, dtype=torch.int32)
        hidden = model(ids.reshape(-1), torch.arange(t).repeat(b), cu, t)
    targets = next_token_targets(ids)
    loss = -model.token_logprobs(hidden, targets).sum() / (targets >= 0).sum()
    loss.backward()
    return logits, loss.detach(), dict(iter_hf_tensors(model, grads=True))


def _worker(rank, world, port, paths, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from areno.distributed import parallel

    parallel.init_distributed("gloo", tp_size=world)
    group = parallel.get_tp_group()
    results = {}
    for family, path in paths.items():
        model = load_model(path, device="cpu", tp_group=group)
        assert model.tp_size == world and parallel.tp_rank() == rank
        attn, cfg = model.layers[0].self_attn, model.config
        assert attn.num_heads == cfg.num_heads // world
        assert model.num_kv_heads_local == max(1, cfg.num_kv_heads // world)
        assert model.embed_tokens.weight.shape[0] == cfg.vocab_size // world
        results[family] = _run(model, family)
        if family == "qwen3_vl":  # the replicated tower's gradient is the same on every rank
            assert model.visual.blocks[0].attn.qkv.weight.shape[0] == 3 * cfg.vision.hidden_size
            for p in model.visual.parameters():
                theirs = p.grad.clone()
                dist.broadcast(theirs, src=0)
                assert torch.equal(theirs, p.grad)
        save_model(model, os.path.join(out_dir, family))
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    parallel.destroy_distributed()


def test_tp2_equals_tp1(tiny_checkpoint, tmp_path):
    paths = {family: str(tiny_checkpoint(family, **overrides)) for family, overrides in CASES.items()}
    spawn_tp(_worker, (paths, str(tmp_path)))
    results = torch.load(tmp_path / "results.pt")
    assert not dist.is_initialized()
    for family, path in paths.items():
        logits2, loss2, grads2 = results[family]
        logits1, loss1, grads1 = _run(load_model(path, device="cpu"), family)
        assert (logits2 - logits1).abs().max() <= 1e-5 * logits1.abs().max(), family
        torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=1e-6)
        assert set(grads2) == set(grads1)
        for name, g in grads1.items():
            assert (grads2[name] - g).abs().max() <= 1e-4 * g.abs().max().clamp_min(1e-8), (family, name)
        # the checkpoint saved from two shards is the source checkpoint, bit for bit
        saved, source = tmp_path / family / "model.safetensors", os.path.join(path, "model.safetensors")
        with safe_open(str(saved), framework="pt") as a, safe_open(source, framework="pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            for k in b.keys():
                assert torch.equal(a.get_tensor(k), b.get_tensor(k)), (family, k)


def test_tp_size_must_divide_heads_and_intermediate(tiny_checkpoint):
    from areno.models.tp import check_divisible

    cfg = load_model(tiny_checkpoint("qwen3_moe"), device="cpu").config  # 4 heads, 2 KV heads, I 128, moe I 32
    check_divisible(cfg, 4)  # KV heads replicated: 4 ranks over 2 KV heads
    try:
        check_divisible(cfg, 3)
    except ValueError as e:
        assert "num_attention_heads=4" in str(e) and "intermediate_size=128" in str(e) and "--tp-size 3" in str(e)
    else:
        raise AssertionError("TP 3 accepted")


def test_kv_head_shards_when_replicated():
    from areno.models.tp import Part, part_range

    kv = Part("k", size=2 * 16, shape=(32, 64), kind="kv", unit=16)  # 2 KV heads of dim 16
    assert [part_range(kv, True, r, 2) for r in range(2)] == [(0, 16), (16, 16)]
    assert [part_range(kv, True, r, 4) for r in range(4)] == [(0, 16), (0, 16), (16, 16), (16, 16)]
    q = Part("q", size=4 * 16, shape=(64, 64))
    assert [part_range(q, True, r, 4) for r in range(4)] == [(0, 16), (16, 16), (32, 16), (48, 16)]
    assert part_range(q, False, 3, 4) == (0, 64)

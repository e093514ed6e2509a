"""Qwen3.5 tensor parallel on two gloo processes equals one process (dense with one KV head replicated, MoE with its
shared expert; activation checkpointing): logits, loss, every gradient, and the saved checkpoint bit-identical."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from hf_reference import hub_tensors, packed_loss

from areno.models import iter_hf_tensors, load_model, save_model
from tests.helpers.families import spawn_tp

CASES = {"qwen3_5": dict(num_key_value_heads=1), "qwen3_5_moe": dict()}
pytestmark = pytest.mark.skipif(not hasattr(transformers, "Qwen3_5TextConfig"),
                                reason=f"transformers {transformers.__version__} has no qwen3_5")


def _run(model):
    ids = torch.randint(0, 1000, (2, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model.logits(ids)
    model.train()
    model.set_activation_checkpointing(True)
    loss = packed_loss(model, ids)
    loss.backward()
    return logits, loss.detach(), dict(iter_hf_tensors(model, grads=True))


def _worker(rank, world, port, paths, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from areno.distributed import parallel

    parallel.init_distributed("gloo", tp_size=world)
    results = {}
    for family, path in paths.items():
        model = load_model(path, device="cpu", tp_group=parallel.get_tp_group())
        assert model.layers[0].self_attn.nk == 1 and model.layers[1].self_attn.num_heads == 2
        results[family] = _run(model)
        save_model(model, os.path.join(out_dir, family))
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    parallel.destroy_distributed()


def test_tp2_equals_tp1(tiny_checkpoint, tmp_path):
    paths = {family: str(tiny_checkpoint(family, **overrides)) for family, overrides in CASES.items()}
    spawn_tp(_worker, (paths, str(tmp_path)), timeout=300)
    assert not dist.is_initialized()
    results = torch.load(tmp_path / "results.pt")
    for family, path in paths.items():
        logits2, loss2, grads2 = results[family]
        logits1, loss1, grads1 = _run(load_model(path, device="cpu"))
        assert (logits2 - logits1).abs().max() <= 1e-5 * logits1.abs().max(), family
        torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=1e-6)
        assert set(grads2) == set(grads1)
        for name, g in grads1.items():
            assert (grads2[name] - g).abs().max() <= 1e-4 * g.abs().max().clamp_min(1e-8), (family, name)
        a, b = hub_tensors(tmp_path / family), hub_tensors(Path(path))
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b), family


def test_a_tp_size_not_dividing_the_key_heads_is_refused(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3_5"), device="cpu")
    with pytest.raises(ValueError, match="--tp-size 4 does not divide linear_num_key_heads=2"):
        model.layers[0].self_attn.shard_heads(0, 4)

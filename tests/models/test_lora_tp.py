"""LoRA under tensor parallelism on two gloo processes equals one process: the adapter sharded with its layers
(column-parallel q/k/v/gate/up: lora_B's rows split as the base weight's, KV heads replicated where TP exceeds them;
row-parallel o/down: lora_A's columns split), logits, the adapter's gradients, a saved (gathered) adapter bit for bit,
and after one update."""

import os

import pytest
import torch
from hf_reference import next_token_targets
from safetensors.torch import load_file

from areno.models import load_model
from areno.models.lora import LoraSpec, attach
from areno.models.saver import iter_hf_tensors
from tests.helpers.families import spawn_tp

CASES = {"qwen3": dict(), "llama": dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True)}
SPEC = LoraSpec(rank=4, alpha=8.0)  # all-linear


def _randomised(path, out):
    """An adapter with A and B both random (so every path carries a delta), saved from one process."""
    model = load_model(path, device="cpu", dtype=torch.float32)
    adapter = attach(model, SPEC)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    adapter.save(out)
    return out


def _run(model, adapter, out, write):
    """Logits, the adapter's gradients (whole) after one fwd+bwd, and the adapter saved after an SGD step."""
    ids = torch.randint(0, 1000, (2, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model.logits(ids)
    b, t = ids.shape
    hidden = model(ids.reshape(-1), torch.arange(t).repeat(b), torch.arange(0, (b + 1) * t, t, dtype=torch.int32), t)
    targets = next_token_targets(ids)
    (-model.token_logprobs(hidden, targets).sum() / (targets >= 0).sum()).backward()
    grads = dict(iter_hf_tensors(adapter, grads=True))
    saved = adapter.save(os.path.join(out, "loaded"), write=write)
    with torch.no_grad():
        for p in adapter.parameters():
            p.sub_(0.5 * p.grad)
    adapter.save(os.path.join(out, "stepped"), write=write)
    return logits, grads, saved


def _worker(rank, world, port, cases, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from areno.distributed import parallel

    parallel.init_distributed("gloo", tp_size=world)
    results = {}
    for family, (path, start) in cases.items():
        model = load_model(path, device="cpu", dtype=torch.float32, tp_group=parallel.get_tp_group())
        adapter = attach(model, SPEC)
        adapter.load_weights(start)
        q = adapter.pair("model.layers.0.self_attn.q_proj")
        o = adapter.pair("model.layers.0.self_attn.o_proj")
        assert q.lora_B.shape[0] == model.config.num_heads * model.config.head_dim // world  # rows split
        assert o.lora_A.shape[1] == model.config.num_heads * model.config.head_dim // world  # columns split
        logits, grads, _ = _run(model, adapter, os.path.join(out_dir, family, "tp2"), rank == 0)
        results[family] = logits, grads
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    parallel.destroy_distributed()


def test_tp2_lora_equals_tp1(tiny_checkpoint, tmp_path):
    cases = {}
    for family, overrides in CASES.items():
        path = tiny_checkpoint(family, **overrides)
        cases[family] = (str(path), str(_randomised(path, tmp_path / family / "start")))
    spawn_tp(_worker, (cases, str(tmp_path)))
    results = torch.load(tmp_path / "results.pt")
    for family, (path, start) in cases.items():
        model = load_model(path, device="cpu", dtype=torch.float32)
        adapter = attach(model, SPEC)
        adapter.load_weights(start)
        logits1, grads1, _ = _run(model, adapter, str(tmp_path / family / "tp1"), True)
        logits2, grads2 = results[family]
        assert (logits2 - logits1).abs().max() <= 1e-5 * logits1.abs().max(), family
        assert set(grads2) == set(grads1) and len(grads1) == 2 * len(adapter.sites)
        for name, g in grads1.items():
            assert (grads2[name] - g).abs().max() <= 1e-4 * g.abs().max().clamp_min(1e-8), (family, name)
        source = load_file(os.path.join(start, "adapter_model.safetensors"))
        loaded = load_file(str(tmp_path / family / "tp2" / "loaded" / "adapter_model.safetensors"))
        assert loaded.keys() == source.keys() and all(torch.equal(loaded[k], source[k]) for k in source), family
        one = load_file(str(tmp_path / family / "tp1" / "stepped" / "adapter_model.safetensors"))
        two = load_file(str(tmp_path / family / "tp2" / "stepped" / "adapter_model.safetensors"))
        for k in one:
            assert not torch.equal(one[k], source[k]), k  # the step moved every tensor
            torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=1e-4)


def test_lora_under_tp_refuses_dropout(tiny_checkpoint):
    from areno.models.lora import LoraError

    model = load_model(tiny_checkpoint("qwen3"), device="cpu", dtype=torch.float32)
    model.tp_size = 2  # what attach reads; refused before anything is sharded
    with pytest.raises(LoraError, match="--lora-dropout: with --tp-size > 1 is not built yet"):
        attach(model, LoraSpec(rank=2, alpha=4.0, dropout=0.1))

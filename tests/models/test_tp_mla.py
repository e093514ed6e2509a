"""Tensor parallel on two gloo processes equals one process for the MLA families: DeepSeek-V3 (MLA heads split, latent
projections replicated, experts' and shared experts' intermediate dims split, MTP tensors replicated), Ling 3 and
Kimi-Linear (KDA heads split with their conv channels, decay and gates; Kimi's low-rank gates' second factor): logits,
loss, every gradient with activation checkpointing, the routing counters, and the checkpoint saved from two shards
bit for bit."""

import os

import pytest
import torch
import torch.distributed as dist
import transformers
from hf_reference import hub_tensors, packed_loss

from areno.models import iter_hf_tensors, load_model, save_model
from tests.helpers.families import spawn_tp

CONFIG_CLASS = {"deepseek_v3": "DeepseekV3Config", "bailing_hybrid": "BailingHybridConfig",
                "kimi_linear": "KimiLinearConfig"}
FAMILIES = [f for f, cls in CONFIG_CLASS.items() if hasattr(transformers, cls)]
CASES = {"deepseek_v3": dict(q_lora_rank=24), "bailing_hybrid": dict(), "kimi_linear": dict()}


def _run(model):
    ids = torch.randint(0, 1000, (2, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model.logits(ids)
    model.train()
    model.set_activation_checkpointing(True)
    loss = packed_loss(model, ids)
    loss.backward()
    return logits, loss.detach(), dict(iter_hf_tensors(model, grads=True)), model.expert_load()


def _worker(rank, world, port, paths, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from areno.distributed import parallel

    parallel.init_distributed("gloo", tp_size=world)
    results = {}
    for family, path in paths.items():
        model = load_model(path, device="cpu", tp_group=parallel.get_tp_group())
        mla = model.layers[model.kv_cache_layers[0]].self_attn
        assert mla.num_heads == model.num_kv_heads_local == 4 // world
        states, cfg = model.recurrent_state_shapes(), model.config
        assert states is None or states["recurrent"][0] == (cfg.linear_num_heads or cfg.num_heads) // world
        results[family] = _run(model)
        save_model(model, os.path.join(out_dir, family))
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    parallel.destroy_distributed()


@pytest.mark.skipif(not FAMILIES, reason=f"transformers {transformers.__version__} has none of the families")
def test_tp2_equals_tp1(tiny_checkpoint, tmp_path):
    paths = {f: str(tiny_checkpoint(f, **CASES[f])) for f in FAMILIES}
    spawn_tp(_worker, (paths, str(tmp_path)), timeout=480)
    assert not dist.is_initialized()
    results = torch.load(tmp_path / "results.pt")
    for family, path in paths.items():
        logits2, loss2, grads2, load2 = results[family]
        logits1, loss1, grads1, load1 = _run(load_model(path, device="cpu"))
        assert (logits2 - logits1).abs().max() <= 1e-5 * logits1.abs().max(), family
        torch.testing.assert_close(loss2, loss1, rtol=1e-5, atol=1e-6)
        assert torch.equal(load2, load1)  # routing is replicated: the same counts on every rank
        assert set(grads2) == set(grads1)
        for name, g in grads1.items():
            assert (grads2[name] - g).abs().max() <= 1e-4 * g.abs().max().clamp_min(1e-8), (family, name)
        a, b = hub_tensors(tmp_path / family), hub_tensors(tiny_checkpoint(family, **CASES[family]))
        assert sorted(a) == sorted(b)
        for k in b:
            assert torch.equal(a[k], b[k]), (family, k)


def test_tp_must_divide_the_kda_heads(tiny_checkpoint):
    from areno.models.tp import check_divisible

    if "kimi_linear" not in FAMILIES:
        pytest.skip("no kimi_linear in this transformers")
    cfg = load_model(tiny_checkpoint("kimi_linear"), device="cpu").config  # 4 MLA heads, 2 KDA heads
    check_divisible(cfg, 2)
    with pytest.raises(ValueError, match="linear_num_heads=2"):
        check_divisible(cfg, 4)

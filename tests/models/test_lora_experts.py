"""LoRA on MoE routed experts (areno.models.lora_experts, ``fused_moe_lora``): PEFT's ``target_parameters`` files
and math against the real ``peft`` package on transformers' tiny Qwen3-MoE (both ways), gradients against a float64
reference and PEFT's, the decode path against the training one, merging, refusals in one line."""

import pytest
import torch

from areno.kernels.moe.fused import fused_moe_reference
from areno.kernels.moe.lora import fused_moe_lora
from areno.models import load_model
from areno.models.lora import LoraError, LoraSpec, attach, read_peft_config
from areno.models.lora_experts import ExpertPair, ExpertSite

peft = pytest.importorskip("peft")
from hf_reference import load_reference  # noqa: E402

IDS = torch.tensor([[3, 17, 5, 42, 8, 11, 2, 30], [7, 7, 1, 19, 23, 4, 9, 12]])
BOTH = ("experts.gate_up_proj", "experts.down_proj")


def _randomise(adapter, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def _assert_peft_agrees(adapter, path, folder, ours, tol):
    """Save ``adapter`` into ``folder``: PEFT on transformers' model gives ``ours`` (the adapted areno logits)."""
    adapter.save(folder, base=str(path))
    ref = peft.PeftModel.from_pretrained(load_reference(path), str(folder))
    with torch.no_grad():
        torch.testing.assert_close(ours, ref(IDS).logits, atol=tol, rtol=tol)


def _areno(path):
    return load_model(path, dtype=torch.float32, device="cpu", attn_backend="native")


@pytest.mark.parametrize("targets", [(*BOTH, "q_proj"), ("experts.down_proj",), ("experts.gate_up_proj",),
                                     ("experts",)])
def test_the_saved_expert_adapter_gives_peft_the_same_logits(tiny_checkpoint, tmp_path, targets):
    path = tiny_checkpoint("qwen3_moe")
    model = _areno(path)
    base = model.logits(IDS).detach()
    adapter = attach(model, LoraSpec(rank=2, alpha=4.0, target_modules=targets))
    torch.testing.assert_close(model.logits(IDS), base)  # B starts at zero
    _randomise(adapter)
    ours = model.logits(IDS).detach()
    assert (ours - base).abs().max() > 1e-2
    _assert_peft_agrees(adapter, path, tmp_path / "a", ours, 2e-5)
    with adapter.disabled():
        torch.testing.assert_close(model.logits(IDS), base)
    assert read_peft_config(tmp_path / "a").target_modules == tuple(adapter.peft_config()["target_modules"]) + tuple(
        adapter.peft_config()["target_parameters"])


@pytest.mark.parametrize("family", ["deepseek_v3", "bailing_hybrid", "kimi_linear", "qwen3_5_moe", "gemma4_text"])
def test_every_family_s_expert_adapter_is_peft_s(tiny_checkpoint, tmp_path, family):
    """The other families whose routed experts are ``qwen3_moe.Experts`` (sigmoid-routed, Qwen3.5's with a shared
    expert, Gemma 4's GeGLU experts)."""
    from areno.testing.gemma4 import MOE

    path = tiny_checkpoint(family, **(MOE if family == "gemma4_text" else {}))
    model = _areno(path)
    adapter = attach(model, LoraSpec(rank=2, alpha=4.0, target_modules=("experts",)))
    assert adapter.expert_sites and not adapter.sites
    _randomise(adapter)
    ours = model.logits(IDS).detach()
    _assert_peft_agrees(adapter, path, tmp_path / "a", ours, 3e-5)


def test_a_peft_expert_adapter_loads_into_areno(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3_moe")
    conf = peft.LoraConfig(r=2, lora_alpha=8, target_modules=["k_proj"], target_parameters=list(BOTH),
                           init_lora_weights=False)
    pm = peft.get_peft_model(load_reference(path), conf)
    pm.save_pretrained(str(tmp_path / "theirs"))
    with torch.no_grad():
        theirs = pm(IDS).logits
    model = _areno(path)
    adapter = attach(model, read_peft_config(tmp_path / "theirs"))
    adapter.load_weights(tmp_path / "theirs")
    assert len(adapter.expert_sites) == 2 * model.num_moe_layers
    torch.testing.assert_close(model.logits(IDS).detach(), theirs, atol=2e-5, rtol=2e-5)


def test_only_the_adapter_trains_and_gradients_match_peft(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3_moe")
    model = _areno(path)
    model.train()
    adapter = attach(model, LoraSpec(rank=2, alpha=4.0, target_modules=(*BOTH, "v_proj")))
    _randomise(adapter, seed=1)
    adapter.save(tmp_path / "a", base=str(path))
    assert not any(p.requires_grad for p in model.parameters())
    model.set_activation_checkpointing(True)
    model.logits(IDS).float().logsumexp(-1).sum().backward()
    ref = peft.PeftModel.from_pretrained(load_reference(path), str(tmp_path / "a"), is_trainable=True)
    ref(IDS).logits.float().logsumexp(-1).sum().backward()
    theirs = {n.replace(".default", ""): p.grad for n, p in ref.named_parameters() if p.grad is not None}
    ours = dict(adapter.peft_state_dict())  # names only: gradients read from the live parameters below
    params = dict(adapter.named_parameters())
    for pname, lays in adapter._tp_layouts.items():
        name = lays[0].parts[0].hf_name
        assert name in ours and name in theirs, name
        torch.testing.assert_close(params[pname].grad, theirs[name], atol=1e-4, rtol=1e-4)
    assert all(params[p].grad.abs().max() > 0 for p in params if "lora_B" in p)


def _pairs(E=4, H=8, I=6, r=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for param, (o, i) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
        p = ExpertPair(ExpertSite("m", "m", param, E, o, i), r, 0.5, dtype=dtype)
        with torch.no_grad():
            p.lora_B.copy_(torch.randn(p.lora_B.shape, generator=g, dtype=dtype))
        out.append(p)
    return out


def test_fused_moe_lora_and_its_gradients_equal_a_float64_merged_reference():
    E, H, I, T, k = 4, 8, 6, 7, 2
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    w13 = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) * 0.3
    w2 = torch.randn(E, H, I, generator=g, dtype=torch.float64) * 0.3
    weights = torch.rand(T, k, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    gu, dn = _pairs(E, H, I)
    ours = fused_moe_lora(x, w13, w2, weights, ids, gu.factors(), dn.factors())
    theirs = fused_moe_reference(x, w13 + gu.delta_weight(), w2 + dn.delta_weight(), weights, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)
    dy = torch.randn(T, H, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(ours, [x, gu.lora_A, gu.lora_B, dn.lora_A, dn.lora_B], dy)
    want = torch.autograd.grad(theirs, [x, gu.lora_A, gu.lora_B, dn.lora_A, dn.lora_B], dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    with torch.no_grad():  # decode size without gradients: every expert masked (no host sync, graph-capturable)
        dense = fused_moe_lora(x[:3], w13, w2, weights[:3], ids[:3], gu.factors(), dn.factors())
    torch.testing.assert_close(dense, theirs[:3], atol=1e-12, rtol=1e-12)


def test_refusals_name_the_flag(tiny_checkpoint):
    model = _areno(tiny_checkpoint("qwen3_moe"))
    with pytest.raises(LoraError, match="--lora-target-modules: 'down_proj' names no linear module .* experts.down"):
        attach(model, LoraSpec(rank=2, alpha=4.0, target_modules=("down_proj",)))
    with pytest.raises(LoraError, match="--lora-dropout: .*experts.gate_up_proj: LoRA on MoE experts takes no dropout"):
        attach(model, LoraSpec(rank=2, alpha=4.0, dropout=0.1, target_modules=BOTH))
    adapter = attach(model, LoraSpec(rank=2, alpha=4.0))  # all-linear: the linear modules, experts only when named
    assert not adapter.expert_sites
    oss = _areno(tiny_checkpoint("gpt_oss"))
    with pytest.raises(LoraError, match="--lora-target-modules: 'experts': LoRA on the gpt_oss model's experts is not"):
        attach(oss, LoraSpec(rank=2, alpha=4.0, target_modules=("experts",)))

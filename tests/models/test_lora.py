"""LoRA adapters (areno.models.lora): PEFT's math, names and files against the real ``peft`` package; the base
frozen; the adapter-off switch; refusals in one line."""

import pytest
import torch
from hf_reference import load_reference

from areno.models import load_model
from areno.models.lora import LoraError, LoraSpec, adapter_of, attach, read_peft_config
from areno.testing.checkpoints import FAMILIES

peft = pytest.importorskip("peft")

IDS = torch.tensor([[3, 17, 5, 42, 8, 11, 2, 30], [7, 7, 1, 19, 23, 4, 9, 12]])


def _randomise(adapter, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)


# Ling 3 (bailing_hybrid): KDA linear attention (q/k/v, f, b, g, o), MLA's kv_a, a shared expert; PEFT's names are
# transformers' module names (self_attn.o_proj for the checkpoint's attention.dense)
LING = ("q_proj", "v_proj", "f_proj", "b_proj", "g_proj", "o_proj", "kv_a_proj_with_mqa", "shared_experts.up_proj")


@pytest.mark.parametrize("family,targets", [("qwen3", "all-linear"), ("llama", ("q_proj", "v_proj", "down_proj")),
                                            ("olmo2", ("k_proj", "up_proj", "o_proj")), ("bailing_hybrid", LING)])
def test_the_saved_adapter_gives_peft_the_same_logits(tiny_checkpoint, tmp_path, family, targets):
    path = tiny_checkpoint(family)
    model = load_model(path, dtype=torch.float32, device="cpu", attn_backend="native")
    base = model.logits(IDS).detach()
    adapter = attach(model, LoraSpec(rank=4, alpha=8.0, target_modules=targets))
    torch.testing.assert_close(model.logits(IDS), base)  # B starts at zero: the base model
    _randomise(adapter)
    ours = model.logits(IDS).detach()
    assert (ours - base).abs().max() > 1e-3
    adapter.save(tmp_path / "adapter", base=str(path))
    ref = peft.PeftModel.from_pretrained(load_reference(path), str(tmp_path / "adapter"))
    with torch.no_grad():
        theirs = ref(IDS).logits
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)
    with adapter.disabled():  # the reference policy: the base, no copy
        torch.testing.assert_close(model.logits(IDS), base)
    assert read_peft_config(tmp_path / "adapter").rank == 4


def test_a_peft_adapter_loads_into_areno(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3")
    hf = load_reference(path)
    conf = peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    pm = peft.get_peft_model(hf, conf)
    pm.save_pretrained(str(tmp_path / "theirs"))
    with torch.no_grad():
        theirs = pm(IDS).logits
    model = load_model(path, dtype=torch.float32, device="cpu", attn_backend="native")
    spec = read_peft_config(tmp_path / "theirs")
    adapter = attach(model, spec)
    adapter.load_weights(tmp_path / "theirs")
    torch.testing.assert_close(model.logits(IDS).detach(), theirs, atol=2e-5, rtol=2e-5)


def test_only_the_adapter_trains_and_gradients_match_peft(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3")
    model = load_model(path, dtype=torch.float32, device="cpu", attn_backend="native")
    adapter = attach(model, LoraSpec(rank=2, alpha=4.0, target_modules=("q_proj", "gate_proj")))
    _randomise(adapter, seed=1)
    adapter.save(tmp_path / "a", base=str(path))
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.requires_grad for p in adapter.parameters())
    model.set_activation_checkpointing(True)
    model.logits(IDS).float().logsumexp(-1).sum().backward()
    ref = peft.PeftModel.from_pretrained(load_reference(path), str(tmp_path / "a"), is_trainable=True)
    ref(IDS).logits.float().logsumexp(-1).sum().backward()
    theirs = {n.replace(".default", ""): p.grad for n, p in ref.named_parameters() if p.grad is not None}
    for s in adapter.sites:
        pair = adapter.pair(s.hf_module)
        for kind, p in (("lora_A", pair.lora_A), ("lora_B", pair.lora_B)):
            torch.testing.assert_close(p.grad, theirs[f"base_model.model.{s.hf_module}.{kind}.weight"],
                                       atol=1e-4, rtol=1e-4)
    assert adapter_of(model) is adapter


def test_names_that_match_nothing_and_moe_experts_are_refused(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3"), dtype=torch.float32, device="cpu")
    with pytest.raises(LoraError, match="--lora-target-modules: 'qkv' names no linear module"):
        attach(model, LoraSpec(rank=2, alpha=4.0, target_modules=("qkv",)))
    moe = load_model(tiny_checkpoint("qwen3_moe"), dtype=torch.float32, device="cpu")
    with pytest.raises(LoraError, match="routed experts are PEFT's target_parameters"):  # bare down_proj
        attach(moe, LoraSpec(rank=2, alpha=4.0, target_modules=("down_proj",)))
    ling = load_model(tiny_checkpoint("bailing_hybrid"), dtype=torch.float32, device="cpu")
    with pytest.raises(LoraError, match="all-linear on an MLA model includes kv_b_proj"):
        attach(ling, LoraSpec(rank=2, alpha=4.0))
    adapter = attach(moe, LoraSpec(rank=2, alpha=4.0))  # all-linear: attention (HF routers are no nn.Linear)
    assert {s.hf_module.rsplit(".", 1)[-1] for s in adapter.sites} == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_qwen3_vl_adapts_the_language_model_and_peft_agrees(tiny_checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    path = tiny_checkpoint("qwen3_vl")
    model = load_model(path, dtype=torch.float32, device="cpu", attn_backend="native")
    adapter = attach(model, LoraSpec(rank=2, alpha=4.0))  # all-linear: the language model's projections
    assert adapter.sites and all(".visual." not in s.hf_module for s in adapter.sites)
    with pytest.raises(LoraError, match="vision tower or projector is not built yet"):
        attach(load_model(path, dtype=torch.float32, device="cpu"), LoraSpec(2, 4.0, target_modules=("linear_fc1",)))
    _randomise(adapter)
    adapter.save(tmp_path / "a", base=str(path))
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32,
                                                                  attn_implementation="eager")
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf, str(tmp_path / "a"))(input_ids=IDS).logits
        torch.testing.assert_close(model.logits(IDS), theirs, atol=2e-5, rtol=2e-5)


def test_dropout_follows_the_model_s_mode(tiny_checkpoint):
    """--lora-dropout drops the adapter's input while the model trains, never in eval (rollout, evaluation)."""
    model = load_model(tiny_checkpoint("qwen3"), dtype=torch.float32, device="cpu", attn_backend="native")
    adapter = attach(model, LoraSpec(rank=4, alpha=8.0, dropout=0.5))
    _randomise(adapter)
    model.eval()
    with torch.no_grad():
        a, b = model.logits(IDS), model.logits(IDS)
        torch.testing.assert_close(a, b)
        model.train()
        c, d = model.logits(IDS), model.logits(IDS)
    assert not torch.allclose(c, d) and not torch.allclose(a, c)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_s_adapter_is_peft_s(tiny_checkpoint, tmp_path, family):
    """all-linear (named projections where MLA's absorbed kv_b_proj refuses it) against PEFT on transformers' model."""
    transformers = pytest.importorskip("transformers")
    path = tiny_checkpoint(family)
    model = load_model(path, dtype=torch.float32, device="cpu", attn_backend="native")
    try:
        adapter = attach(model, LoraSpec(rank=2, alpha=4.0))
    except LoraError as e:
        assert "kv_b_proj" in str(e)
        adapter = attach(model, LoraSpec(rank=2, alpha=4.0, target_modules=("q_proj", "o_proj")))
    _randomise(adapter)
    adapter.save(tmp_path / "a", base=str(path))
    auto = transformers.AutoModelForImageTextToText if model.is_multimodal else transformers.AutoModelForCausalLM
    hf = auto.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf, str(tmp_path / "a"))(input_ids=IDS).logits
        torch.testing.assert_close(model.logits(IDS), theirs, atol=5e-5, rtol=5e-5)


def test_a_bf16_base_gets_fp32_adapter_weights_as_peft(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3"), dtype=torch.bfloat16, device="cpu", attn_backend="native")
    adapter = attach(model, LoraSpec(rank=2, alpha=4.0))
    assert all(p.dtype == torch.float32 for p in adapter.parameters())
    _randomise(adapter)
    assert model.logits(IDS).dtype == torch.bfloat16


def test_a_bf16_base_adds_the_fp32_deltas_in_place_with_their_gradients(tiny_checkpoint):
    """The deltas are added into the bf16 projections' rows in place (scaling folded into the add), with and without
    gradients: the logits and the adapter's gradients are the fp32 model's within bf16's rounding."""
    path = tiny_checkpoint("qwen3")
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(path, dtype=dtype, device="cpu", attn_backend="native").eval()
        adapter = attach(model, LoraSpec(rank=4, alpha=8.0))
        _randomise(adapter)
        logits = model.logits(IDS)
        logits.float().logsumexp(-1).mean().backward()
        with torch.no_grad():
            torch.testing.assert_close(model.logits(IDS), logits.detach())  # inference: the same path
            with adapter.disabled():
                base = model.logits(IDS).float()
        runs[dtype] = logits.detach().float(), base, {n: p.grad.clone() for n, p in adapter.named_parameters()}
    (l32, b32, g32), (l16, _, g16) = runs[torch.float32], runs[torch.bfloat16]
    effect = (l32 - b32).norm()
    assert effect > 1e-2 and (l16 - l32).norm() <= 0.05 * effect
    for name, g in g32.items():
        assert g16[name].dtype == torch.float32 and (g16[name] - g).norm() <= 0.1 * g.norm() + 1e-6, name

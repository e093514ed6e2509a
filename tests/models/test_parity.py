"""areno's adapters against transformers' own models: logits (fp32, bf16), gradients, packed batches, checkpointing."""

import pytest
import torch
from hf_reference import (
    FAMILIES,
    assert_checkpointing_keeps_loss_and_grads,
    load_reference,
    packed_loss,
    reference_grads,
)

from areno.models import AttentionMetadata, iter_hf_tensors, load_model


def _ids(vocab, b=2, t=19, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_fp32(tiny_checkpoint, family):
    path = tiny_checkpoint(family)
    model, ref = load_model(path, device="cpu"), load_reference(path)
    assert model.embed_tokens.weight.dtype == torch.float32  # the config's dtype
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        got, want = model.logits(ids), ref(ids).logits
    assert got.shape == want.shape == (*ids.shape, model.config.vocab_size)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_bf16(tiny_checkpoint, family):
    """bf16 tolerance: areno's bf16 error against the fp32 model is at most 2x transformers' own bf16 error + 1e-2 of
    the logit scale (bf16 has 8 mantissa bits; both compute the same ops, rounded at different places)."""
    path = tiny_checkpoint(family)
    ids = _ids(1000, t=23, seed=1)
    with torch.no_grad():
        exact = load_reference(path)(ids).logits
        ref = load_reference(path, dtype=torch.bfloat16)(ids).logits.float()
        got = load_model(path, dtype=torch.bfloat16, device="cpu").logits(ids).float()
    scale = exact.abs().max()
    ref_err, our_err = (ref - exact).abs().max(), (got - exact).abs().max()
    assert our_err <= 2 * ref_err + 1e-2 * scale, (our_err, ref_err, scale)
    assert (got - ref).abs().max() <= 3 * ref_err + 1e-2 * scale


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_transformers_fp32(tiny_checkpoint, family):
    path = tiny_checkpoint(family)
    model, ref = load_model(path, device="cpu").train(), load_reference(path).train()
    ids = _ids(model.config.vocab_size, seed=2)
    loss = packed_loss(model, ids)
    loss.backward()
    ref_loss = ref(ids, labels=ids).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    want = reference_grads(ref)
    got = dict(iter_hf_tensors(model, grads=True))
    assert set(got) == set(want)
    for name, g in want.items():
        scale = g.abs().max().clamp_min(1e-8)
        assert (got[name] - g).abs().max() <= 1e-4 * scale, name


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "olmo2"])
def test_packed_varlen_equals_per_sequence(tiny_checkpoint, family):
    model = load_model(tiny_checkpoint(family), device="cpu")
    lens = [5, 11, 1, 7]
    seqs = [_ids(model.config.vocab_size, b=1, t=n, seed=10 + i)[0] for i, n in enumerate(lens)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        packed = model.compute_logits(model(torch.cat(seqs), positions, cu, max(lens)))
        single = torch.cat([model.logits(s[None])[0] for s in seqs])
    assert (packed - single).abs().max() <= 1e-5 * single.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_checkpointing_changes_neither_loss_nor_grads(tiny_checkpoint, family):
    ids = _ids(1000, b=3, t=13, seed=3)
    model, counts0, counts1 = assert_checkpointing_keeps_loss_and_grads(tiny_checkpoint(family), ids)
    if family == "qwen3_moe":
        # routing ran once per layer per step with checkpointing too: every token counted top_k times per layer
        k, layers = model.config.num_experts_per_tok, len(model.moe_layers())
        assert counts0.shape == (layers, model.config.num_experts)
        assert torch.equal(counts1, counts0)
        assert (counts1.sum(1) == ids.numel() * k).all()


def test_moe_counters_only_count_training_forwards(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3_moe"), device="cpu")
    ids = _ids(1000, b=1, t=9)
    with torch.no_grad():
        model.logits(ids)  # eval mode: no counting
    assert model.expert_load().sum() == 0
    model.train()
    model.set_activation_checkpointing(True)
    packed_loss(model, ids).backward()
    packed_loss(model, ids).backward()
    assert (model.expert_load().sum(1) == 2 * ids.numel() * model.config.num_experts_per_tok).all()
    model.reset_expert_load()
    assert model.expert_load().sum() == 0


def test_llama_biases_and_untied_head_optional_fields(tiny_checkpoint):
    """Llama with attention and MLP biases, no head_dim in the config (defaults to hidden / heads), GQA 4:1."""
    path = tiny_checkpoint("llama", attention_bias=True, mlp_bias=True, head_dim=None, num_key_value_heads=1)
    model, ref = load_model(path, device="cpu"), load_reference(path)
    assert model.head_dim == 16 and model.num_kv_heads_local == 1
    ids = _ids(model.config.vocab_size, seed=4)
    with torch.no_grad():
        got, want = model.logits(ids), ref(ids).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_native_attention_backend_matches_default(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    ids = _ids(1000, seed=5)
    with torch.no_grad():
        a = load_model(path, device="cpu", attn_backend="native").logits(ids)
        b = load_model(path, device="cpu").logits(ids)
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    with pytest.raises(ValueError, match="attn-backend"):
        load_model(path, device="cpu", attn_backend="fa3")


def test_triton_kernel_path_matches_native(tiny_checkpoint, monkeypatch):
    """The adapters' wiring into the Triton kernels (interpreted on CPU): training fwd+bwd of the MoE model and a
    paged prefill + decode of the dense one equal the native path."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = _ids(1000, b=2, t=9, seed=6).to(device)
    runs = {}
    for mode in ("native", "triton"):
        monkeypatch.setenv("ARENO_KERNELS", mode)
        model = load_model(tiny_checkpoint("qwen3_moe", num_hidden_layers=1), device=device).train()
        loss = packed_loss(model, ids)
        loss.backward()
        dense = load_model(tiny_checkpoint("qwen3", num_hidden_layers=1), device=device)
        with torch.no_grad():
            caches = [tuple(torch.zeros(dense.kv_cache_shape(4, 8), device=device) for _ in "kv")]
            i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
            meta = AttentionMetadata(torch.arange(9, device=device), True, i32([0, 9]), i32([0, 9]), 9, 9,
                                     i32([[0, 1]]), i32([9]))  # fmt: skip
            prefill = dense.compute_logits(dense(ids[0], torch.arange(9, device=device), kv_caches=caches,
                                                 attn_metadata=meta))  # fmt: skip
            meta = AttentionMetadata(torch.tensor([9], device=device), False, i32([0, 1]), None, 1, 10,
                                     i32([[0, 1]]), i32([10]))  # fmt: skip
            decode = dense.compute_logits(dense(ids[1, :1], torch.tensor([9], device=device), kv_caches=caches,
                                                attn_metadata=meta))  # fmt: skip
        runs[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()}, prefill, decode)
    (loss0, grads0, pre0, dec0), (loss1, grads1, pre1, dec1) = runs["native"], runs["triton"]
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    for name, g in grads0.items():
        assert (grads1[name] - g).abs().max() <= 1e-4 * g.abs().max().clamp_min(1e-8), name
    assert (pre1 - pre0).abs().max() <= 1e-5 * pre0.abs().max()
    assert (dec1 - dec0).abs().max() <= 1e-5 * dec0.abs().max()

"""Kimi-Linear (kimi_linear: KDA with low-rank gates + NoPE MLA + sigmoid-routed MoE) against transformers' own model:
fp32 logits (packed varlen too) and every gradient, the Hub-name round trip (fp32 and bf16), transformers loading
what areno saves, the layer types read from a Hub-style ``linear_attn_config``, and the refusals. Needs a transformers
with kimi_linear (5.2x)."""

import json
import shutil

import pytest
import torch
import transformers
from hf_reference import areno_hub_grads, hub_tensors, load_reference, packed_loss, varlen_logits

from areno.models import load_model, save_model

pytestmark = pytest.mark.skipif(not hasattr(transformers, "KimiLinearConfig"),
                                reason=f"transformers {transformers.__version__} has no kimi_linear")

VARIANTS = {
    "base": {},  # [KDA, MLA, KDA, MLA], 2 KDA heads of 16 (4 MLA heads), dense then sparse MLPs, q_proj directly
    "q_lora": dict(q_lora_rank=24, v_head_dim=32),
}


def _ids(vocab=1000, b=2, t=19, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _hub_grads(ref) -> dict:
    """transformers' gradients under the Hub names it renamed at load (conv kernels split back, MoE under
    block_sparse_moe with per-expert w1/w3/w2, the forget gate's tensors back on the attention)."""
    out, sparse = {}, ref.config.mlp_layer_types
    for name, p in ref.named_parameters():
        g = p.grad
        if g is None:
            continue
        name = name.replace(".forget_gate.", ".")
        parts = name.split(".")
        if len(parts) > 3 and parts[3] == "mlp" and sparse[int(parts[2])] == "sparse":
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("self_attn.conv1d.weight"):
            out.update({name.replace("conv1d", f"{x}_conv1d"): c for x, c in zip("qkv", g.chunk(3))})
        elif name.endswith("experts.gate_up_proj"):
            base, i = name[: -len("gate_up_proj")], g.shape[1] // 2
            for e in range(g.shape[0]):
                out[f"{base}{e}.w1.weight"], out[f"{base}{e}.w3.weight"] = g[e, :i], g[e, i:]
        elif name.endswith("experts.down_proj"):
            out.update({f"{name[: -len('down_proj')]}{e}.w2.weight": g[e] for e in range(g.shape[0])})
        else:
            out[name] = g
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_gradients_match_transformers_fp32(tiny_checkpoint, variant):
    path = tiny_checkpoint("kimi_linear", **VARIANTS[variant])
    model, ref = load_model(path, device="cpu"), load_reference(path)
    cfg = model.config
    assert cfg.layer_types == ["linear_attention", "full_attention"] * 2 and cfg.num_experts == 8
    assert model.layers[0].self_attn.num_heads == 2 and model.layers[1].self_attn.num_heads == 4
    assert model.recurrent_state_shapes() == {"layers": [0, 2], "conv": (96, 3), "recurrent": (2, 16, 16)}
    seqs = [_ids(t=n, b=1, seed=n)[0] for n in (7, 19, 12)]
    for got, seq in zip(varlen_logits(model, seqs), seqs):  # packed varlen == each sequence alone in transformers
        with torch.no_grad():
            want = ref(seq[None]).logits[0]
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    model.train(), ref.train()
    ids = _ids(cfg.vocab_size, seed=2)
    loss = packed_loss(model, ids)
    loss.backward()
    ref_loss = ref(ids, labels=ids).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    got, want = areno_hub_grads(model), _hub_grads(ref)
    assert set(got) == set(want)
    for name, g in want.items():
        assert (got[name] - g).abs().max() <= 1e-4 * g.abs().max().clamp_min(1e-8), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_areno_hf_is_bit_identical(tmp_path, dtype):
    from areno.testing import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", "kimi_linear", dtype=dtype)
    model = load_model(src, device="cpu")
    kda = model.layers[0].self_attn
    assert kda.decay.dt_bias.dtype == model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert kda.decay.A_log.dtype == kda.conv.weight.dtype == dtype  # as transformers keeps them
    out = save_model(model, tmp_path / "out")
    a, b = hub_tensors(src), hub_tensors(out)
    assert sorted(a) == sorted(b) and "model.layers.1.block_sparse_moe.experts.7.w3.weight" in a
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_transformers_loads_what_areno_saves(tiny_checkpoint, tmp_path):
    model = load_model(tiny_checkpoint("kimi_linear", **VARIANTS["q_lora"]), device="cpu")
    with torch.no_grad():  # change the weights so the test sees what was saved
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = save_model(model, tmp_path / "trained")
    ids = _ids(t=11, seed=3)
    with torch.no_grad():
        want = model.logits(ids)
        assert (load_reference(out)(ids).logits - want).abs().max() <= 1e-4 * want.abs().max()
        assert torch.equal(load_model(out, device="cpu").logits(ids), want)


def _edited(src, tmp_path, drop=(), **fields):
    dst = tmp_path / "edited"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key in drop:
        config.pop(key)
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_reads_the_hub_linear_attn_config(tiny_checkpoint, tmp_path):
    """A Hub config.json: the KDA shape and the (1-indexed) layer lists in ``linear_attn_config``."""
    src = tiny_checkpoint("kimi_linear")
    hub = dict(linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                                   "kda_layers": [1, 3], "full_attn_layers": [2, 4]}, first_k_dense_replace=1)
    drop = ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")
    model = load_model(_edited(src, tmp_path, drop=drop, **hub), device="cpu")
    assert model.config.layer_types == ["linear_attention", "full_attention"] * 2
    assert model.config.mlp_layer_types == ["dense"] + ["sparse"] * 3
    ids = _ids(t=9, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), load_model(src, device="cpu").logits(ids), rtol=0, atol=0)


@pytest.mark.parametrize("fields, message", [
    (dict(mla_use_nope=False), "mla_use_nope=False is not supported"),
    (dict(moe_router_activation_func="softmax"), "moe_router_activation_func='softmax' is not supported"),
    (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    (dict(quantization_config={"quant_method": "compressed-tensors"}), "quantization_config"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 != num_attention_heads=4"),
])  # fmt: skip
def test_refuses_what_it_does_not_implement(tiny_checkpoint, tmp_path, fields, message):
    from areno.models.loader import CheckpointError

    with pytest.raises((ValueError, NotImplementedError, CheckpointError), match=message):
        load_model(_edited(tiny_checkpoint("kimi_linear"), tmp_path, **fields), device="cpu")


# ---- GPU (bf16, Triton kernels): python -m pytest -q tests/models/test_kimi_linear.py -m gpu -----------------------

KIMI_LINEAR_SMALL = dict(  # Kimi-Linear-48B-A3B's KDA, MLA and expert shapes; 3 layers (KDA, KDA, MLA), 64 experts
    hidden_size=2304, intermediate_size=9216, num_hidden_layers=3, num_attention_heads=32, num_key_value_heads=32,
    linear_num_heads=32, linear_head_dim=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, num_local_experts=64, num_experts_per_tok=8, n_group=1, topk_group=1, moe_intermediate_size=1024,
    routed_scaling_factor=2.446, vocab_size=32768, max_position_embeddings=8192,
    layer_types=["linear_attention", "linear_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse"],
)  # fmt: skip


@pytest.mark.gpu
def test_bf16_parity_on_gpu(tmp_path):
    """bf16 logits at Kimi-Linear's widths: areno's error against transformers' fp32 is at most 2x transformers' own
    bf16 error plus 2% of the logit scale; a training step's loss and gradients are finite."""
    from hf_reference import bf16_logits_errors

    from areno.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "kimi_linear", dtype=torch.bfloat16, **KIMI_LINEAR_SMALL)
    ids = torch.randint(0, 32768, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    ours, theirs, scale = bf16_logits_errors(path, ids, load_model)
    assert ours <= 2 * theirs + 2e-2 * scale, (ours, theirs, scale)
    model = load_model(path, device="cuda").train()
    model.set_activation_checkpointing(True)
    loss = packed_loss(model, ids[:, :257])
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

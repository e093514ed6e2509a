"""Gemma 4 against transformers (fp32, native attention): logits and every parameter gradient on sequences longer than
the sliding window for the dense, the KV-shared + PLE + k=v + double-wide and the MoE variants; packed varlen
batches; activation checkpointing; routing replay; bit-identical save; the multimodal ``gemma4`` checkpoint's language
model (towers kept opaque); and the options refused at load."""

import json
import shutil

import pytest
import torch
from hf_reference import (
    assert_refused_at_load,
    bf16_parity_on_gpu,
    check_logits_and_grads,
    load_reference,
    next_token_targets,
    packed_batch,
)
from safetensors.torch import load_file

from areno.models import iter_hf_tensors, load_model, save_model
from areno.testing.gemma4 import MOE, SHARED_PLE

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4TextConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no Gemma 4", allow_module_level=True)

VARIANTS = {
    "dense": {},
    "uncapped": dict(final_logit_softcapping=None),
    "shared_ple": SHARED_PLE,
    "moe": MOE,
}


def _ids(b, t, seed):
    return torch.randint(0, 1000, (b, t), generator=torch.Generator().manual_seed(seed))


def _close(got, want, tol=1e-4):
    return (got - want).abs().max() <= tol * want.abs().max().clamp_min(1e-8)


def test_layers_get_their_window_head_dims_and_kv_sources(tiny_checkpoint):
    model = load_model(tiny_checkpoint("gemma4_text", **VARIANTS["shared_ple"]), device="cpu")
    attn = [layer.self_attn for layer in model.layers]
    assert [a.window for a in attn] == [4, None, 4, None]
    assert [a.head_dim for a in attn] == [16, 32, 16, 32]
    assert [a.num_kv_heads for a in attn] == [2, 1, 2, 1]
    assert model.config.kv_source == [0, 1, 0, 1] and model.kv_cache_layers == [0, 1]
    assert [a.k_eq_v for a in attn] == [False, True, False, False]
    assert [layer.mlp.intermediate_size for layer in model.layers] == [128, 128, 256, 256]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_gradients_match_transformers_past_the_window(tiny_checkpoint, variant):
    path = tiny_checkpoint("gemma4_text", **VARIANTS[variant])
    model = load_model(path, device="cpu", attn_backend="native").train()
    check_logits_and_grads(model, load_reference(path).train(), _ids(2, 13, seed=1), logits_rtol=1e-4)  # window 4


def test_soft_capping_reaches_logits_and_logprobs(tiny_checkpoint):
    model = load_model(tiny_checkpoint("gemma4_text"), device="cpu")
    ids = _ids(1, 9, seed=2)
    with torch.no_grad():
        hidden = model(ids[0], torch.arange(9))
        logits = model.compute_logits(hidden)
        assert logits.abs().max() < 3.0
        lp, ent = model.token_logprobs(hidden, ids[0], temperature=0.7, return_entropy=True)
    want = torch.log_softmax(logits / 0.7, dim=-1)
    torch.testing.assert_close(lp, want.gather(1, ids[0, :, None])[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, -(want.exp() * want).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["shared_ple", "moe"])
def test_packed_varlen_equals_per_sequence(tiny_checkpoint, variant):
    model = load_model(tiny_checkpoint("gemma4_text", **VARIANTS[variant]), device="cpu", attn_backend="native")
    seqs, *batch = packed_batch([9, 3, 12])
    with torch.no_grad():
        packed = model.compute_logits(model(*batch))
        single = torch.cat([model.logits(s[None])[0] for s in seqs])
    assert _close(packed, single, 1e-5)


@pytest.mark.parametrize("variant", ["shared_ple", "moe"])
def test_activation_checkpointing_gives_the_same_gradients(tiny_checkpoint, variant):
    path = tiny_checkpoint("gemma4_text", **VARIANTS[variant])
    ids = _ids(2, 11, seed=3)
    grads = []
    for ckpt in (False, True):
        model = load_model(path, device="cpu", attn_backend="native").train()
        model.set_activation_checkpointing(ckpt)
        hidden = model(ids.reshape(-1), torch.arange(11).repeat(2), torch.tensor([0, 11, 22], dtype=torch.int32), 11)
        model.token_logprobs(hidden, next_token_targets(ids)).sum().backward()
        grads.append(dict(iter_hf_tensors(model, grads=True)))
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_routing_replay_runs_the_given_experts(tiny_checkpoint):
    model = load_model(tiny_checkpoint("gemma4_text", **VARIANTS["moe"]), device="cpu")
    assert model.is_moe and model.num_moe_layers == 4 and model.moe_top_k == 2
    ids = _ids(1, 10, seed=5)[0]
    positions = torch.arange(10)
    with torch.no_grad():
        base = model(ids, positions)
        routes = torch.stack([layer.moe.route(torch.randn(10, 64), None)[1] for layer in model.layers], dim=1)
        replayed = model(ids, positions, routed_experts=routes.int())
        same = model(ids, positions, routed_experts=torch.full_like(routes, -1).int())
    assert not torch.allclose(base, replayed)
    torch.testing.assert_close(same, base)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_save_round_trips_bit_identically(tiny_checkpoint, tmp_path, variant):
    path = tiny_checkpoint("gemma4_text", **VARIANTS[variant])
    model = load_model(path, device="cpu")
    a = load_file(str(path / "model.safetensors"))
    b = load_file(str(save_model(model, tmp_path / "o") / "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_kv_shared_layers_kv_tensors_in_a_checkpoint_are_kept_untouched(tiny_checkpoint, tmp_path):
    """Hub checkpoints may hold k/v weights for KV-shared layers (transformers ignores them): kept, saved back."""
    from safetensors.torch import save_file

    folder = tmp_path / "extra"
    shutil.copytree(tiny_checkpoint("gemma4_text", **VARIANTS["shared_ple"]), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.3.self_attn.k_proj.weight"] = torch.randn(32, 64)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(folder, device="cpu")
    saved = load_file(str(save_model(model, tmp_path / "o") / "model.safetensors"))
    name = "model.layers.3.self_attn.k_proj.weight"
    assert torch.equal(saved[name], tensors[name])


def _multimodal_checkpoint(tiny_checkpoint, tmp_path, clipped=False):
    """A tiny ``gemma4`` checkpoint (text + vision tower) written by transformers itself."""
    text = json.loads((tiny_checkpoint("gemma4_text", **VARIANTS["shared_ple"]) / "config.json").read_text())
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                             use_clipped_linears=clipped)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision.to_dict(), audio_config=None)
    torch.manual_seed(0)
    ref = transformers.Gemma4ForConditionalGeneration(config).eval()
    ref.save_pretrained(str(tmp_path / "mm"))
    return tmp_path / "mm", ref


@pytest.mark.parametrize("clipped", [False, True], ids=["plain", "clipped_linears"])  # clipped: 0-d tensors
def test_multimodal_checkpoint_loads_its_language_model_and_saves_the_towers_untouched(tiny_checkpoint, tmp_path,
                                                                                       clipped):
    path, ref = _multimodal_checkpoint(tiny_checkpoint, tmp_path, clipped)
    model = load_model(path, device="cpu", attn_backend="native")
    assert model.config.model_type == "gemma4" and model.kept.names
    ids = _ids(2, 13, seed=6)
    with torch.no_grad():
        assert _close(model.logits(ids), ref(input_ids=ids).logits)
    out = save_model(model, tmp_path / "saved")
    a, b = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)
    again = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        assert _close(again(input_ids=ids).logits, ref(input_ids=ids).logits, 1e-6)


@pytest.mark.parametrize("change, message", [
    ({"hidden_activation": "silu"}, "gemma4: hidden_activation='silu' is not supported"),
    ({"attention_dropout": 0.1}, "gemma4: attention_dropout=0.1 is not supported"),
    ({"use_bidirectional_attention": "all"}, "gemma4: use_bidirectional_attention='all' is not supported"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     r"gemma4: rope_parameters\[sliding_attention\].rope_type='linear'"),
    ({"per_layer_config": {"1": {"head_dim": 32, "intermediate_size": 64}}}, r"gemma4: per_layer_config\[1\]="),
])
def test_unimplemented_options_are_refused_at_load_in_one_line(tiny_checkpoint, tmp_path, change, message):
    assert_refused_at_load(tiny_checkpoint("gemma4_text"), tmp_path, change, message)


def test_tp_that_cannot_split_a_layers_kv_heads_is_refused_at_load_in_one_line(tiny_checkpoint, monkeypatch):
    """Each layer shards its own KV heads (TP=2 == TP=1 is in test_tp.py): 3 global KV heads under TP=2 cannot."""
    from areno.models.registry import get_adapter
    from areno.models.tp import apply_tp_plan

    adapter = get_adapter("gemma4_text")
    config = json.loads((tiny_checkpoint("gemma4_text") / "config.json").read_text())
    config["per_layer_config"] = {str(i): {"head_dim": 32, "num_key_value_heads": 3} for i in (1, 3)}
    with torch.device("meta"):
        model = adapter.model_class(adapter.config_from_hf(config))
    monkeypatch.setattr("areno.models.tp.dist.get_world_size", lambda group: 2)
    monkeypatch.setattr("areno.models.tp.dist.get_rank", lambda group: 0)
    with pytest.raises(ValueError, match=r"^--tp-size 2 must divide .* this layer's 3 KV heads") as e:
        apply_tp_plan(model, object())
    assert "\n" not in str(e.value)


GEMMA4_E2B_LIKE = dict(  # transformers' Gemma 4 defaults (E2B-like widths, PLE 256), 8 layers, 2 of them KV-shared
    hidden_size=2304, intermediate_size=9216, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
    head_dim=256, global_head_dim=512, vocab_size=262144, vocab_size_per_layer_input=262144,
    hidden_size_per_layer_input=256, num_kv_shared_layers=2, use_double_wide_mlp=True, sliding_window=512,
    final_logit_softcapping=30.0, max_position_embeddings=4096,
    layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
)  # fmt: skip
GEMMA4_MOE_LIKE = dict(  # a MoE block of 128 experts (top 8) beside the dense MLP, global k = v, 4 layers
    hidden_size=2816, intermediate_size=2112, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
    head_dim=256, global_head_dim=512, num_global_key_value_heads=2, attention_k_eq_v=True, vocab_size=262144,
    hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
    sliding_window=512, final_logit_softcapping=30.0, max_position_embeddings=4096,
    layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [GEMMA4_E2B_LIKE, GEMMA4_MOE_LIKE], ids=["e2b_like", "moe_like"])
def test_bf16_parity_with_transformers_on_gpu(tmp_path, shape):
    """Real widths, 1024 tokens (past the 512 window): areno's bf16 error against transformers' fp32 logits is at most
    2x transformers' own bf16 error plus 2% of the logit scale; the losses agree to 1%."""
    from areno.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path, "gemma4_text", dtype=torch.bfloat16, **shape)
    ids = torch.randint(0, 262144, (2, 1024), generator=torch.Generator().manual_seed(0)).cuda()
    our_err, ref_err, scale, loss, ref_loss = bf16_parity_on_gpu(path, ids)
    assert our_err <= 2 * ref_err + 2e-2 * scale, (our_err.item(), ref_err.item(), scale.item())
    assert abs(loss.item() - ref_loss.item()) <= 1e-2 * ref_loss.item()

"""OLMo 3 on the native attention path: fp32 logits and every parameter gradient against transformers on sequences
longer than the sliding window (packed varlen batch included), bit-identical save, and the options refused at load."""


import pytest
import torch
from hf_reference import assert_refused_at_load, check_logits_and_grads, load_reference, packed_batch
from safetensors.torch import load_file

from areno.models import load_model, save_model


def _ids(b, t, seed):
    return torch.randint(0, 1000, (b, t), generator=torch.Generator().manual_seed(seed))


def test_sliding_layers_get_the_window(tiny_checkpoint):
    model = load_model(tiny_checkpoint("olmo3"), device="cpu", attn_backend="native")
    assert [layer.self_attn.window for layer in model.layers] == [4, None]


def test_logits_and_gradients_match_transformers_past_the_window(tiny_checkpoint):
    path = tiny_checkpoint("olmo3")
    model = load_model(path, device="cpu", attn_backend="native").train()
    ref = load_reference(path).train()
    check_logits_and_grads(model, ref, _ids(2, 13, seed=1), logits_rtol=1e-4)  # 13 tokens, window 4

def test_packed_varlen_equals_per_sequence_and_differs_from_full_attention(tiny_checkpoint):
    model = load_model(tiny_checkpoint("olmo3"), device="cpu", attn_backend="native")
    seqs, *batch = packed_batch([9, 3, 12])
    with torch.no_grad():
        packed = model.compute_logits(model(*batch))
        single = torch.cat([model.logits(s[None])[0] for s in seqs])
        model.layers[0].self_attn.window = None
        full = model.compute_logits(model(*batch))
    assert (packed - single).abs().max() <= 1e-5 * single.abs().max()
    assert (full - packed).abs().max() > 1e-3 * single.abs().max()  # the window is not a no-op


def test_save_round_trips_bit_identically(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("olmo3")
    model = load_model(path, device="cpu")
    a = load_file(str(path / "model.safetensors"))
    b = load_file(str(save_model(model, tmp_path / "o") / "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_a_rope_per_layer_type_matches_transformers(tiny_checkpoint):
    """transformers 5 keys rope_parameters by layer type: the sliding layers here rotate with their own theta."""
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}
    path = tiny_checkpoint("olmo3", rope_parameters=rope)
    model, ref = load_model(path, device="cpu"), load_reference(path)
    assert model.config.rope_theta == 500000.0 and model.config.sliding_rope == (10000.0, None)
    ids = _ids(2, 13, seed=4)
    with torch.no_grad():
        got, want = model.logits(ids), ref(ids).logits
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "olmo3: layer_types must list 2 of"),
    ({"sliding_window": 0}, "olmo3: sliding_window=0 must be a positive int"),
])
def test_unimplemented_options_are_refused_at_load_in_one_line(tiny_checkpoint, tmp_path, change, message):
    assert_refused_at_load(tiny_checkpoint("olmo3"), tmp_path, change, message)

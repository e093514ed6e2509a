"""A speculative verify's pass over a hybrid's recurrent layer (``meta.tokens_per_seq`` n > 1) computes what n
plain decode steps compute, bit for bit: the same kernels a token, the conv's states after each of the first n - 1
stashed and the delta rule's state left for the rollback, which replays any number of the tokens to the bits of as
many steps. With the interpreted Triton kernels in fp16, where a second code path would round differently."""

import pytest
import torch

from areno.engine.spec_graphs import StateSteps
from areno.kernels.linear_attn.steps import VerifyInputs
from areno.models import AttentionMetadata, load_model
from areno.testing import make_tiny_checkpoint


@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_a_verify_steps_its_tokens_as_decode_does(tmp_path, monkeypatch, kernels):
    monkeypatch.setenv("ARENO_KERNELS", kernels)
    model = load_model(make_tiny_checkpoint(tmp_path, family="qwen3_5", seed=3), dtype=torch.float16, device="cpu")
    mixer = model.layers[0].self_attn
    assert type(mixer).__name__ == "GatedDeltaNet"
    n, seqs, slots = 3, 2, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(seqs * n, model.config.hidden_size, generator=gen).half()
    conv = torch.randn(slots, mixer.conv_dim, model.config.conv_kernel - 1, generator=gen).half()
    rec = 0.1 * torch.randn(slots, mixer.nv, mixer.dk, mixer.dv, generator=gen)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    conv_stash = torch.zeros(1, n - 1, seqs, *conv.shape[1:], dtype=conv.dtype)
    keep = VerifyInputs(seqs * n)
    pools = (conv.clone(), rec.clone())
    meta = AttentionMetadata(slot_mapping=None, is_prefill=False, state_indices=idx, tokens_per_seq=n,
                             state_steps=StateSteps(conv_stash, [keep]))
    with torch.no_grad():
        verify = mixer(x, None, None, meta, kv_cache=pools).view(seqs, n, -1)
        plain, states = (conv.clone(), rec.clone()), [rec.clone()]
        for i in range(n):
            meta = AttentionMetadata(slot_mapping=None, is_prefill=False, state_indices=idx)
            step = mixer(x.view(seqs, n, -1)[:, i], None, None, meta, kv_cache=plain)
            states.append(plain[1].clone())
            assert torch.equal(verify[:, i], step), f"token {i}"
            if i < n - 1:
                assert torch.equal(conv_stash[0, i], plain[0][idx.long()])
    assert torch.equal(pools[0], plain[0]) and torch.equal(pools[1], rec)  # the conv stepped, the delta rule waits
    for counts in ([3, 1], [0, 2]):  # the replay commits that many tokens of each sequence
        got = rec.clone()
        keep.replay(got, idx, torch.tensor(counts, dtype=torch.int32))
        for s, c in zip(idx.tolist(), counts):
            assert torch.equal(got[s], states[c][s]), (counts, s)
    assert not torch.equal(states[n], rec)  # the states moved

"""apply_penalties / apply_logit_bias / token state: both paths against a float64 reference of vLLM's rules."""

import pytest
import torch

from areno.kernels.penalties import IN_PROMPT, apply_logit_bias, apply_penalties, record_tokens, reset_token_state


@pytest.fixture(params=["native", "triton"])
def path(request):
    request.getfixturevalue(f"{request.param}_kernels")
    return request.param


def _reference(logits, prompts, outputs, rep, pres, freq):
    """vLLM's penalties in float64, from the token lists themselves."""
    x = logits.double().clone()
    for b in range(x.shape[0]):
        counts = torch.bincount(torch.tensor(outputs[b], dtype=torch.int64), minlength=x.shape[1]).double()
        seen = counts > 0
        seen[torch.tensor(prompts[b], dtype=torch.int64)] = True
        row = x[b]
        row[:] = torch.where(seen, torch.where(row > 0, row / rep[b], row * rep[b]), row)
        row -= freq[b] * counts + pres[b] * (counts > 0).double()
    return x


def test_penalties_match_the_reference(path):
    B, V, S = 6, 300, 8
    logits = torch.randn(B, V) * 3
    state = torch.zeros(S, V, dtype=torch.int32)
    slots = torch.tensor([3, -1, 0, 7, 5, 1])
    prompts, outputs = [], []
    for b in range(B):
        p = torch.randint(0, V, (int(torch.randint(1, 40, ())),)).tolist()
        o = torch.randint(0, 60, (int(torch.randint(0, 30, ())),)).tolist()  # repeats are likely
        prompts.append(p)
        outputs.append(o)
        if slots[b] >= 0:
            reset_token_state(state, int(slots[b]), p, o[:-1])
    record_tokens(state, slots, torch.tensor([o[-1] if o else 0 for o in outputs]))  # the newest token, on device
    for b in range(B):  # a row whose output was empty counted token 0 instead: put that in its reference too
        if slots[b] >= 0 and not outputs[b]:
            outputs[b] = [0]
    rep = torch.rand(B) * 1.5 + 0.5
    pres = torch.rand(B) * 4 - 2
    freq = torch.rand(B) * 4 - 2
    ref = _reference(logits, prompts, outputs, rep, pres, freq)
    ref[1] = logits[1].double()  # slot -1: untouched
    got = apply_penalties(logits.clone(), slots, state, rep, pres, freq)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-5)
    assert state[3, prompts[0][0]] & IN_PROMPT


def test_bias_and_min_tokens_ban(path):
    B, V = 4, 200
    logits = torch.randn(B, V)
    ids = torch.tensor([[5, 9, -1, 150], [7, -1, -1, -1], [0, 199, 3, -1], [-1, -1, -1, -1]])
    bias = torch.tensor([[2.0, -100.0, 0.0, 0.5], [1.0, 0, 0, 0], [-3.0, 4.0, 1.0, 0], [0.0, 0, 0, 0]])
    ban = torch.tensor([[False, False, False, True], [True, False, False, False], [False, True, False, False],
                        [False] * 4])
    min_left = torch.tensor([2, 0, 1, 5])
    ref = logits.double().clone()
    for b in range(B):
        for j in range(4):
            i = int(ids[b, j])
            if i >= 0:
                ref[b, i] = float("-inf") if ban[b, j] and min_left[b] > 0 else ref[b, i] + bias[b, j].double()
    got = apply_logit_bias(logits.clone(), ids, bias, ban, min_left)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.isinf(got[0, 150]) and not torch.isinf(got[1, 7])  # a row past min_tokens keeps the bias only


def test_extreme_penalties_stay_finite_and_bans_stay_banned(path):
    V = 50
    logits = torch.randn(2, V)
    logits[1, 7] = float("-inf")
    state = torch.zeros(2, V, dtype=torch.int32)
    for s in range(2):
        reset_token_state(state, s, list(range(V)), [])
    out = apply_penalties(logits.clone(), torch.tensor([0, 1]), state, torch.tensor([1e-40, 3e38]), torch.zeros(2),
                          torch.zeros(2))  # fmt: skip
    assert torch.isfinite(out[0]).all() and out[1, 7] == float("-inf") and torch.isfinite(out[1, :7]).all()
    assert torch.isfinite(torch.log_softmax(out, 1)[:, :7]).all()


# ---- GPU: the engine's decode sequence (bias, penalties, min-p sample, count) captured in a CUDA graph --------------


@pytest.mark.gpu
def test_gpu_cuda_graph_decode_with_penalties_matches_native(monkeypatch):
    """k chained steps of logit_bias + min_tokens ban + penalties + min-p/top-k sampling + token counting, captured
    in one CUDA graph with the Triton kernels, against the same steps run eagerly with the native reference."""
    from areno.kernels.sampler import sample

    B, V, S, k = 48, 151936, 64, 4
    dev = "cuda"
    torch.manual_seed(0)
    steps = [torch.randn(B, V, device=dev) * 3 for _ in range(k)]
    slots = torch.where(torch.rand(B, device=dev) < 0.7, torch.randperm(S, device=dev)[:B], -1)
    rep, pres, freq = (torch.rand(B, device=dev) + 0.5, torch.rand(B, device=dev) * 4 - 2,
                       torch.rand(B, device=dev) * 4 - 2)
    ids = torch.stack([torch.randperm(V, device=dev)[:24] for _ in range(B)])
    ids[:, 20:] = -1
    bias = torch.randn(B, 24, device=dev) * 5
    ban = torch.rand(B, 24, device=dev) < 0.2
    min_left = torch.randint(0, 3, (B,), device=dev, dtype=torch.int32)
    temp = torch.rand(B, device=dev) + 0.5
    min_p = torch.where(torch.rand(B, device=dev) < 0.5, 0.05, 0.0)
    top_k = torch.where(torch.rand(B, device=dev) < 0.5, 50, 0)
    seeds, offsets = torch.randint(0, 2**62, (B,), device=dev), torch.randint(0, 2**40, (B,), device=dev)
    state0 = torch.zeros(S, V, dtype=torch.int32, device=dev)
    for s in range(S):
        reset_token_state(state0, s, torch.randint(0, V, (200,)).tolist(), torch.randint(0, 500, (40,)).tolist())

    def run(logits_in, state):
        left, toks, lps, adjusted = min_left, [], [], []
        for i in range(k):
            x = logits_in[i].clone()
            apply_logit_bias(x, ids, bias, ban, left)
            apply_penalties(x, slots, state, rep, pres, freq)
            adjusted.append(x)
            t, lp = sample(x, temperature=temp, seeds=seeds, offsets=offsets + i, top_k=top_k, min_p=min_p)
            record_tokens(state, slots, t)
            left = left - 1
            toks.append(t)
            lps.append(lp)
        return torch.stack(toks), torch.stack(lps), torch.stack(adjusted)

    monkeypatch.setenv("ARENO_KERNELS", "triton")
    static = [x.clone() for x in steps]
    g_state = state0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(static, g_state.clone())  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = run(static, g_state)
    graph.replay()
    monkeypatch.setenv("ARENO_KERNELS", "native")
    n_state = state0.clone()
    n_toks, n_lps, n_adj = run(steps, n_state)
    g_toks, g_lps, g_adj = g_out
    torch.testing.assert_close(g_adj, n_adj, rtol=1e-5, atol=1e-4)  # -inf bans compare equal
    same = g_toks == n_toks
    assert same.float().mean() > 0.97  # same bits; the GPU's fast log may flip a near-tie
    torch.testing.assert_close(g_lps[same], n_lps[same], rtol=0, atol=1e-3)
    if same.all():
        assert torch.equal(g_state, n_state)
    assert not torch.allclose(n_adj, torch.stack(steps))  # the adjustments did something
    banned = ids.masked_fill(~ban | (min_left[:, None] <= 0), -2)
    assert not (g_toks[0][:, None] == banned).any()  # nothing banned drawn at the first step

"""Attention sinks (GPT-OSS: a per-head logit in every query's softmax that carries no value): the reference, the
packed native path and the paged native path against a float64 loop oracle, forward and every gradient (d sinks
included), with and without a sliding window; the Triton paths refuse sinks until their kernels take them."""

from __future__ import annotations

import pytest
import torch

from areno.kernels.attention import attention, paged_attention
from areno.kernels.attention.packed import attention_reference
from areno.kernels.attention.paged import paged_attention_reference, paged_attention_triton


def loop_oracle(q, k, v, lq, lk, sinks, scale, causal=True, window=None):
    """One (query, head) at a time: softmax over [visible scores, sink], the sink's column dropped; differentiable."""
    hq, group = q.shape[1], q.shape[1] // k.shape[1]
    rows, cq, ck = [], 0, 0
    for nq, nk in zip(lq, lk):
        for i in range(nq):
            p = i + nk - nq
            lo = max(0, p - window + 1) if causal and window is not None else 0
            hi = max(p + 1, 0) if causal else nk
            heads = []
            for h in range(hq):
                ks, vs = k[ck + lo:ck + hi, h // group], v[ck + lo:ck + hi, h // group]
                logits = torch.cat([ks @ q[cq + i, h] * scale, sinks[h:h + 1].to(q.dtype)])
                heads.append(torch.softmax(logits, 0)[:-1] @ vs)
            rows.append(torch.stack(heads))
        cq, ck = cq + nq, ck + nk
    return torch.stack(rows)


def packed(lq, lk, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=dtype)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=dtype)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=dtype)
    sinks = torch.randn(hq, generator=g, dtype=dtype) * 2
    cu = lambda n: torch.tensor([0] + n).cumsum(0).to(torch.int32)  # noqa: E731
    return q, k, v, sinks, cu(lq), cu(lk)


def grads(fn, inputs, do):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(do.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


# (q lengths, k lengths, causal, window): prefill, chunked prefill (Lk > Lq), decode, rows that see no key (Lq > Lk)
CASES = {
    "varlen": ([9, 4, 1, 13], [9, 11, 6, 13], True, None),
    "window": ([9, 4, 1, 13], [9, 11, 6, 13], True, 3),
    "empty_rows": ([6, 3], [2, 3], True, 2),
    "non_causal": ([5, 3], [7, 2], False, None),
}


@pytest.mark.parametrize("case", CASES)
def test_reference_and_native_match_the_loop_oracle_forward_and_backward(case):
    lq, lk, causal, window = CASES[case]
    q, k, v, sinks, cu_q, cu_k = packed(lq, lk, seed=len(case))
    scale = 0.3
    do = torch.randn(sum(lq), q.shape[1], q.shape[2], dtype=torch.float64)
    want = grads(lambda *t: loop_oracle(*t[:3], lq, lk, t[3], scale, causal, window), (q, k, v, sinks), do)
    ref = grads(lambda *t: attention_reference(*t[:3], cu_q, cu_k, causal=causal, softmax_scale=scale,
                                               window=window, sinks=t[3]), (q, k, v, sinks), do)
    native64 = grads(lambda *t: attention(*t[:3], cu_q, cu_k, max(lq), max(lk), causal=causal, softmax_scale=scale,
                                          backend="native", window=window, sinks=t[3]), (q, k, v, sinks), do)
    native32 = grads(lambda *t: attention(*t[:3], cu_q, cu_k, max(lq), max(lk), causal=causal, softmax_scale=scale,
                                          backend="native", window=window, sinks=t[3]),
                     [t.float() for t in (q, k, v, sinks)], do)
    for name, w, r, n64, n32 in zip(("out", "dq", "dk", "dv", "dsinks"), want, ref, native64, native32):
        torch.testing.assert_close(r, w, rtol=1e-10, atol=1e-10, msg=f"reference {name}")
        torch.testing.assert_close(n64, w, rtol=1e-10, atol=1e-10, msg=f"native float64 {name}")
        torch.testing.assert_close(n32.double(), w, rtol=1e-5, atol=1e-5, msg=f"native float32 {name}")
    assert want[-1].abs().max() > 1e-3  # the sinks get a real gradient


def test_sinks_change_the_result_and_a_very_negative_sink_is_none():
    lq = lk = [7, 5]
    q, k, v, sinks, cu_q, cu_k = packed(lq, lk)
    plain = attention(q, k, v, cu_q, cu_k, 7, 7, backend="native")
    with_sinks = attention(q, k, v, cu_q, cu_k, 7, 7, backend="native", sinks=sinks)
    assert not torch.allclose(plain, with_sinks)
    gone = attention(q, k, v, cu_q, cu_k, 7, 7, backend="native", sinks=torch.full_like(sinks, -1e4))
    torch.testing.assert_close(gone, plain, rtol=1e-12, atol=1e-12)


def test_model_dtype_sinks_on_half_inputs():
    """bf16 q/k/v with fp32 sinks (a parameter kept in fp32) or bf16 sinks: native path in fp32, grads in each
    input's own dtype."""
    lq = lk = [6, 9]
    q, k, v, sinks, cu_q, cu_k = packed(lq, lk)
    want = attention_reference(q, k, v, cu_q, cu_k, sinks=sinks, window=4)
    for sink_dtype in (torch.float32, torch.bfloat16):
        ins = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
        s = sinks.to(sink_dtype).requires_grad_()
        out = attention(*ins, cu_q, cu_k, 9, 9, backend="native", sinks=s, window=4)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), want, rtol=3e-2, atol=3e-2)
        out.float().sum().backward()
        assert s.grad.dtype == sink_dtype and torch.isfinite(s.grad).all() and s.grad.abs().max() > 0


def _paged_cache(k, v, lens, page, seed):
    """The packed keys of each sequence scattered into a paged cache through a shuffled block table (differentiable
    in k and v)."""
    need = [-(-n // page) for n in lens]
    order = torch.randperm(sum(need) + 1, generator=torch.Generator().manual_seed(seed))
    table = torch.full((len(lens), max(need)), -1, dtype=torch.int32)
    slots, at, row = [], 0, 0
    for b, (n, nb) in enumerate(zip(lens, need)):
        table[b, :nb] = order[at:at + nb].to(torch.int32)
        slots += [int(table[b, j // page]) * page + j % page for j in range(n)]
        at, row = at + nb, row + n
    caches = []
    for t in (k, v):
        flat = t.new_zeros((sum(need) + 1) * page, *t.shape[1:]).index_put((torch.tensor(slots),), t)
        caches.append(flat.view(-1, page, *t.shape[1:]))
    return caches, table


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("mode", ["prefill", "chunked", "decode"])
def test_paged_native_matches_the_loop_oracle_forward_and_backward(mode, window):
    lens = [11, 3, 7]
    nq = {"prefill": lens, "chunked": [4, 1, 2], "decode": [1, 1, 1]}[mode]
    q, k, v, sinks, _, _ = packed(nq, lens, seed=5)
    scale, page = 0.4, 4
    do = torch.randn_like(q)
    cu_q = None if mode == "decode" else torch.tensor([0] + nq).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    def run(q, k, v, sinks):
        (kc, vc), table = _paged_cache(k, v, lens, page, seed=6)
        return paged_attention(q, kc, vc, table, seq_lens, softmax_scale=scale, cu_seqlens_q=cu_q,
                               max_seqlen_q=max(nq), window=window, sinks=sinks)

    want = grads(lambda *t: loop_oracle(*t[:3], nq, lens, t[3], scale, True, window), (q, k, v, sinks), do)
    got = grads(run, (q, k, v, sinks), do)
    for name, w, g in zip(("out", "dq", "dk", "dv", "dsinks"), want, got):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=name)
    (kc, vc), table = _paged_cache(k, v, lens, page, seed=6)
    ref = paged_attention_reference(q, kc, vc, table, seq_lens, softmax_scale=scale, cu_seqlens_q=cu_q,
                                    window=window, sinks=sinks)
    torch.testing.assert_close(ref, want[0], rtol=1e-10, atol=1e-10)


def test_triton_paths_refuse_sinks(monkeypatch):
    q, k, v, sinks, cu_q, cu_k = packed([4], [4], dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="sinks"):
        attention(q, k, v, cu_q, cu_k, 4, 4, backend="triton", sinks=sinks)
    (kc, vc), table = _paged_cache(k, v, [4], 4, seed=0)
    seq_lens = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="sinks"):
        paged_attention_triton(q[:1], kc, vc, table, seq_lens, 1.0, None, 1, sinks=sinks)
    monkeypatch.setenv("ARENO_KERNELS", "triton")
    with pytest.raises(NotImplementedError, match="sinks"):
        paged_attention(q[:1], kc, vc, table, seq_lens, sinks=sinks)


@pytest.mark.parametrize("bad", [torch.zeros(3), torch.zeros(4, 1), torch.zeros(4, dtype=torch.int64), [0.0] * 4])
def test_bad_sinks_are_refused_in_one_line(bad):
    q, k, v, _, cu_q, cu_k = packed([4], [4])
    with pytest.raises(ValueError, match="sinks must be a floating tensor"):
        attention(q, k, v, cu_q, cu_k, 4, 4, sinks=bad)

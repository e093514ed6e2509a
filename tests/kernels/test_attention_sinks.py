"""Attention sinks (GPT-OSS: a per-head logit in every query's softmax that carries no value): the reference, the
packed native path and the paged native path against a float64 loop oracle, forward and every gradient (d sinks
included), with and without a sliding window; the Triton kernels (packed and paged, interpreted) against float64."""

from __future__ import annotations

import pytest
import torch

from areno.kernels.attention import attention, paged_attention
from areno.kernels.attention.packed import attention_reference
from areno.kernels.attention.paged import paged_attention_native, paged_attention_reference, paged_attention_triton


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


# Triton kernels (interpreted on the CPU; tiny shapes, fp32) against the float64 reference (checked above against
# the loop oracle): the forward's LSE counts the sink, the backward kernels are unchanged, d sinks comes from LSE.
TRITON_CASES = {
    "varlen": ([9, 40, 1, 12], [9, 47, 6, 12], None, "default", "split"),
    "window_empty_rows": ([9, 20, 3], [9, 13, 3], 5, "default", "split"),
    "tma": ([9, 33], [20, 33], None, "tma", "tma_merged"),
}


@pytest.mark.parametrize("case", TRITON_CASES)
def test_packed_triton_sinks_match_float64(case, triton_kernels):
    lq, lk, window, fwd, bwd = TRITON_CASES[case]
    q, k, v, sinks, cu_q, cu_k = packed(lq, lk, d=16, dtype=torch.float32, seed=7)
    do = torch.randn_like(q)
    want = grads(lambda *t: attention_reference(*t[:3], cu_q, cu_k, window=window, sinks=t[3]),
                 [t.double() for t in (q, k, v, sinks)], do.double())
    got = grads(lambda *t: attention(*t[:3], cu_q, cu_k, max(lq), max(lk), window=window, sinks=t[3], _fwd=fwd,
                                     _bwd=bwd), (q, k, v, sinks), do)
    for name, w, g in zip(("out", "dq", "dk", "dv", "dsinks"), want, got):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, rtol=3e-5, atol=3e-5, msg=f"{case} {name}")


@pytest.mark.parametrize(("num_splits", "window"), [(1, None), (3, 3)])
def test_paged_triton_sinks_match_float64(num_splits, window, triton_kernels):
    """Decode and several queries per sequence over a cached prefix; split-K adds the sink once in the combine."""
    lens, page = [37, 5, 22], 4
    for nq in ([1, 1, 1], [3, 1, 6]):
        q, k, v, sinks, _, _ = packed(nq, lens, d=16, dtype=torch.float32, seed=8)
        (kc, vc), table = _paged_cache(k, v, lens, page, seed=9)
        cu_q = None if nq == [1, 1, 1] else torch.tensor([0] + nq).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        want = paged_attention_reference(q.double(), kc.double(), vc.double(), table, seq_lens, cu_seqlens_q=cu_q,
                                         window=window, sinks=sinks.double())
        got = paged_attention_triton(q, kc, vc, table, seq_lens, 16 ** -0.5, cu_q, max(nq), num_splits=num_splits,
                                     window=window, sinks=sinks, config=(64, 16, 4, 1))
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5, msg=f"queries {nq}")
        got = paged_attention(q, kc, vc, table, seq_lens, cu_seqlens_q=cu_q, max_seqlen_q=max(nq), window=window,
                              sinks=sinks)
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5, msg=f"dispatch, queries {nq}")


@pytest.mark.parametrize("bad", [torch.zeros(3), torch.zeros(4, 1), torch.zeros(4, dtype=torch.int64), [0.0] * 4])
def test_bad_sinks_are_refused_in_one_line(bad):
    q, k, v, _, cu_q, cu_k = packed([4], [4])
    with pytest.raises(ValueError, match="sinks must be a floating tensor"):
        attention(q, k, v, cu_q, cu_k, 4, 4, sinks=bad)


# ----------------------------------------------------------------------------------------------------------------
# GPU (bf16, real widths; H200): window + sinks within a small factor of the native (SDPA) path's own bf16 error


def _bf16_errors(lq, lk, hq, hkv, d, window, fwd=None, bwd=None, with_sinks=True):
    q, k, v, sinks, cu_q, cu_k = packed(lq, lk, hq, hkv, d, dtype=torch.float32, seed=11)
    q, k, v, do = (t.cuda().to(torch.bfloat16) for t in (q, k, v, torch.randn_like(q)))
    sinks, cu_q, cu_k = sinks.float().cuda(), cu_q.cuda(), cu_k.cuda()
    n_in = 3 + with_sinks  # q, k, v (and sinks)

    def call(fn):
        return lambda *t: fn(*t[:3], sinks=t[3] if with_sinks else None)

    want = grads(call(lambda *t, sinks: attention_reference(*t, cu_q, cu_k, window=window, sinks=sinks)),
                 [t.double() for t in (q, k, v, sinks)][:n_in], do.double())
    runs = {backend: grads(call(lambda *t, sinks, b=backend: attention(*t, cu_q, cu_k, max(lq), max(lk), backend=b,
                                                                       window=window, sinks=sinks, _fwd=fwd,
                                                                       _bwd=bwd)),
                           (q, k, v, sinks)[:n_in], do)
            for backend in ("triton", "native")}
    for i, name in enumerate(("out", "dq", "dk", "dv", "dsinks")[:n_in + 1]):
        got, base, w = runs["triton"][i], runs["native"][i], want[i]
        assert torch.isfinite(got).all(), name
        err, base_err = ((t.double() - w).abs().max().item() for t in (got, base))
        assert err <= 3 * base_err + 2e-3 * w.abs().max().item(), f"{name}: {err:.3g} vs native {base_err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(("lq", "lk"), [([4096], [4096]), ([1000, 3096], [1000, 3096]), ([1, 512], [700, 4096])],
                         ids=["4k", "varlen", "chunked"])
@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no_sinks"])
def test_gpu_bf16_window_and_sinks(lq, lk, d, with_sinks):
    _bf16_errors(lq, lk, 16, 4, d, 128, with_sinks=with_sinks)


@pytest.mark.gpu
@pytest.mark.parametrize(("fwd", "bwd", "window"), [("default", "split", 128), ("tma", "split", 128),
                                                    ("tma", "tma_merged", None), ("gluon", "gluon", None),
                                                    ("default", "split", None)])
def test_gpu_bf16_sinks_every_variant(fwd, bwd, window):
    _bf16_errors([1000, 3096], [1000, 3096], 16, 4, 128, window, fwd, bwd)


@pytest.mark.gpu
@pytest.mark.parametrize("cu", [False, True], ids=["decode", "chunked_prefill"])
def test_gpu_bf16_paged_window_and_sinks(cu):
    lens, page = [4096, 300, 2000, 17], 16
    nq = [256, 1, 64, 17] if cu else [1, 1, 1, 1]
    q, k, v, sinks, _, _ = packed(nq, lens, 16, 8, 128, dtype=torch.float32, seed=12)
    (kc, vc), table = _paged_cache(k, v, lens, page, seed=13)
    q, kc, vc = (t.cuda().to(torch.bfloat16) for t in (q, kc, vc))
    sinks, table = sinks.cuda().to(torch.bfloat16), table.cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0] + nq, device="cuda").cumsum(0).to(torch.int32) if cu else None
    kw = dict(cu_seqlens_q=cu_q, window=128, sinks=sinks)
    want = paged_attention_reference(q.double(), kc.double(), vc.double(), table, seq_lens, **kw)
    got = paged_attention(q, kc, vc, table, seq_lens, max_seqlen_q=max(nq), **kw)
    native = paged_attention_native(q, kc, vc, table, seq_lens, 128 ** -0.5, cu_q, max(nq), 128, sinks)
    assert torch.isfinite(got).all()
    err = (got.double() - want).abs().max().item()
    assert err <= 2 * (native.double() - want).abs().max().item() + 2e-3, err


@pytest.mark.gpu
def test_gpu_warm_paged_attention_compiles_window_and_sink_variants():
    from areno.kernels.attention.paged import MAX_SPLITS, warm_paged_attention

    kc = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    per_feature = 2 * MAX_SPLITS.bit_length()  # every power-of-two split count, decode and multi-token
    features = ((False, None), (True, torch.bfloat16), (False, torch.float32))
    assert warm_paged_attention(kc, kc.clone(), 16, features=features) == 3 * per_feature

"""Sliding-window attention: float64 oracle (a brute-force loop), packed native forward and backward, the paged
native path, and the Triton kernels (packed forward/backward variants and paged, interpreted on the CPU), all on
sequences longer than the window."""

from __future__ import annotations

import pytest
import torch

from areno.kernels.attention import attention, paged_attention
from areno.kernels.attention.packed import attention_reference
from areno.kernels.attention.paged import paged_attention_reference


def _loop_oracle(q, k, v, lq, lk, window, scale):
    """One query at a time: end-aligned position p sees keys max(0, p - window + 1) .. p (transformers' rule)."""
    group = q.shape[1] // k.shape[1]
    out, cq, ck = torch.zeros_like(q), 0, 0
    for nq, nk in zip(lq, lk):
        for i in range(nq):
            p = i + nk - nq
            lo = max(0, p - window + 1)
            if p < 0:
                continue
            ks = k[ck + lo:ck + p + 1].repeat_interleave(group, 1)
            vs = v[ck + lo:ck + p + 1].repeat_interleave(group, 1)
            w = torch.softmax(torch.einsum("hd,khd->hk", q[cq + i], ks) * scale, -1)
            out[cq + i] = torch.einsum("hk,khd->hd", w, vs)
        cq, ck = cq + nq, ck + nk
    return out


def _packed(lq, lk, hq=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=dtype)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=dtype)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=dtype)
    cu = lambda n: torch.tensor([0] + n).cumsum(0).to(torch.int32)  # noqa: E731
    return q, k, v, cu(lq), cu(lk)


@pytest.mark.parametrize("window", [1, 3, 7, 100])
def test_reference_window_matches_a_loop_oracle(window):
    lq, lk = [9, 4, 1, 13], [9, 11, 6, 13]  # prefill, chunked prefill (Lk > Lq), decode
    q, k, v, cu_q, cu_k = _packed(lq, lk)
    ref = attention_reference(q, k, v, cu_q, cu_k, causal=True, window=window)
    torch.testing.assert_close(ref, _loop_oracle(q, k, v, lq, lk, window, 8 ** -0.5), rtol=1e-12, atol=1e-12)
    if window < 13:  # the window changes the result (it is not ignored)
        assert not torch.allclose(ref, attention_reference(q, k, v, cu_q, cu_k, causal=True))


def test_native_window_forward_and_backward_match_float64_reference():
    lq, lk = [9, 4, 13, 2], [9, 11, 13, 2]
    window = 4
    q, k, v, cu_q, cu_k = _packed(lq, lk, dtype=torch.float32, seed=1)
    ins64 = [t.double().requires_grad_() for t in (q, k, v)]
    ins32 = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ins64, cu_q, cu_k, causal=True, window=window)
    out = attention(*ins32, cu_q, cu_k, 13, 13, causal=True, backend="native", window=window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g.float())
    for a, b in zip(ins32, ins64):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-5, atol=1e-5)


def test_paged_native_window_matches_reference():
    torch.manual_seed(2)
    page, hkv, hq, d, window = 4, 2, 4, 8, 5
    lens, nq = [11, 3, 7], [3, 1, 2]
    blocks = torch.randperm(12).view(3, 4).to(torch.int32)
    kc = torch.randn(12, page, hkv, d, dtype=torch.float64)
    vc = torch.randn(12, page, hkv, d, dtype=torch.float64)
    q = torch.randn(sum(nq), hq, d, dtype=torch.float64)
    cu_q = torch.tensor([0] + nq).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = paged_attention_reference(q, kc, vc, blocks, seq_lens, cu_seqlens_q=cu_q, window=window)
    out = paged_attention(q, kc, vc, blocks, seq_lens, cu_seqlens_q=cu_q, max_seqlen_q=3, window=window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # the native path scores in fp32
    assert not torch.allclose(ref, paged_attention_reference(q, kc, vc, blocks, seq_lens, cu_seqlens_q=cu_q))


def test_window_is_refused_where_it_cannot_apply():
    q, k, v, cu_q, cu_k = _packed([4], [4])
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, cu_q, cu_k, 4, 4, causal=False, window=2)
    with pytest.raises(ValueError, match="window"):
        attention(q, k, v, cu_q, cu_k, 4, 4, window=0)


@pytest.mark.parametrize("block_n", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [3, 21])
def test_paged_triton_window_matches_float64_reference(num_splits, window, block_n):
    """The paged kernel (interpreted on the CPU) with a window: decode and several queries per sequence (chunked
    prefill over a cached prefix), windows smaller and larger than a key block (whole blocks left of the window
    skipped), split-K on and off."""
    from areno.kernels.attention.paged import paged_attention_triton

    torch.manual_seed(3)
    page, hkv, hq, d = 4, 2, 4, 16
    lens, nq = [37, 5, 22], [3, 1, 6]
    need = [-(-n // page) for n in lens]
    blocks = torch.randperm(sum(need) + 2)
    table = torch.full((3, max(need)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = blocks[at:at + n].to(torch.int32)
        at += n
    kc, vc = (torch.randn(sum(need) + 2, page, hkv, d) for _ in range(2))
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for cu_q, q in ((None, torch.randn(3, hq, d)),
                    (torch.tensor([0] + nq).cumsum(0).to(torch.int32), torch.randn(sum(nq), hq, d))):
        want = paged_attention_reference(q.double(), kc.double(), vc.double(), table, seq_lens, cu_seqlens_q=cu_q,
                                         window=window)
        got = paged_attention_triton(q, kc, vc, table, seq_lens, d ** -0.5, cu_q, 6 if cu_q is not None else 3,
                                     num_splits=num_splits, window=window, config=(64, block_n, 4, 1))
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------------------------------------------
# The packed Triton kernels with a window (interpreted on the CPU; tiny shapes, fp32)


def _triton_vs_float64(lq, lk, window, fwd="default", bwd="split", hq=4, hkv=2, d=16, seed=0, poison=None):
    """Triton fwd + dq/dk/dv against the float64 reference; ``poison`` (key rows no query's window reaches) turns
    those K/V rows into NaN for the kernels (zeros for the reference): a kernel that reads them returns NaNs."""
    q, k, v, cu_q, cu_k = _packed(lq, lk, hq, hkv, d, dtype=torch.float32, seed=seed)
    if poison is not None:
        k[poison], v[poison] = 0.0, 0.0
    do = torch.randn_like(q)
    ins64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ins64, cu_q, cu_k, causal=True, window=window)
    ref.backward(do.double())
    if poison is not None:
        k[poison], v[poison] = float("nan"), float("nan")
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*ins, cu_q, cu_k, max(lq), max(lk), backend="triton", window=window, _fwd=fwd, _bwd=bwd)
    out.backward(do)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in ins)),
                               (ref, *(t.grad for t in ins64))):
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5, msg=f"window {window} {name}")


@pytest.mark.parametrize(("window", "blocks"), [(3, (32, 16)), (21, (16, 32)), (100, (32, 16))])
def test_packed_triton_window_matches_float64_reference(window, blocks, monkeypatch):
    """Forward "default" and backward "split", varlen: prefill, chunked prefill (Lk > Lq), decode, rows that see no
    key (Lq > Lk); windows smaller and larger than a key block, and larger than every sequence (= causal)."""
    from areno.kernels.attention import packed as attention_module

    monkeypatch.setattr(attention_module, "INTERPRET_BLOCKS", {"fwd": blocks, "dq": blocks, "dkdv": blocks[::-1]})
    _triton_vs_float64([9, 40, 1, 12], [9, 47, 6, 5], window)


@pytest.mark.parametrize(("fwd", "bwd"), [("default", "split"), ("tma", "tma_merged")])
def test_packed_triton_window_skips_key_blocks_left_of_it(fwd, bwd, monkeypatch):
    """A chunk of 16 queries over 64 keys, window 4, 16 x 16 tiles: keys 0..31 are left of every query's window; the
    forward, dQ and dK/dV kernels (pointer and TMA) must not read them (they are NaN), and their dK/dV are 0."""
    from areno.kernels.attention import packed as attention_module

    monkeypatch.setattr(attention_module, "INTERPRET_BLOCKS", {"fwd": (16, 16), "dq": (16, 16), "dkdv": (16, 16),
                                                               "bwd_merged_tma": (16, 16, 16, 16, True)})
    _triton_vs_float64([16], [64], 4, fwd=fwd, bwd=bwd, hq=2, hkv=1, poison=slice(0, 32))


@pytest.mark.parametrize("dq_first", [True, False])
def test_packed_triton_window_tma_and_dispatch(dq_first, triton_kernels, monkeypatch):
    """_fwd="tma" and _bwd="tma_merged" (both phase orders) take the window, "gluon" runs as "tma_merged"; backend
    None with a window goes to Triton (not the native path) when Triton is selected."""
    from areno.kernels.attention import packed as attention_module

    launched, real = [], attention_module.launch_kernel
    monkeypatch.setattr(attention_module, "launch_kernel", lambda kind, *a, **kw: (launched.append(kind),
                                                                                    real(kind, *a, **kw))[1])
    monkeypatch.setitem(attention_module.INTERPRET_BLOCKS, "bwd_merged_tma", (16, 32, 32, 16, dq_first))
    _triton_vs_float64([9, 30, 3], [20, 30, 1], 5, fwd="tma", bwd="gluon", hkv=1)
    assert launched == ["fwd_tma", "bwd_merged_tma"], launched

    def no_native(*args):
        raise AssertionError("the native path ran")

    monkeypatch.setattr(attention_module, "_attention_native", no_native)
    q, k, v, cu_q, cu_k = _packed([7], [7], dtype=torch.float32)
    out = attention(q, k, v, cu_q, cu_k, 7, 7, window=3)
    torch.testing.assert_close(out, attention_reference(q, k, v, cu_q, cu_k, window=3), rtol=1e-5, atol=1e-5)

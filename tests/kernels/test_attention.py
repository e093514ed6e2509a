"""attention(): Triton (interpreted on CPU) and native paths against a float64 reference, forward and dq/dk/dv."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from areno.kernels.attention import packed as attention_module
from areno.kernels.attention.packed import attention, attention_reference

# Tolerances, relative to the largest reference magnitude: fp32 keeps every product exact-ish; fp16 rounds P and
# dS to fp16 before the matmuls (about 1e-3 relative each), and the output once more.
TOL = {torch.float32: dict(fwd=2e-5, grad=5e-5), torch.float16: dict(fwd=4e-3, grad=1e-2)}

# (q lengths, k lengths, query heads, kv heads, head_dim, causal)
CASES = {
    "odd_lengths": ([1, 7, 127, 129], [1, 7, 127, 129], 2, 1, 64, True),
    "gqa1": ([33, 70], [33, 70], 4, 4, 64, True),
    "gqa2": ([33, 70], [33, 70], 4, 2, 64, True),
    "gqa4": ([33, 70], [33, 70], 4, 1, 64, True),
    "gqa8": ([33, 18], [33, 18], 8, 1, 64, True),
    "varlen_mix": ([1, 150, 3, 64, 17], [1, 150, 3, 64, 17], 2, 1, 64, True),
    "q_shorter_than_k": ([1, 5, 40, 16], [9, 5, 130, 100], 4, 2, 64, True),
    "q_longer_than_k": ([20, 8], [5, 8], 2, 1, 64, True),  # some rows see nothing: output 0
    "head_dim_80": ([45, 19], [45, 19], 2, 1, 80, True),
    "head_dim_96": ([45, 19], [52, 19], 2, 1, 96, True),
    "head_dim_128": ([45, 19], [45, 19], 2, 1, 128, True),
    "head_dim_256": ([33, 9], [33, 9], 2, 1, 256, True),
    "non_causal": ([7, 50], [30, 20], 4, 2, 64, False),
}


@pytest.fixture
def nan_buffers(monkeypatch):
    """torch.empty / empty_like hand back NaN-filled (float) or -7777-filled (int) memory: unwritten elements show."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7777)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(real_empty_like(*a, **kw)))
    assert torch.isnan(torch.empty(3)).all()


def make_inputs(lq, lk, hq, hkv, d, dtype, seed, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    cu_q = torch.tensor([0, *itertools.accumulate(lq)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *itertools.accumulate(lk)], dtype=torch.int32, device=device)
    q = torch.randn(sum(lq), hq, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(sum(lk), hkv, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(sum(lk), hkv, d, generator=g).to(device=device, dtype=dtype)
    do = torch.randn(sum(lq), hq, d, generator=g).to(device=device, dtype=dtype)
    return q, k, v, do, cu_q, cu_k


def run(q, k, v, do, cu_q, cu_k, lq, lk, causal, backend, fwd=None, bwd=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = attention(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, backend=backend, _fwd=fwd, _bwd=bwd)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def reference(q, k, v, do, cu_q, cu_k, causal):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    o = attention_reference(q, k, v, cu_q, cu_k, causal=causal)
    o.backward(do.double())
    return o.detach(), q.grad, k.grad, v.grad


def assert_close(got, want, tol, what):
    assert torch.isfinite(got).all(), f"{what}: non-finite values (unwritten output?)"
    err = (got.double() - want).abs().max().item()
    bound = tol * max(want.abs().max().item(), 1.0)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_and_native_match_reference(case, dtype, nan_buffers):
    lq, lk, hq, hkv, d, causal = CASES[case]
    seed = random.randrange(2**31)
    inputs = make_inputs(lq, lk, hq, hkv, d, dtype, seed)
    want = reference(*inputs, causal)
    tol = TOL[dtype]
    for backend in ("triton", "native"):
        got = run(*inputs, lq, lk, causal, backend)
        for name, g, w, t in zip("o dq dk dv".split(), got, want, [tol["fwd"]] + [tol["grad"]] * 3):
            assert g.dtype == dtype and g.shape == w.shape
            assert_close(g, w, t, f"{case} {backend} {name} seed={seed}")


@pytest.mark.parametrize("blocks", [(16, 32), (64, 16)], ids=["m16_n32", "m64_n16"])
@pytest.mark.parametrize("case", ["odd_lengths", "q_shorter_than_k", "q_longer_than_k"])
def test_other_tile_shapes(case, blocks, monkeypatch, nan_buffers):
    """The causal bounds (full / diagonal / tail blocks) must hold whatever BLOCK_M and BLOCK_N are."""
    monkeypatch.setattr(attention_module, "INTERPRET_BLOCKS", {"fwd": blocks, "dq": blocks, "dkdv": blocks[::-1]})
    lq, lk, hq, hkv, d, causal = CASES[case]
    seed = random.randrange(2**31)
    inputs = make_inputs(lq, lk, hq, hkv, d, torch.float32, seed)
    want = reference(*inputs, causal)
    got = run(*inputs, lq, lk, causal, "triton")
    for name, g, w in zip("o dq dk dv".split(), got, want):
        assert_close(g, w, TOL[torch.float32]["grad"], f"{case} {blocks} {name} seed={seed}")


def test_causal_is_end_aligned_and_chunking_is_exact():
    """A query chunk over cached keys equals the matching rows of full attention (the contract prefill relies on)."""
    lq, split = 50, 36
    q, k, v, _, _, _ = make_inputs([lq], [lq], 4, 2, 64, torch.float32, random.randrange(2**31))
    cu = torch.tensor([0, lq], dtype=torch.int32)
    full = attention(q, k, v, cu, cu, lq, lq, backend="triton")
    tail = attention(q[split:], k, v, torch.tensor([0, lq - split], dtype=torch.int32), cu, lq - split, lq,
                     backend="triton")
    torch.testing.assert_close(tail, full[split:], atol=1e-5, rtol=1e-5)
    # row 0 of a causal sequence sees only key 0, so it returns v[0] exactly
    torch.testing.assert_close(full[0], v[0].repeat_interleave(2, dim=0), atol=1e-6, rtol=1e-6)


def test_softmax_scale_and_dispatch(monkeypatch):
    lq = [9, 30]
    q, k, v, _, cu_q, cu_k = make_inputs(lq, lq, 2, 1, 64, torch.float32, random.randrange(2**31))
    want = attention_reference(q.double(), k.double(), v.double(), cu_q, cu_k, softmax_scale=0.3)
    for mode in ("triton", "native"):
        monkeypatch.setenv("ARENO_KERNELS", mode)
        got = attention(q, k, v, cu_q, cu_k, 30, 30, softmax_scale=0.3)
        assert_close(got, want, 2e-5, f"ARENO_KERNELS={mode}")
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attention(q, torch.randn(k.shape[0], 3, 64), torch.randn(k.shape[0], 3, 64), cu_q, cu_k, 30, 30)
    with pytest.raises(ValueError, match="backend"):
        attention(q, k, v, cu_q, cu_k, 30, 30, backend="cuda")


def run_variant(bwd, inputs, lq, lk, causal, fwd=None):
    return run(*inputs, lq, lk, causal, "triton", fwd=fwd, bwd=bwd)


def test_backward_variant_is_validated():
    q, k, v, _, cu_q, cu_k = make_inputs([4], [4], 2, 1, 16, torch.float32, 0)
    for backend in ("triton", "native"):
        with pytest.raises(ValueError, match="_bwd must be one of"):
            attention(q, k, v, cu_q, cu_k, 4, 4, backend=backend, _bwd="fused")


# ----------------------------------------------------------------------------------------------------------------
# GPU (bf16, real sizes). bf16 is judged against SDPA's own bf16 error w.r.t. the float64 reference.


def _gpu_errors(lq, lk, hq, hkv, d, causal, fwd=None, bwd=None):
    inputs = make_inputs(lq, lk, hq, hkv, d, torch.bfloat16, random.randrange(2**31), device="cuda")
    want = reference(*inputs, causal)
    got = run(*inputs, lq, lk, causal, "triton", fwd=fwd, bwd=bwd)
    base = run(*inputs, lq, lk, causal, "native")
    for name, g, b, w in zip("o dq dk dv".split(), got, base, want):
        assert torch.isfinite(g).all(), name
        err = (g.double() - w).abs().max().item()
        base_err = (b.double() - w).abs().max().item()
        # bf16: within a small factor of SDPA's own error (a real bug is off by O(1) relative)
        assert err <= 3 * base_err + 2e-3 * w.abs().max().item(), f"{name}: {err:.3g} vs SDPA {base_err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_bf16_training_shape(d):
    _gpu_errors([1024] * 8, [1024] * 8, 16, 8, d, True)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [80, 96, 256])
def test_gpu_bf16_other_head_dims(d):
    _gpu_errors([1, 700, 129, 2048], [1, 700, 129, 2048], 8, 2, d, True)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_bf16_varlen_chunked_prefill(group):
    _gpu_errors([1, 17, 300, 1000], [513, 17, 1800, 4000], 8, 8 // group, 128, True)


@pytest.mark.gpu
def test_gpu_bf16_non_causal():
    _gpu_errors([100, 1500], [700, 1500], 16, 8, 128, False)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["split"])
@pytest.mark.parametrize("shape", [
    ([1024] * 8, [1024] * 8, 16, 8, 128, True),  # training shape
    ([1024] * 4, [1024] * 4, 16, 8, 64, True),
    ([1, 700, 129, 2048], [1, 700, 129, 2048], 8, 2, 256, True),
    ([1, 700, 129, 2048], [1, 700, 129, 2048], 8, 2, 80, True),
    ([1, 17, 300, 1000], [513, 17, 1800, 4000], 8, 2, 128, True),  # chunked prefill, GQA 4
    ([100, 1500], [700, 1500], 16, 16, 128, False),
], ids=["train_d128", "train_d64", "varlen_d256", "varlen_d80", "chunked_gqa4", "non_causal_mha"])
def test_gpu_bf16_backward_variants(variant, shape):
    """The pointer backward (``_bwd="split"``, the fallback where TMA does not apply) within a small factor of SDPA's
    own bf16 error."""
    _gpu_errors(*shape, bwd=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_every_candidate_config(d, monkeypatch):
    """Whatever config the autotuner picks on some shape must be exact: check each one, kernel by kernel."""
    for kind in ("fwd", "dkdv", "dq"):  # the pointer kernels (auto runs TMA on sm_90+)
        for cfg in attention_module.CONFIGS[(kind, d)]:
            monkeypatch.setattr(attention_module, "FORCE_CONFIG", {kind: cfg})
            _gpu_errors([1, 300, 1000, 77], [1, 300, 1200, 77], 8, 2, d, True, fwd="default", bwd="split")


# ----------------------------------------------------------------------------------------------------------------
# The TMA variants (_fwd="tma", _bwd="tma_merged"): the interpreter emulates tensor descriptors, including a tile that
# runs past its sequence into the next one (the bounds handling in tma.py's docstring).

TMA_CASES = {
    "gqa2_varlen": ([1, 29, 19], [1, 29, 19], 4, 2, 32, True),
    "chunked_gqa4": ([5, 26, 3], [9, 26, 45], 4, 1, 16, True),  # queries end-aligned on longer key sequences
    "q_longer_than_k": ([20, 8], [5, 8], 2, 1, 32, True),  # rows that see no key
    "non_causal": ([7, 50], [30, 20], 4, 2, 32, False),  # key tiles past Lk are not causally masked here
}


@pytest.fixture
def launched(monkeypatch):
    """The kernel kinds attention() launches, in order (the real launcher runs)."""
    kinds, real = [], attention_module.launch_kernel

    def spy(kind, *args, **kwargs):
        kinds.append(kind)
        return real(kind, *args, **kwargs)

    monkeypatch.setattr(attention_module, "launch_kernel", spy)
    return kinds


def test_tma_other_tiles_and_fallback(monkeypatch, nan_buffers, launched):
    """TMA forward with a key tile taller than the query tile (beside the pointer backward); and a head_dim no D-wide
    descriptor fits runs the pointer kernels."""
    monkeypatch.setitem(attention_module.INTERPRET_BLOCKS, "fwd_tma", (16, 32))
    for d, kinds in ((32, ["fwd_tma", "dkdv", "dq"]), (24, ["fwd", "dkdv", "dq"])):
        lq, lk, hq, hkv, causal = [3, 45], [3, 61], 4, 2, True
        seed = random.randrange(2**31)
        inputs = make_inputs(lq, lk, hq, hkv, d, torch.float32, seed)
        want = reference(*inputs, causal)
        got = run_variant("split", inputs, lq, lk, causal, fwd="tma")
        assert launched == kinds, launched
        launched.clear()
        for name, g, w in zip("o dq dk dv".split(), got, want):
            assert_close(g, w, TOL[torch.float32]["grad"], f"d{d} tma forward {name} seed={seed}")


@pytest.mark.parametrize("case", list(TMA_CASES))
def test_tma_merged_matches_reference(case, nan_buffers, launched):
    """_bwd="tma_merged": one launch, key tile t's dK/dV and query tile t's dQ per program (the default
    interpreter tiles: phase 1 16 x 32, phase 2 32 x 16, dQ phase first); varlen, chunked (more key tiles than query
    tiles), rows that see no key, non-causal."""
    lq, lk, hq, hkv, d, causal = TMA_CASES[case]
    seed = random.randrange(2**31)
    for dtype in (torch.float32, torch.float16) if case == "gqa2_varlen" else (torch.float32,):
        inputs = make_inputs(lq, lk, hq, hkv, d, dtype, seed)
        want = reference(*inputs, causal)
        got = run_variant("tma_merged", inputs, lq, lk, causal, fwd="tma")
        assert launched == ["fwd_tma", "bwd_merged_tma"], launched
        launched.clear()
        for name, g, w in zip("o dq dk dv".split(), got, want):
            assert g.dtype == dtype and g.shape == w.shape and g.is_contiguous()
            assert_close(g, w, TOL[dtype]["grad"], f"{case} {dtype} tma_merged {name} seed={seed}")


def test_tma_merged_other_tiles_and_fallback(monkeypatch, nan_buffers, launched):
    """Phase 1's key tile shorter than its query step and phase 2's key step longer than its query tile, the dK/dV
    phase first, GQA group 1; chunked (key tiles past the query tiles) and Lq > Lk (query tiles past the key tiles,
    rows that see no key); a head_dim no D-wide descriptor fits runs the pointer split pair; BLOCK_M2 != BLOCK_N1 is
    refused."""
    monkeypatch.setitem(attention_module.INTERPRET_BLOCKS, "bwd_merged_tma", (32, 16, 16, 32, False))
    for d, kinds in ((32, ["fwd_tma", "bwd_merged_tma"]), (24, ["fwd", "dkdv", "dq"])):
        lq, lk, hq, hkv, causal = [3, 45, 40], [3, 61, 10], 2, 2, True
        seed = random.randrange(2**31)
        inputs = make_inputs(lq, lk, hq, hkv, d, torch.float32, seed)
        want = reference(*inputs, causal)
        got = run_variant("tma_merged", inputs, lq, lk, causal, fwd="tma")
        assert launched == kinds, launched
        launched.clear()
        for name, g, w in zip("o dq dk dv".split(), got, want):
            assert_close(g, w, TOL[torch.float32]["grad"], f"d{d} tma_merged {name} seed={seed}")
    monkeypatch.setitem(attention_module.INTERPRET_BLOCKS, "bwd_merged_tma", (16, 32, 16, 16, True))
    with pytest.raises(ValueError, match="BLOCK_M2 == BLOCK_N1"):
        run_variant("tma_merged", make_inputs([5], [5], 2, 1, 16, torch.float32, 0), [5], [5], True, fwd="tma")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_tma_forward_rescales_for_late_score_jumps(dtype, nan_buffers):
    """The online softmax's rescaling in the TMA forward: keys whose scores jump late in the sequence (one large jump,
    and a steady climb over many blocks) give the reference's output and gradients."""
    lq = lk = [100, 77]
    seed = random.randrange(2**31)
    q, k, v, do, cu_q, cu_k = make_inputs(lq, lk, 4, 2, 16, dtype, seed)
    k = k.clone()
    k[40:48] *= 6.0  # sequence 0: one jump, seen unmasked by the query tiles past row 48
    k[100:177] *= torch.linspace(0.2, 3.0, 77, dtype=dtype)[:, None, None]  # sequence 1: a steady climb
    want = reference(q, k, v, do, cu_q, cu_k, True)
    got = run_variant("tma_merged", (q, k, v, do, cu_q, cu_k), lq, lk, True, fwd="tma")
    for name, g, w in zip("o dq dk dv".split(), got, want):
        assert_close(g, w, TOL[dtype]["grad"], f"late score jumps {dtype} {name} seed={seed}")


def test_auto_variants_pick_tma_on_hopper_only(monkeypatch, launched):
    """By default (None or "auto") the Gluon kernels run on sm_90 (TMA ones where Gluon does not apply) and the
    pointer ones elsewhere (the interpreter included); an explicit variant is kept either way."""
    assert (attention_module.forward_variant(), attention_module.backward_variant()) == ("default", "split")
    inputs = make_inputs([5, 9], [5, 9], 2, 1, 16, torch.float32, 0)
    run_variant(None, inputs, [5, 9], [5, 9], True)
    assert launched == ["fwd", "dkdv", "dq"], launched
    launched.clear()
    monkeypatch.setattr(attention_module, "hopper", lambda: True)
    gluon = attention_module.attention_gluon.available()
    assert (attention_module.forward_variant(), attention_module.backward_variant("auto")) == (
        ("gluon", "gluon") if gluon else ("tma", "tma_merged"))
    run_variant(None, inputs, [5, 9], [5, 9], True)
    assert launched == ["fwd_tma", "bwd_merged_tma"], launched  # the Gluon kernels do not apply on the CPU
    assert (attention_module.forward_variant("default"), attention_module.backward_variant("split")) == (
        "default", "split")


def test_forward_variant_is_validated():
    q, k, v, _, cu_q, cu_k = make_inputs([4], [4], 2, 1, 16, torch.float32, 0)
    for backend in ("triton", "native"):
        with pytest.raises(ValueError, match="_fwd must be one of"):
            attention(q, k, v, cu_q, cu_k, 4, 4, backend=backend, _fwd="wgmma")


TMA_GPU_SHAPES = {
    "train_d128": ([1024] * 8, [1024] * 8, 16, 8, 128, True),
    "train_d64": ([1024] * 4, [1024] * 4, 16, 8, 64, True),
    "varlen_odd_d128": ([1, 700, 129, 2048, 77], [1, 700, 129, 2048, 77], 8, 2, 128, True),
    "varlen_d256": ([1, 700, 129, 2048], [1, 700, 129, 2048], 8, 2, 256, True),
    "chunked_gqa4": ([1, 17, 300, 1000], [513, 17, 1800, 4000], 8, 2, 128, True),
    "non_causal_mha": ([100, 1500], [700, 1500], 16, 16, 128, False),
    "d80_falls_back": ([1, 700, 129], [1, 700, 129], 8, 2, 80, True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("pair", [("tma", "tma_merged"), ("tma", "split"), ("default", "tma_merged")],
                         ids="-".join)
@pytest.mark.parametrize("shape", list(TMA_GPU_SHAPES))
def test_gpu_bf16_tma_variants(shape, pair, launched):
    """The TMA forward and merged backward on odd varlen shapes, within a small factor of SDPA's bf16 error."""
    _gpu_errors(*TMA_GPU_SHAPES[shape], fwd=pair[0], bwd=pair[1])
    tma = shape != "d80_falls_back"
    want = ["fwd_tma" if tma and pair[0] == "tma" else "fwd"]
    want += ["bwd_merged_tma"] if tma and pair[1] == "tma_merged" else ["dkdv", "dq"]
    assert launched == want, launched


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_tma_every_candidate_config(d, monkeypatch, launched):
    for kind in ("fwd_tma", "bwd_merged_tma"):
        for cfg in attention_module.CONFIGS[(kind, d)]:
            monkeypatch.setattr(attention_module, "FORCE_CONFIG", {kind: cfg})
            _gpu_errors([1, 300, 1000, 77], [1, 300, 1200, 77], 8, 2, d, True, fwd="tma", bwd="tma_merged")
            assert kind in launched
            launched.clear()


def test_autotune_off_keeps_each_kernels_first_candidate(monkeypatch):
    """ARENO_AUTOTUNE=off: an autotuner built then gets only its list's first config (nothing to benchmark); on or
    unset: every candidate; anything else is refused by name."""
    from areno.kernels.dispatch import autotune_candidates

    monkeypatch.setenv("ARENO_AUTOTUNE", "off")
    attention_module.autotuned.cache_clear()
    try:
        tuned = attention_module.autotuned("fwd_tma", 128)
        assert tuned.configs == attention_module.CONFIGS[("fwd_tma", 128)][:1]
        monkeypatch.setenv("ARENO_AUTOTUNE", "on")
        assert autotune_candidates([1, 2, 3]) == [1, 2, 3]
        monkeypatch.delenv("ARENO_AUTOTUNE")
        assert autotune_candidates((1, 2)) == [1, 2]
        monkeypatch.setenv("ARENO_AUTOTUNE", "fast")
        with pytest.raises(ValueError, match="ARENO_AUTOTUNE"):
            autotune_candidates([1])
    finally:
        attention_module.autotuned.cache_clear()


def test_native_cpu_path_pads_similar_lengths_together(monkeypatch):
    """The CPU native path batches sequences of similar length (one SDPA call per group): a long sequence is not
    padded together with many short ones, empty sequences and rows outside every sequence give 0, and values and
    gradients equal the float64 reference's (here in float64 too)."""
    assert attention_module.length_groups([1000, 3, 3, 3, 3, 0, 500], [1000, 3, 3, 3, 3, 4, 500]) == \
        [[0, 6], [1, 2, 3, 4]]
    assert attention_module.length_groups([40] * 64, [40] * 64) == [list(range(64))]
    lq, lk = [0, 61, 2, 3, 0, 40, 9], [0, 61, 2, 7, 5, 40, 4]  # empty, chunked-prefill, Lq > Lk rows
    seed = random.randrange(2**31)
    q, k, v, do, cu_q, cu_k = make_inputs(lq, lk, 4, 2, 16, torch.float64, seed)
    q = torch.cat([q, torch.randn(3, 4, 16, dtype=torch.float64)])  # rows past the last sequence
    do = torch.cat([do, torch.randn(3, 4, 16, dtype=torch.float64)])
    for causal in (True, False):
        want = reference(q, k, v, do, cu_q, cu_k, causal)
        got = run(q, k, v, do, cu_q, cu_k, lq, lk, causal, "native")
        for name, g, w in zip("o dq dk dv".split(), got, want):
            assert_close(g, w, 1e-12, f"native cpu causal={causal} {name} seed={seed}")
        assert (got[0][-3:] == 0).all()

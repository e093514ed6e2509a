"""Small-M split-K GEMM: Triton (interpreted, explicit configs) vs float64 over odd shapes; linear()'s dispatch;
bf16 at Qwen3-0.6B's decode shapes and under CUDA-graph capture on a GPU."""

import pytest
import torch
import torch.nn.functional as F

from areno.kernels import gemm as mod
from areno.kernels._device import sm_count
from areno.kernels.gemm import GemmConfig, default_config, gemm_launch, linear

# (rtol, atol) against float64 of the same (rounded) inputs with outputs ~ N(0, 1): fp32 differs by summation
# order only (IEEE products); fp16/bf16 round the fp32 sum once (2^-11 / 2^-8 relative).
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (1e-3, 2e-4), torch.bfloat16: (8e-3, 2e-3)}


@pytest.fixture
def nan_empty(monkeypatch):
    """Every float buffer the launcher allocates (output, split-K workspace) starts as NaN: unwritten elements fail."""
    real_empty = torch.empty

    def empty(*a, **k):
        t = real_empty(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


def _inputs(M, N, K, dtype, device="cpu", bias=False):
    x = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(N, K, device=device) * K**-0.5).to(dtype)
    b = torch.randn(N, device=device).to(dtype) if bias else None
    return x, w, b


def _reference(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _close(actual, expected, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


# ---- Triton path, interpreted, explicit configs --------------------------------------------------------------

# (M, N, K, config): SPLIT_K 1/2/3, K not a multiple of BLOCK_K * SPLIT_K (K=24 with BLOCK_K 16 and SPLIT_K 3 leaves
# the last split empty), tiles wider than M or N, several M tiles.
CASES = [
    (1, 16, 24, GemmConfig(16, 16, 16, 1, 4, 2)),
    (7, 50, 100, GemmConfig(16, 32, 32, 1, 4, 2)),
    (33, 50, 24, GemmConfig(16, 16, 16, 1, 4, 2)),
    (1, 50, 100, GemmConfig(16, 16, 32, 2, 4, 2)),
    (7, 16, 24, GemmConfig(16, 16, 16, 2, 4, 2)),
    (33, 16, 100, GemmConfig(32, 16, 16, 2, 4, 2)),
    (1, 16, 100, GemmConfig(16, 16, 16, 3, 4, 2)),
    (7, 50, 24, GemmConfig(16, 32, 16, 3, 4, 2)),
    (33, 50, 100, GemmConfig(16, 16, 32, 3, 4, 2)),
    (33, 50, 96, GemmConfig(16, 16, 16, 3, 4, 2)),  # K = SPLIT_K * 2 * BLOCK_K: the unmasked loop
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K,config", CASES)
def test_gemm_matches_float64(nan_empty, M, N, K, config, dtype):
    x, w, _ = _inputs(M, N, K, dtype)
    y = gemm_launch(x, w, config)
    assert y.shape == (M, N) and y.dtype == dtype
    _close(y, _reference(x, w), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split_k", [1, 3])
def test_gemm_bias_and_strided_rows(nan_empty, split_k, dtype):
    big, w, b = _inputs(9, 50, 130, dtype, bias=True)
    x = big[:, 3:103]  # row stride 130, K = 100
    w = torch.cat([w, w], 1)[:, :100]  # row stride 260
    y = gemm_launch(x, w, GemmConfig(16, 32, 32, split_k, 4, 2), b)
    _close(y, _reference(x, w, b), dtype)


def test_gemm_split_k_is_deterministic():
    x, w, _ = _inputs(7, 50, 100, torch.float32)
    two_pass = gemm_launch(x, w, GemmConfig(16, 16, 16, 3, 4, 2))
    assert torch.equal(gemm_launch(x, w, GemmConfig(16, 16, 16, 3, 4, 2)), two_pass)


def test_gemm_empty_sizes():
    w = torch.randn(5, 8)
    assert gemm_launch(torch.randn(0, 8), w, GemmConfig(16, 16, 16, 1, 4, 2)).shape == (0, 5)
    b = torch.randn(5)
    y = gemm_launch(torch.randn(3, 0), torch.randn(5, 0), GemmConfig(16, 16, 16, 2, 4, 2), b)
    assert torch.equal(y, b.expand(3, 5))


def test_launcher_rejects_bad_inputs():
    cfg = GemmConfig(16, 16, 16, 1, 4, 2)
    with pytest.raises(AssertionError, match="K=8"):
        gemm_launch(torch.randn(3, 8), torch.randn(5, 9), cfg)
    with pytest.raises(AssertionError, match="share"):
        gemm_launch(torch.randn(3, 8), torch.randn(5, 8, dtype=torch.float16), cfg)
    with pytest.raises(AssertionError, match="unit stride"):
        gemm_launch(torch.randn(8, 3).t(), torch.randn(5, 8), cfg)
    with pytest.raises(AssertionError, match="powers of 2"):
        gemm_launch(torch.randn(3, 8), torch.randn(5, 8), GemmConfig(16, 24, 16, 1, 4, 2))
    with pytest.raises(AssertionError, match="bias"):
        gemm_launch(torch.randn(3, 8), torch.randn(5, 8), cfg, torch.randn(4))


def test_default_config_table_and_heuristic(monkeypatch):
    # 1 x 32 tiles of 64 x 32: K split 4 ways to fill 132 SMs (2 K tiles left per split, so 4 stages, not 6)
    assert mod.heuristic_config(64, 1024, 2048, 132) == GemmConfig(64, 32, 128, 4, 4, 4)
    assert mod.heuristic_config(1, 4096, 1024, 132) == GemmConfig(16, 32, 128, 1, 4, 6)  # 128 tiles: no split
    assert mod.heuristic_config(256, 6144, 1024, 132).block_n == 128  # widened while tiles > SMs
    assert default_config(64, 1000, 2048, 132) is None  # not in TUNED: cuBLAS until a sweep says otherwise
    big = GemmConfig(128, 64, 64, 1, 8, 3)
    small = GemmConfig(64, 32, 128, 4, 4, 4)
    monkeypatch.setattr(mod, "TUNED", {(1024, 2048): [(16, small), (64, None), (512, big)]})
    assert default_config(16, 1024, 2048) == small._replace(block_m=16)  # BLOCK_M capped at next_pow2(M)
    assert default_config(17, 1024, 2048) is None and default_config(64, 1024, 2048) is None  # cuBLAS there
    assert default_config(100, 1024, 2048) == big
    assert default_config(4096, 1024, 2048) == big  # past the table: its last entry


# ---- dispatch --------------------------------------------------------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """Counts the Triton launches that linear() makes."""
    calls = []
    real = mod.gemm_launch
    monkeypatch.setattr(mod, "gemm_launch", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    return calls


def _tune(monkeypatch, *shapes):
    """Give these (N, K) a TUNED entry (the heuristic's config): untabled shapes go to cuBLAS."""
    for n, k in shapes:
        monkeypatch.setitem(mod.TUNED, (n, k), [(512, mod.heuristic_config(512, n, k, 132))])


def test_linear_gated_by_triton_max_m(triton_kernels, monkeypatch, launches):
    _tune(monkeypatch, (50, 40))
    x, w, b = _inputs(6, 50, 40, torch.float32, bias=True)
    x = x.view(2, 3, 40)
    assert 0 < mod.TRITON_MAX_M < 256  # on for decode batches up to 128 (bench/gemm.py: cuBLAS as fast from 256)
    monkeypatch.setattr(mod, "TRITON_MAX_M", 0)
    _close(linear(x, w, b), _reference(x, w, b), torch.float32)
    assert launches == []
    monkeypatch.setattr(mod, "TRITON_MAX_M", 6)
    y = linear(x, w, b)
    assert y.shape == (2, 3, 50) and len(launches) == 1
    _close(y, _reference(x, w, b), torch.float32)
    monkeypatch.setattr(mod, "TRITON_MAX_M", 5)  # M = 6 > 5: cuBLAS/F.linear, also under ARENO_KERNELS=triton
    linear(x, w, b)
    assert len(launches) == 1
    monkeypatch.setattr(mod, "TRITON_MAX_M", 6)
    monkeypatch.setattr(mod, "TUNED", {(50, 40): [(512, None)]})  # the table says cuBLAS for this shape
    _close(linear(x, w, b), _reference(x, w, b), torch.float32)
    assert len(launches) == 1


def test_linear_needing_grad_uses_native(triton_kernels, monkeypatch, launches):
    monkeypatch.setattr(mod, "TRITON_MAX_M", 512)
    _tune(monkeypatch, (16, 32))
    x, w, _ = _inputs(4, 16, 32, torch.float32)
    w.requires_grad_()
    y = linear(x, w)
    assert launches == [] and y.requires_grad
    (g,) = torch.autograd.grad(y.sum(), w)
    torch.testing.assert_close(g, x.sum(0).expand(16, 32))
    with torch.no_grad():
        linear(x, w)
    assert len(launches) == 1
    x.requires_grad_()
    with torch.inference_mode():
        linear(x, w.detach())
    assert len(launches) == 2


def test_linear_dispatch_rule(monkeypatch, launches):
    monkeypatch.setattr(mod, "TRITON_MAX_M", 512)
    _tune(monkeypatch, (16, 32), (16, 8))
    x, w, _ = _inputs(4, 16, 32, torch.float32)
    monkeypatch.setenv("ARENO_KERNELS", "native")
    linear(x, w)
    assert launches == []
    monkeypatch.setenv("ARENO_KERNELS", "triton")
    linear(x, w)
    assert len(launches) == 1
    with pytest.raises(RuntimeError, match="does not support"):  # float64: no Triton path
        linear(x.double(), w.double())
    linear(x[:, :8], w[:, :8])  # strided rows are fine
    assert len(launches) == 2
    for xs, ws in ((x, w.t().contiguous().t()), (x.t().contiguous().t(), w)):  # a strided K is not
        with pytest.raises(RuntimeError, match="does not support"):
            linear(xs, ws)
    monkeypatch.setenv("ARENO_KERNELS", "auto")  # interpreted here: Triton where it can, F.linear elsewhere
    _close(linear(x, w.t().contiguous().t()), _reference(x, w), torch.float32)
    _close(linear(x.double(), w.double()), _reference(x, w), torch.float32)
    assert len(launches) == 2
    linear(x, w)
    assert len(launches) == 3


# ---- GPU: bf16 at the real shapes --------------------------------------------------------------------------------

DECODE_SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]  # (K, N): qkv, o, gate_up, down


@pytest.mark.gpu
@pytest.mark.parametrize("K,N", DECODE_SHAPES)
@pytest.mark.parametrize("M", [1, 37, 256, 512])
def test_gemm_gpu_bf16_decode_shapes(K, N, M):
    x, w, b = _inputs(M, N, K, torch.bfloat16, device="cuda", bias=True)
    ref = _reference(x, w)
    picked = default_config(M, N, K, sm_count(0)) or mod.heuristic_config(M, N, K, sm_count(0))  # None: cuBLAS
    for cfg in (picked, mod.heuristic_config(M, N, K, sm_count(0)), GemmConfig(32, 64, 128, 4, 4, 3),
                GemmConfig(64, 128, 64, 1, 8, 3), GemmConfig(16, 32, 64, 3, 4, 4),
                GemmConfig(64, 32, 128, 4, 4, 4), GemmConfig(128, 64, 64, 3, 8, 3)):  # fmt: skip
        _close(gemm_launch(x, w, cfg), ref, torch.bfloat16)
    _close(gemm_launch(x, w, GemmConfig(64, 64, 128, 2, 4, 4), b), _reference(x, w, b), torch.bfloat16)
    # within bf16 rounding of cuBLAS too
    torch.testing.assert_close(gemm_launch(x, w, picked), F.linear(x, w), rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 4])
def test_gemm_gpu_cuda_graph_replay(monkeypatch, split_k):
    monkeypatch.setattr(mod, "TRITON_MAX_M", 512)
    monkeypatch.setenv("ARENO_KERNELS", "auto")
    monkeypatch.setattr(mod, "TUNED", {(1024, 2048): [(512, GemmConfig(64, 64, 128, split_k, 4, 4))]})
    x, w, _ = _inputs(256, 1024, 2048, torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        linear(x, w)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        y = linear(x, w)
    for _ in range(3):  # replays read the new x
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        _close(y, _reference(x, w), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64, 100, 256])
def test_linear_gpu_with_tuned_table(monkeypatch, M):
    """linear() at the real shapes with the tuned table: Triton where it has a config, F.linear where it says None."""
    monkeypatch.setattr(mod, "TRITON_MAX_M", 512)
    monkeypatch.setenv("ARENO_KERNELS", "auto")
    for K, N in DECODE_SHAPES:
        x, w, _ = _inputs(M, N, K, torch.bfloat16, device="cuda")
        with torch.no_grad():
            y = linear(x.view(1, M, K), w)
        assert y.shape == (1, M, N)
        _close(y[0], _reference(x, w), torch.bfloat16)

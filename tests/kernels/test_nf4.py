"""NF4 weights: bitsandbytes' bytes, the quantisation error against a float64 round trip, and the Triton GEMM with
its NF4 prologue (forward and input gradient, interpreted) against float64 on odd shapes; bf16 at 4096 on a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areno.kernels import nf4
from areno.kernels.nf4 import (
    NF4,
    Nf4LinearFunction,
    dequantize_nf4,
    dequantize_nf4_triton,
    nf4_linear,
    quantize_nf4,
)

SHAPES = [(37, 70), (64, 128), (33, 200), (300, 257)]  # flat blocks crossing rows, a short last block, odd counts


def _weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 3


def _ref(q):
    """Float64 dequantisation from the format's definition (element i = n K + k; high nibble first)."""
    n = q.shape[0] * q.shape[1]
    bytes_ = q.packed.long().tolist()
    codes = [(bytes_[i // 2] >> (4 if i % 2 == 0 else 0)) & 15 for i in range(n)]
    dyn = nf4.dynamic_map().double()
    scale = [dyn[q.qabs[i // 64].item()].item() * q.absmax2[i // 64 // 256].item() + q.offset.item()
             for i in range(n)]
    return torch.tensor([NF4[c] * s for c, s in zip(codes, scale)], dtype=torch.float64).view(q.shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_quantisation_error_bounded_against_float64_round_trip(shape):
    w = _weight(shape)
    q = quantize_nf4(w)
    assert q.packed.dtype == torch.uint8 and q.packed.numel() == (w.numel() + 1) // 2
    assert q.qabs.numel() == -(-w.numel() // 64) and q.absmax2.numel() == -(-q.qabs.numel() // 256)
    deq = dequantize_nf4(q)
    torch.testing.assert_close(deq.double(), _ref(q), rtol=1e-6, atol=1e-7)
    flat = w.double().reshape(-1)
    absmax = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 64)).view(-1, 64).abs().amax(1)
    # the doubly quantised scale: within half a dynamic-map step (<= 0.0071 relative in the top decade) of absmax2
    second = q.absmax2.double().repeat_interleave(256)[: absmax.numel()]
    scales = nf4.block_scales(q).double()
    assert ((scales - absmax).abs() <= 0.0071 * second + 1e-6).all()
    # every code is the nearest NF4 level to w / absmax (float64), up to float32 rounding at a midpoint
    per = absmax.repeat_interleave(64)[: flat.numel()]
    levels = torch.tensor(NF4, dtype=torch.float64)
    dist = ((flat / per)[:, None] - levels[None, :]).abs()
    chosen = torch.stack([q.packed >> 4, q.packed & 15], 1).reshape(-1)[: flat.numel()].long()
    assert (dist.gather(1, chosen[:, None])[:, 0] - dist.min(1).values <= 1e-6).all()
    # so the round-trip error is at most half the widest NF4 gap times the scale, plus the scale's own error
    half_gap = max(b - a for a, b in zip(NF4, NF4[1:])) / 2
    err = (deq.double().reshape(-1) - flat).abs()
    assert (err <= half_gap * per + (scales - absmax).abs().repeat_interleave(64)[: flat.numel()] + 1e-6).all()


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_quantize_gives_bitsandbytes_bytes(shape):
    bnb = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is not installed")
    w = _weight(shape, seed=1).to(torch.bfloat16)
    q = quantize_nf4(w)
    packed, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert torch.equal(packed.view(-1), q.packed)  # the 4-bit codes: byte for byte
    assert torch.equal(state.state2.absmax, q.absmax2) and state.offset.item() == q.offset.item()
    code = nf4.dynamic_map()
    assert torch.equal(state.state2.code, code)
    # the 8-bit scale codes: areno takes the nearest dynamic-map entry (as bitsandbytes' PyTorch and CUDA paths);
    # its CPU C path searches approximately, and picks the other neighbour a value near a midpoint
    differ = (state.absmax != q.qabs).nonzero()[:, 0]
    assert len(differ) <= max(1, q.qabs.numel() // 50)
    scaled = ((nf4.block_scales(q) - q.offset) / q.absmax2.repeat_interleave(256)[: q.qabs.numel()])
    for i in differ.tolist():
        theirs, mine = code[state.absmax[i].long()], code[q.qabs[i].long()]
        assert abs(int(state.absmax[i]) - int(q.qabs[i])) == 1
        assert (scaled[i] - mine).abs() <= (scaled[i] - theirs).abs() + 1e-7
    same = torch.ones(w.numel(), dtype=torch.bool)
    for i in differ.tolist():
        same[i * 64 : (i + 1) * 64] = False
    theirs = bnb.dequantize_4bit(packed, state).float().reshape(-1)
    assert torch.equal(theirs[same], dequantize_nf4(q, torch.bfloat16).float().reshape(-1)[same])


def test_single_block_dequantises_as_bitsandbytes():
    # one absmax block: bitsandbytes' C CPU path stores the 0 second-level scale as (code 0, absmax2 0), the Python
    # path (and areno) as (code of 0.0, 1e-38); both dequantise to the offset
    bnb = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is not installed")
    w = _weight((5, 3), seed=2)
    packed, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    assert torch.equal(packed.view(-1), quantize_nf4(w).packed)
    torch.testing.assert_close(bnb.dequantize_4bit(packed, state), dequantize_nf4(quantize_nf4(w)), rtol=0, atol=0)


TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K", [(7, 37, 70), (1, 65, 130), (20, 48, 33)])
def test_triton_forward_and_input_grad_against_float64(triton_kernels, M, N, K, dtype):
    q = quantize_nf4(_weight((N, K), seed=M))
    w64 = _ref(q)
    x = torch.randn(M, K).to(dtype).requires_grad_(True)
    y = nf4_linear(x, q)
    assert y.dtype == dtype and y.shape == (M, N)
    rtol, atol = TOL[dtype]
    wd = w64.to(dtype).double()  # the prologue rounds W' to x's dtype, as the native path does
    torch.testing.assert_close(y.double(), x.detach().double() @ wd.T, rtol=rtol, atol=atol * K**0.5)
    dy = torch.randn(M, N).to(dtype)
    y.backward(dy)
    torch.testing.assert_close(x.grad.double(), dy.double() @ wd, rtol=rtol, atol=atol * N**0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 37, 128), (7, 65, 192), (20, 48, 64), (17, 16, 256)])
def test_fused_gemm_over_whole_blocks_against_float64(triton_kernels, M, N, K, dtype):
    # K % 64 == 0: the fused GEMM (a weight row's NF4 blocks, even / odd columns by nibble)
    q = quantize_nf4(_weight((N, K), seed=M + K))
    wd = _ref(q).to(dtype).double()
    x = torch.randn(M, K).to(dtype)
    rtol, atol = TOL[dtype]
    for path in ("fused", "planes", "auto"):
        y = nf4.nf4_matmul(x, q, _path=path)
        assert y.dtype == dtype and y.shape == (M, N)
        torch.testing.assert_close(y.double(), x.double() @ wd.T, rtol=rtol, atol=atol * K**0.5)


@pytest.mark.parametrize("cfg", [(16, 16, 2, 2, 1, 1), (16, 32, 4, 3, 1, 1), (32, 16, 1, 5, 1, 1)])
def test_fused_gemm_steps_and_splits_against_float64(triton_kernels, cfg):
    # several NF4 blocks a step and K split unevenly: K = 320 is 5 blocks, so a step or a split runs past the row's
    # end (masked); split > 1 writes fp32 partials that one sum adds
    M, N, K = 18, 40, 320
    q = quantize_nf4(_weight((N, K), seed=3))
    wd = _ref(q).double()
    x = torch.randn(M, K)
    rtol, atol = TOL[torch.float32]
    for path in ("fused", "planes") if cfg[2] >= 2 else ("fused",):  # planes: 2 or more blocks a step
        y = nf4.nf4_matmul(x, q, _path=path, _cfg=cfg)
        torch.testing.assert_close(y.double(), x.double() @ wd.T, rtol=rtol, atol=atol * K**0.5)


def test_auto_takes_the_fused_gemm_at_decode_rows_only(triton_kernels, monkeypatch):
    # "auto": the fused GEMM up to FUSED_MAX_ROWS rows over whole blocks; the dequantising pass for more rows, the
    # input gradient (trans) and K not a multiple of 64
    passes = []
    real = nf4.dequantize_nf4_triton
    monkeypatch.setattr(nf4, "dequantize_nf4_triton", lambda *a: passes.append(1) or real(*a))
    q, q96 = quantize_nf4(_weight((16, 128))), quantize_nf4(_weight((16, 96)))
    rows = nf4.FUSED_MAX_ROWS
    calls = [(rows, q, False, 0), (rows + 1, q, False, 1), (1, q, True, 1), (1, q96, False, 1)]
    for m, w, trans, expect in calls:
        passes.clear()
        nf4.nf4_matmul(torch.randn(m, w.shape[0] if trans else w.shape[1]), w, trans=trans)
        assert len(passes) == expect, (m, w.shape, trans)


def test_fused_gemm_refuses_what_it_does_not_cover(triton_kernels):
    q = quantize_nf4(_weight((16, 96)))  # K = 96: blocks straddle rows
    with pytest.raises(ValueError, match="whole NF4 blocks"):
        nf4.nf4_matmul(torch.randn(2, 96), q, _path="fused")
    q = quantize_nf4(_weight((16, 64)))
    with pytest.raises(ValueError, match="forward only"):
        nf4.nf4_matmul(torch.randn(2, 16), q, trans=True, _path="fused")
    with pytest.raises(ValueError, match="_path"):
        nf4.nf4_matmul(torch.randn(2, 64), q, _path="cublas")
    with pytest.raises(ValueError, match="2 or more NF4 blocks"):
        nf4.nf4_matmul(torch.randn(2, 64), q, _path="planes", _cfg=(16, 16, 1, 1, 1, 1))


@pytest.mark.parametrize("shape", [(37, 70), (130, 129), (3, 64), (3, 21)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_dequantisation_equals_native(triton_kernels, shape, dtype):
    q = quantize_nf4(_weight(shape, seed=shape[0]))
    got = dequantize_nf4_triton(q, dtype)
    assert got.dtype == dtype and got.shape == shape
    torch.testing.assert_close(got, dequantize_nf4(q, dtype), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_many_rows_dequantise_then_multiply_against_float64(triton_kernels, dtype):
    M, N, K = 131, 40, 67  # prefill / training sizes, K % 64 != 0: W' written once, then torch.matmul
    q = quantize_nf4(_weight((N, K), seed=5))
    wd = _ref(q).to(dtype).double()
    x = torch.randn(M, K).to(dtype).requires_grad_(True)
    y = nf4_linear(x, q)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.double(), x.detach().double() @ wd.T, rtol=rtol, atol=atol * K**0.5)
    dy = torch.randn(M, N).to(dtype)
    y.backward(dy)
    torch.testing.assert_close(x.grad.double(), dy.double() @ wd, rtol=rtol, atol=atol * N**0.5)


def test_triton_matches_native_on_3d_input_with_bias(triton_kernels, monkeypatch):
    q = quantize_nf4(_weight((40, 96), seed=3))
    x = torch.randn(2, 5, 96)
    b = torch.randn(40)
    got = nf4_linear(x, q, b)
    monkeypatch.setenv("ARENO_KERNELS", "native")
    torch.testing.assert_close(got, nf4_linear(x, q, b), rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="last dim"):
        nf4_linear(torch.randn(3, 95), q)


def test_no_weight_gradient():
    q = quantize_nf4(_weight((16, 64)))
    x = torch.randn(3, 64, requires_grad=True)
    nf4_linear(x, q).sum().backward()  # native: autograd through the dequantised (constant) weight
    assert x.grad is not None and not q.packed.requires_grad


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 33, 64, 127, 512])
def test_triton_bf16_at_4096_against_native(M):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, 4096, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    q = quantize_nf4(w)
    x = torch.randn(M, 4096, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True)
    y = Nf4LinearFunction.apply(x, q.packed, q.qabs, q.absmax2, q.offset, q.shape)
    wd = dequantize_nf4(q, torch.bfloat16)
    ref = (x.detach().float() @ wd.float().T)
    torch.testing.assert_close(y.float(), ref, rtol=1.6e-2, atol=1e-2)
    dy = torch.randn_like(y)
    y.backward(dy)
    torch.testing.assert_close(x.grad.float(), dy.float() @ wd.float(), rtol=1.6e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["fused", "planes"])
@pytest.mark.parametrize("M", [1, 8, 32, 100])
def test_fused_gemms_bf16_on_the_gpu(M, path):
    g = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(5120, 4096, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    q = quantize_nf4(w)
    x = torch.randn(M, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    ref = x.float() @ dequantize_nf4(q, torch.bfloat16).float().T
    torch.testing.assert_close(nf4.nf4_matmul(x, q, _path=path).float(), ref, rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 8, 9])
def test_auto_path_under_cuda_graph_equals_eager(M):
    # "auto" takes the fused GEMM up to FUSED_MAX_ROWS rows (split-K partials in a graph-pool buffer): a replay
    # gives the eager call's bits, and both match the dequantised weight's product
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(5120, 2048, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    q = quantize_nf4(w)
    x = torch.randn(M, 2048, device="cuda", generator=g, dtype=torch.bfloat16)
    eager = nf4.nf4_matmul(x, q)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nf4.nf4_matmul(x, q)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    ref = x.float() @ dequantize_nf4(q, torch.bfloat16).float().T
    torch.testing.assert_close(out.float(), ref, rtol=1.6e-2, atol=1e-2)


_COMPILE_SM90 = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from areno.kernels import nf4
sig = {"a_ptr": "*bf16", "q_ptr": "*u8", "qabs_ptr": "*u8", "abs2_ptr": "*fp32", "off_ptr": "*fp32",
       "code_ptr": "*fp32", "code2_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
       "stride_am": "i32", "stride_om": "i32", "stride_os": "i32", "STEPS": "i32", "DOT_PREC": "constexpr",
       "BLOCKSIZE2": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCKS": "constexpr"}
bm, bn, blocks, warps, stages = 16, 64, 2, 4, 1  # fused_config's decode tile on a GPU
consts = {"DOT_PREC": "tf32", "BLOCKSIZE2": nf4.BLOCKSIZE2, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCKS": blocks}
try:
    k = triton.compile(ASTSource(fn=nf4._nf4_matmul_kernel, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
except Exception as e:  # no CUDA backend / ptxas in this Triton
    print(json.dumps({"skip": f"{type(e).__name__}: {e}"[:300]}))
    sys.exit(0)
print(json.dumps({"shared": k.metadata.shared, "staged": "async_copy_global_to_local" in k.asm["ttgir"]}))
"""


def test_fused_gemm_compiles_for_hopper_without_staged_lookups():
    # compiled for sm_90 here (Triton's bundled ptxas, no GPU; a fresh process: the interpreter patches triton.language
    # in this one): at one pipeline stage the code-table lookups stay ordinary loads; with the pipeliner on they were
    # staged through shared memory as 4-byte async copies (143 KB a program at 16 x 64 x 4 blocks: one program an SM,
    # 2-19x slower than dequantise + cuBLAS on an H100)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(f"cannot compile for sm_90 here: {got['skip']}")
    assert not got["staged"] and got["shared"] <= 32 * 1024, got

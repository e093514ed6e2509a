"""The Gluon attention kernels (``attention(_fwd="gluon", _bwd="gluon")``, the sm_90 defaults; ``gluon.py``).

Gluon has no interpreter: on the CPU every candidate is compiled for sm_90 (PTX and ptxas, no GPU) and its PTX
checked for the structure the kernel exists for; on the GPU each candidate is compared with float64 over odd varlen
shapes (``test_attention._gpu_errors``), and the dispatcher's fallback is checked where the kernel does not apply.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from areno.kernels.attention import gluon as attention_gluon
from areno.kernels.attention import packed as attention_module

LISTS = {"fwd": attention_gluon.CONFIGS, "bwd": attention_gluon.BWD_CONFIGS}
needs_gluon = pytest.mark.skipif(not attention_gluon.available(), reason="this triton has no Gluon Hopper language")


# Compiled in a child process: under TRITON_INTERPRET=1 (the CPU suite) Gluon's own library functions (gl.max, gl.sum)
# are interpreter objects its compiler refuses.
_COMPILE = """
import json, re, sys
from areno.kernels.attention import gluon as g
out = {}
for kind, d, i, causal, dtype in json.loads(sys.argv[1]):
    cfg = {"bwd": g.BWD_CONFIGS, "fwd": g.CONFIGS}[kind][d][i]
    ptx = g.compile_sm90(cfg, head_dim=d, causal=causal, dtype=dtype, kind=kind).asm["ptx"]
    out[f"{kind}/{d}/{i}/{causal}/{dtype}"] = {
        "mma": sorted(set(re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n\\d+k16\\.f32\\.(\\w+)\\.", ptx))),
        "wait1": ptx.count("wgmma.wait_group.sync.aligned 1;"),
        "loads": ptx.count("cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes"),
        "store": ptx.count("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group"),
        "reduce": ptx.count("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.bulk_group"),
        "waits": ptx.count("mbarrier.try_wait.parity"),
        "setmaxnreg": ptx.count("setmaxnreg"),
        "cta_barriers": len(re.findall(r"bar\\.sync\\s+0;|barrier\\.sync\\s+0;", ptx)),
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    jobs = [(kind, 128, i, c, "bf16") for kind, lists in LISTS.items() for i in range(len(lists[128]))
            for c in (True, False)]
    jobs += [("fwd", 64, 0, True, "bf16"), ("fwd", 256, 0, True, "bf16"), ("fwd", 128, 0, True, "fp16"),
             ("bwd", 128, 0, True, "fp16")]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(jobs)], env=env, cwd=root, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@needs_gluon
def test_every_candidate_compiles_for_sm90_with_the_pipelined_loop(compiled):
    """Each candidate compiles for sm_90 without a GPU (PTX and ptxas), and its PTX holds the kernel's asynchronous
    structure: Q and the K/V ring by TMA, the scores and the previous block's P V issued as wgmma groups before
    waiting for the scores alone (``wgmma.wait_group 1``), O by TMA store; the warp-specialized candidates also
    move registers between partitions (``setmaxnreg``) and synchronise without CTA-wide barriers."""
    assert len(compiled) == 2 * sum(len(lists[128]) for lists in LISTS.values()) + 4
    for key, info in compiled.items():
        kind, d, i, _, dtype = key.split("/")
        cfg = LISTS[kind][int(d)][int(i)]
        assert info["mma"] == [{"bf16": "bf16", "fp16": "f16"}[dtype]], (key, info)
        assert info["wait1"] >= 1, (key, "S_j and P_{j-1} V_{j-1} are not overlapped")
        assert info["store"] >= 1 and info["waits"] >= 3, (key, info)
        if "CONSUMER_REGS" in cfg.kwargs:  # warp-specialized: registers moved to the consumers, no CTA-wide barrier
            # the load warp's tiles: Q halves, then K and V (fwd); K and V halves, then Q, dO, LSE and delta (bwd),
            # whose dQ partials leave by TMA reduce
            assert info["loads"] >= (4 if kind == "fwd" else 8), (key, info)
            assert info["setmaxnreg"] >= 2 and info["cta_barriers"] == 0, (key, info)
            assert (info["reduce"] >= 1) == (kind == "bwd"), (key, info)
        else:
            assert info["loads"] >= 3 + 2 * cfg.kwargs["STAGES"], (key, info)  # Q, the K/V ring, the refills


def test_applies_names_why_not():
    q = torch.zeros(8, 2, 128)
    reason = attention_gluon.applies(q, q, q)
    assert reason is not None and ("sm_90" in reason or "Gluon" in reason), reason


def test_gluon_variants_fall_back_to_tma_where_they_do_not_apply(monkeypatch):
    """_fwd="gluon" / _bwd="gluon" are accepted everywhere; off an sm_90 GPU (here: the CPU) they run the TMA kernels
    (or the pointer ones where TMA does not apply either), with the same results."""
    assert "gluon" in attention_module.FWD_VARIANTS and "gluon" in attention_module.BWD_VARIANTS
    assert (attention_module.forward_variant("gluon"), attention_module.backward_variant("gluon")) == ("gluon", "gluon")
    called = []
    monkeypatch.setattr(attention_gluon, "forward", lambda *a, **k: called.append("fwd"))
    monkeypatch.setattr(attention_gluon, "backward", lambda *a, **k: called.append("bwd"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 16, generator=g, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = attention_module.attention(q, k, v, cu, cu, 7, 7, causal=True, _fwd="gluon", _bwd="gluon")
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = attention_module.attention_reference(q, k, v, cu, cu, causal=True)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert not called


# ----------------------------------------------------------------------------------------------------------------
# GPU: every candidate against float64 (bf16 judged against SDPA's own bf16 error), odd varlen shapes.

GPU_SHAPES = {
    "train": ([1024] * 4, [1024] * 4, 16, 8, True),
    "varlen_odd": ([1, 700, 129, 2048, 77], [1, 700, 129, 2048, 77], 8, 2, True),
    "chunked_gqa4": ([1, 17, 300, 1000], [513, 17, 1800, 4000], 8, 2, True),
    "q_longer_than_k": ([300, 64], [100, 64], 4, 4, True),  # rows that see no key: O = 0
    "non_causal": ([100, 1500], [700, 1500], 16, 16, False),
}


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("kind,d,i", [(kind, d, i) for kind, lists in LISTS.items() for d, c in lists.items()
                                      for i in range(len(c))])
def test_gpu_every_candidate_matches_float64(kind, d, i, monkeypatch):
    """_fwd="gluon" (forward candidates) / _bwd="gluon" (single-pass backward candidates), one pinned."""
    from tests.kernels.test_attention import _gpu_errors

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are sm_90 only")
    fwd, bwd = ("gluon", "tma_merged") if kind == "fwd" else ("tma", "gluon")
    monkeypatch.setattr(attention_gluon, "FORCE_CONFIG", {kind: LISTS[kind][d][i]})
    calls = []
    name = {"fwd": "forward", "bwd": "backward"}[kind]
    real = getattr(attention_gluon, name)
    monkeypatch.setattr(attention_gluon, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    for shape, (lq, lk, hq, hkv, causal) in GPU_SHAPES.items():
        _gpu_errors(lq, lk, hq, hkv, d, causal, fwd=fwd, bwd=bwd)
        assert calls, f"{shape}: the Gluon {kind} kernel did not run"
        calls.clear()


@pytest.mark.gpu
@needs_gluon
def test_gpu_autotuned_and_fp16():
    from tests.kernels.test_attention import make_inputs, reference, run

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are sm_90 only")
    lq = lk = [1, 300, 1000, 77]
    inputs = make_inputs(lq, lk, 8, 2, 128, torch.float16, 0, device="cuda")
    got = run(*inputs, lq, lk, True, "triton", fwd="gluon", bwd="gluon")
    want = reference(*inputs, True)
    for name, g, w in zip("o dq dk dv".split(), got, want):
        assert (g.double() - w).abs().max().item() <= 2e-2 * max(w.abs().max().item(), 1.0), name

"""AdamW with 8-bit moments (``--optimizer-states 8bit``): blockwise dynamic quantisation of exp_avg / exp_avg_sq.

The moments live as one byte per element plus one fp32 absolute maximum per block of ``QBLOCK`` = 256 elements
(2.03 bytes per element for both moments, against 8 in fp32). A byte is an index into a 256-entry code book of
values in [-1, 1]: the *dynamic* map of Dettmers et al. (8-bit optimizers via block-wise quantization, 2022;
bitsandbytes' ``create_dynamic_map``), a floating-point-like code whose exponent runs over 7 decades (1e-6 .. 1) and
whose fraction gets the bits the exponent leaves, so small values keep their relative precision:

    signed map (exp_avg):      for decade i = 0..6, the 2^i midpoints of ``linspace(0.1, 1, 2^i + 1)`` times
                               10^(i - 6), with both signs; plus 0 and 1 (256 values)
    unsigned map (exp_avg_sq): for decade i = 0..6, the 2^(i+1) midpoints of ``linspace(0.1, 1, 2^(i+1) + 1)`` times
                               10^(i - 6); plus 0 and 1 (256 values)

Quantising a block: ``absmax = max |x|`` over the block, each ``x / absmax`` (0 where ``absmax`` is 0) rounded to the
nearest code (ties to the lower one); dequantising: ``code_value * absmax``. One step per element, in one kernel
(a program per ``TILE["rows"]`` blocks, a [rows, 256] tile): dequantise ``m`` and ``v``, the AdamW update of
``areno.kernels.adamw`` (``adamw_math``) on the fp32 master ``w`` with the fp32 moments, then requantise the new
moments with the block's new absmax. The master stays fp32 (updated in place); the caller rounds it into the
parameter, as for the fp32 states.

The scalars follow ``master_adamw_``: ``lr``, ``step_size``, ``bc2_sqrt`` (``bias_corrections``), ``scale`` (the
gradient's divisor) and ``skip`` (1 leaves everything as it is) are 0-dim fp32 tensors on the device.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from areno.kernels.adamw import adamw_math, bias_corrections
from areno.kernels.dispatch import interpreting, use_triton

QBLOCK = 256  # elements per absmax block (bitsandbytes' block for 8-bit optimizers)
# The GPU tile: absmax blocks a program updates and its warps (one block a program was 17 M programs a step at a
# 4.4B-parameter shape). Compiled for sm_90a (Triton 3.7.1, bench/kernel_resources.py --kernels adamw8bit) this
# 8 x 256 tile on 8 warps keeps 214 registers a thread: one program resident an SM (8 of its 64 warps) for a kernel
# whose moments go through dependent gathers of the code books; 4 x 256 on 16 warps keeps 61 (32 warps), 2 x 256 on
# 8 warps 48 (40). bench/optimizer_8bit.py --parts kernel --tiles on the H100 (12-07, 596M elements): 8x8 14.8 ms
# (0.19 of HBM), 4x16 10.6, 2x8 9.7, 2x4 7.9, 1x8 8.0, 1x4 7.3, 1x2 6.7 (0.41), 1x1 8.7. Rows and warps: powers of
# two.
TILE = {"rows": 1, "num_warps": 2}


def rows_per_program() -> int:
    """Absmax blocks a program of the kernel updates: ``TILE["rows"]``, 2 interpreted (tiny shapes span several
    programs, the last one part-masked)."""
    return 2 if interpreting() else TILE["rows"]


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted fp32 values of the dynamic quantisation map (see the module docstring), computed in float64."""
    values = [0.0, 1.0]
    for i in range(7):
        k = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, k + 1, dtype=torch.float64)
        mids = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        values += mids + ([-x for x in mids] if signed else [])
    assert len(values) == 256 and len(set(values)) == 256
    return torch.tensor(sorted(values), dtype=torch.float64).float()


@functools.lru_cache(maxsize=8)
def code_books(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(signed map, unsigned map)`` on ``device`` (cached)."""
    return dynamic_map(True).to(device), dynamic_map(False).to(device)


def n_blocks(n: int) -> int:
    """Absmax entries for ``n`` elements."""
    return -(-n // QBLOCK)


# ---- Triton ----------------------------------------------------------------------------------------------------
@triton.jit
def _quantise(x, QMAP, SIGNED: tl.constexpr):
    """``x`` ([rows, QBLOCK] blocks) to the nearest codes of the map at ``QMAP`` (ties to the lower code), and each
    block's absmax. ``lo``, the last code <= xn (code 0 below the map), is found from the map's layout, not by a
    binary search (eight dependent gathers an element): |xn| in decade i = e + 7 (|xn| in [10^e, 10^(e+1)), e in
    -7..-1) lies among that decade's ``per`` evenly spaced codes (2^i signed, 2^(i+1) unsigned; ``base`` codes in the
    decades below it), at position t = (|xn| 10^(-e-1) - 0.1) per / 0.9 - 0.5; its index, from the zero code (127
    signed, 0 unsigned) up or, negative, down, is within one of ``lo`` (its floor moves by one only where t is next
    to a whole number: at a code, or past a decade's edge where the next decade's formula gives the same index; the
    GPU's approximate log2/exp2 move t by ~1e-5), so three comparisons with the codes around it give ``lo`` exactly
    and the same codes as the search (tests/kernels/test_adamw8bit.py: every code, midpoint and fp32 neighbour)."""
    absmax = tl.max(tl.abs(x), axis=1)
    xn = tl.where(absmax[:, None] > 0, tl.div_rn(x, tl.where(absmax > 0, absmax, 1.0)[:, None]), 0.0)
    a = tl.abs(xn)
    e = tl.minimum(tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30)) * 0.30102999566398120), -7.0), -1.0)
    per = tl.exp2(e + (7.0 if SIGNED else 8.0))
    t = (a * tl.exp2((-e - 1.0) * 3.3219280948873623) - 0.1) * per / 0.9 - 0.5
    r = (per - (1.0 if SIGNED else 2.0) + tl.floor(t) + 1.0).to(tl.int32)  # positive codes <= |xn|, +-1
    if SIGNED:
        c = tl.where(xn >= 0, 127 + r, 126 - r)
    else:
        c = r
    c = tl.minimum(tl.maximum(c, 1), 254)
    q0, q1 = tl.load(QMAP + c - 1), tl.load(QMAP + c)
    q2, q3 = tl.load(QMAP + c + 1), tl.load(QMAP + tl.minimum(c + 2, 255))
    up1, up2 = xn >= q1, xn >= q2
    lo = c - 1 + up1.to(tl.int32) + up2.to(tl.int32)
    q_lo = tl.where(up2, q2, tl.where(up1, q1, q0))
    hi = tl.minimum(lo + 1, 255)
    q_hi = tl.where(hi == c, q1, tl.where(hi == c + 1, q2, q3))
    code = tl.where(q_hi - xn < xn - q_lo, hi, lo)
    return code.to(tl.uint8), absmax


@triton.jit
def adamw8bit_kernel(
    W, G, MQ, VQ, MA, VA, SMAP, UMAP, n, LR, STEP_SIZE, BC2_SQRT, SCALE, SKIP, beta1, beta2, eps, weight_decay,
    HAS_GRAD: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """ROWS absmax blocks of BLOCK elements a program, as a [ROWS, BLOCK] tile."""
    if tl.load(SKIP) == 0.0:
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = offs < n
        rmask = rows * BLOCK < n
        w = tl.load(W + offs, mask=mask, other=0.0)
        ma, va = tl.load(MA + rows, mask=rmask)[:, None], tl.load(VA + rows, mask=rmask)[:, None]
        m = tl.load(SMAP + tl.load(MQ + offs, mask=mask, other=0).to(tl.int32)) * ma
        v = tl.load(UMAP + tl.load(VQ + offs, mask=mask, other=0).to(tl.int32)) * va
        if HAS_GRAD:
            g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(SCALE)
        else:
            g = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        w, m, v = adamw_math(w, m, v, g, tl.load(LR), tl.load(STEP_SIZE), tl.load(BC2_SQRT), beta1, beta2, eps,
                              weight_decay)
        mq, ma = _quantise(tl.where(mask, m, 0.0), SMAP, True)
        vq, va = _quantise(tl.where(mask, v, 0.0), UMAP, False)
        tl.store(W + offs, w, mask=mask)
        tl.store(MQ + offs, mq, mask=mask)
        tl.store(VQ + offs, vq, mask=mask)
        tl.store(MA + rows, ma, mask=rmask)
        tl.store(VA + rows, va, mask=rmask)


# ---- native reference ------------------------------------------------------------------------------------------
def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` zero-padded to whole blocks, as [blocks, QBLOCK]."""
    pad = n_blocks(x.numel()) * QBLOCK - x.numel()
    return torch.nn.functional.pad(x, (0, pad)).view(-1, QBLOCK)


def quantise_native(x: torch.Tensor, qmap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8 [n], absmax fp32 [blocks])`` of the flat fp32 ``x`` on ``qmap`` (the kernel's rounding)."""
    xb = _blocks(x)
    absmax = xb.abs().amax(dim=1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    xn = torch.where(absmax[:, None] > 0, xb / safe, torch.zeros_like(xb)).reshape(-1)[: x.numel()]
    lo = (torch.searchsorted(qmap, xn, right=True) - 1).clamp(0, 255)
    hi = (lo + 1).clamp(max=255)
    code = torch.where(qmap[hi] - xn < xn - qmap[lo], hi, lo)
    return code.to(torch.uint8), absmax


def dequantise_native(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """The fp32 values of ``codes`` (flat) with their blocks' ``absmax``."""
    return qmap[codes.long()] * absmax.repeat_interleave(QBLOCK)[: codes.numel()]


def adamw8bit_native(w, grad, mq, vq, ma, va, lr, step_size, bc2_sqrt, scale, skip, *, beta1, beta2, eps,
                     weight_decay) -> None:
    """Plain PyTorch reference of the kernel (the test oracle), in place, without a host sync."""
    smap, umap = code_books(w.device)
    g = torch.zeros_like(w) if grad is None else grad.reshape(-1).to(w.dtype) / scale
    m, v = dequantise_native(mq, ma, smap), dequantise_native(vq, va, umap)
    w1 = w * (1.0 - lr * weight_decay)
    m1 = m + (g - m) * (1.0 - beta1)
    v1 = v * beta2 + (1.0 - beta2) * g * g
    w1 = w1 - step_size * (m1 / (v1.sqrt() / bc2_sqrt + eps))
    (mq1, ma1), (vq1, va1) = quantise_native(m1, smap), quantise_native(v1, umap)
    keep = skip != 0
    for old, new in ((w, w1), (mq, mq1), (vq, vq1), (ma, ma1), (va, va1)):
        old.copy_(torch.where(keep, old, new))


def adamw8bit_(w, grad, mq, vq, ma, va, lr, step_size, bc2_sqrt, scale, skip, *, beta1, beta2, eps,
               weight_decay) -> None:
    """One AdamW step on the flat fp32 master ``w`` (in place) with the 8-bit moments ``mq``, ``vq`` (uint8, as
    many elements) and their block absmax ``ma``, ``va`` (fp32, ``n_blocks(n)``), all updated in place, from
    ``grad`` (flat, any float dtype, or None: zero). Triton on CUDA (and interpreted), the native reference
    elsewhere."""
    n = w.numel()
    ok = (w.dtype == torch.float32 and w.is_contiguous() and mq.dtype == vq.dtype == torch.uint8
          and mq.numel() == vq.numel() == n and ma.numel() == va.numel() == n_blocks(n)
          and all(t.is_contiguous() for t in (mq, vq, ma, va)) and (grad is None or grad.numel() == n))
    if not ok:
        raise ValueError("adamw8bit_: w fp32 [n], mq/vq uint8 [n], ma/va fp32 [ceil(n / 256)], grad [n] or None")
    if n == 0:
        return
    grad = None if grad is None else grad.contiguous()
    scalars = (lr, step_size, bc2_sqrt, scale, skip)
    hp = dict(beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if not use_triton(w, mq, vq, ma, va, *scalars):
        adamw8bit_native(w, grad, mq, vq, ma, va, *scalars, **hp)
        return
    smap, umap = code_books(w.device)
    rows = rows_per_program()
    adamw8bit_kernel[(triton.cdiv(n_blocks(n), rows),)](
        w, grad if grad is not None else w, mq, vq, ma, va, smap, umap, n, *scalars, beta1, beta2, eps, weight_decay,
        HAS_GRAD=grad is not None, BLOCK=QBLOCK, ROWS=rows, num_warps=4 if interpreting() else TILE["num_warps"],
    )  # fmt: skip


@functools.lru_cache(maxsize=4)
def _step_scalars(lr: float, step: int, beta1: float, beta2: float, divisor: float, device: torch.device) -> tuple:
    """The device scalars of one step (lr, step size, bias correction, the clip divisor, no skip), made once per step
    and learning rate and shared by every bucket: made per bucket they cost host-to-device copies and a few tiny
    kernels each, ~575 times a step for a 9B-shaped model's 25 MiB buckets."""
    lr_t = torch.tensor(lr, dtype=torch.float32, device=device)
    step_size, bc2_sqrt = bias_corrections(lr_t, torch.tensor(float(step), device=device), beta1, beta2)
    scale = torch.tensor(divisor, dtype=torch.float32, device=device)
    return lr_t, step_size, bc2_sqrt, scale, torch.zeros((), device=device)


class Moments8bit:
    """The 8-bit ``exp_avg`` and ``exp_avg_sq`` of a flat fp32 slice of ``n`` elements (what ``MasterAdamW`` keeps
    per bucket shard under ``--optimizer-states 8bit``): ``codes`` [2, n] uint8 and ``absmax`` [2, n_blocks(n)]
    fp32; all zeros is both moments 0."""

    def __init__(self, n: int, device):
        self.codes = torch.zeros(2, n, dtype=torch.uint8, device=device)
        self.absmax = torch.zeros(2, n_blocks(n), dtype=torch.float32, device=device)

    @classmethod
    def of(cls, codes: torch.Tensor, absmax: torch.Tensor) -> Moments8bit:
        """Moments held in given tensors (``codes`` [2, n] uint8, ``absmax`` [2, n_blocks(n)] fp32, each row
        contiguous): views of a larger buffer shared by several slices (areno.training.optimizer_fused)."""
        m = cls.__new__(cls)
        m.codes, m.absmax = codes, absmax
        return m

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.absmax.nbytes

    def step_(self, w: torch.Tensor, grad: torch.Tensor | None, *, lr: float, step: int, beta1: float, beta2: float,
              eps: float, weight_decay: float, divisor: float = 1.0) -> None:
        """One AdamW step of the fp32 master ``w`` (in place) at the host rate ``lr`` and step count ``step``
        (after this step's increment); ``grad`` (any float dtype) is divided by ``divisor`` (the clip) in the kernel."""
        lr_t, step_size, bc2_sqrt, scale, zero = _step_scalars(float(lr), int(step), beta1, beta2, float(divisor),
                                                               w.device)
        (mq, vq), (ma, va) = self.codes.unbind(0), self.absmax.unbind(0)
        adamw8bit_(w, grad, mq, vq, ma, va, lr_t, step_size, bc2_sqrt, scale, zero, beta1=beta1, beta2=beta2, eps=eps,
                   weight_decay=weight_decay)

    def state(self) -> dict:
        """The saved form: ``exp_avg`` / ``exp_avg_sq`` codes and their ``*_absmax`` (views of the live state)."""
        return {"exp_avg": self.codes[0], "exp_avg_sq": self.codes[1], "exp_avg_absmax": self.absmax[0],
                "exp_avg_sq_absmax": self.absmax[1]}

    def load_(self, state: dict) -> None:
        """Restore ``state()``'s tensors (exactly: codes and absmax are copied, not requantised)."""
        for i, key in enumerate(("exp_avg", "exp_avg_sq")):
            code, absmax = state[key], state[f"{key}_absmax"]
            if code.dtype != torch.uint8 or code.shape != self.codes[i].shape or absmax.shape != self.absmax[i].shape:
                raise ValueError(f"8-bit optimizer state {key}: saved {tuple(code.shape)} {code.dtype}, this "
                                 f"optimizer has {tuple(self.codes[i].shape)} uint8")
            self.codes[i].copy_(code)
            self.absmax[i].copy_(absmax)

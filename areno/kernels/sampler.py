"""Token sampling for decode: per-row temperature, min-p, top-k, top-p and seed; sync-free, fixed shapes,
graph-capturable.

    z        = logits / T                      (T <= 0: greedy, z = logits)
    token    = argmax_j  z_j + G_j  over the kept set,   G_j = -log(-log U_j)  (Gumbel-max: token ~ softmax(z))
    logprob  = z[token] - logsumexp(z)         over the whole vocabulary, before top-k/top-p (T <= 0 counts as T = 1),
                                                the definition ``linear_logprobs`` uses at the same temperature.

Noise: U_j is a counter-based hash, Philox4x32-10 keyed by the row's 64-bit seed with counter (j // 4, offset
lo, offset hi, 0), word j % 4; the offset is typically the decode position, so every step draws fresh noise and
the same (seed, offset) gives the same token. The native path computes the same bits with int64 torch ops.
Kept set: tokens with z >= a per-row threshold: the largest value whose count (top-k) still reaches k; min-p keeps
z >= max z + log(min_p) (probability >= min_p * the largest probability, after temperature, as vLLM applies it);
the two cuts intersect, and top-p then keeps the smallest top of that set whose probability mass relative to it
reaches p (Hugging Face's order); ties at the threshold are all kept. The threshold is found without sorting: a
bisection over the order-preserving int32 key of fp32, 16 pivots per pass over the row, 8 passes. top_k <= 0 or
>= V, min_p <= 0 and top_p >= 1 switch a row's filter off.
Kernels: [threshold] -> race (grid rows x vocab splits: online logsumexp + best score) -> pick (merge the splits).
Traffic: the logits are read once (plus ~20 passes per row for rows with top-k/top-p); no host sync anywhere.

Penalties, logit bias and the min_tokens ban (``areno.kernels.penalties``) rewrite the logits before this step, so
the returned logprob is that of the distribution the token was actually drawn from: the adjusted, tempered logits,
before min-p/top-k/top-p. For RL this is the behaviour policy's log-prob; the trainer's log-probs are of the plain
model at the same temperature, so the rollout/trainer difference (and truncated importance sampling) then measures
and corrects the adjustment as off-policy sampling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from areno.kernels._device import sm_count
from areno.kernels.dispatch import interpreting, use_triton

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_M32 = 0xFFFFFFFF
_PHILOX = (0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85)  # round multipliers A, B and key increments
_NPIV = 16  # pivots per bisection pass: the int32 key range shrinks 17x per pass
_NPASS = 8  # 17^8 > 2^32
_KEY_MIN = -(2**31)

# ---------------------------------------------------------------------------------------------- Triton kernels


@triton.jit
def _key(z):
    """Order-preserving int32 key of fp32 values (negative floats have their magnitude bits flipped)."""
    b = z.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _log(x, FAST: tl.constexpr):
    """Natural log; FAST (CUDA): the hardware lg2.approx (rel. error ~2^-22), 3 instructions instead of ~35."""
    if FAST:
        y = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
        return y * 0.6931471805599453
    else:
        return tl.log(x)


@triton.jit
def _gumbel(bits, FAST: tl.constexpr):
    """-log(E), E = -log(1 - v) ~ Exp(1), v in (0, 1) from 32 random bits; a series keeps E exact near 0."""
    v = tl.minimum((bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 0.99999994)
    e = tl.where(v < 0.0078125, v * (1.0 + v * (0.5 + v * (0.33333334 + v * 0.25))), -_log(1.0 - v, FAST))
    return -_log(e, FAST)


# Row counts (B) and split counts (S) vary from step to step in a server's eager steps: they are not specialised
# (each new specialisation is a JIT compile in the middle of serving).
@triton.jit(do_not_specialize=["B"])
def _race_kernel(x_ptr, stride_x, temp_ptr, seed_ptr, off_ptr, thr_ptr, m_ptr, s_ptr, best_ptr, idx_ptr,
                 B, V, cols_per_split, HAS_THR: tl.constexpr, ROWS: tl.constexpr, Q: tl.constexpr,
                 FAST: tl.constexpr):  # fmt: skip
    # One program: ROWS rows x one vocab split, in tiles of 4Q columns (Q Philox calls of 4 words each).
    pid_s = tl.program_id(1)
    splits = tl.num_programs(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    temp = tl.load(temp_ptr + rows, mask=row_ok, other=1.0)
    greedy = temp <= 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    seed = tl.broadcast_to(tl.load(seed_ptr + rows, mask=row_ok, other=0)[:, None], (ROWS, Q))
    off = tl.load(off_ptr + rows, mask=row_ok, other=0)
    c1 = tl.broadcast_to(off.to(tl.uint32)[:, None], (ROWS, Q))
    c2 = tl.broadcast_to((off >> 32).to(tl.uint32)[:, None], (ROWS, Q))
    c3 = tl.zeros((ROWS, Q), dtype=tl.uint32)
    if HAS_THR:
        thr = tl.load(thr_ptr + rows, mask=row_ok, other=0)
    x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    v_begin = pid_s * cols_per_split
    v_end = tl.minimum(v_begin + cols_per_split, V)
    # Per-lane running state, reduced across lanes once at the end (no reductions inside the loop).
    m_vec = tl.full([ROWS, 4 * Q], -1e30, dtype=tl.float32)
    s_vec = tl.zeros([ROWS, 4 * Q], dtype=tl.float32)
    best_vec = tl.full([ROWS, 4 * Q], float("-inf"), dtype=tl.float32)
    idx_vec = tl.zeros([ROWS, 4 * Q], dtype=tl.int32)
    for v0 in range(v_begin, v_end, 4 * Q):
        c0 = tl.broadcast_to((v0 // 4 + tl.arange(0, Q)).to(tl.uint32)[None, :], (ROWS, Q))
        r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
        bits = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))  # column 4q + w <- word w of counter q
        cols = v0 + tl.arange(0, 4 * Q)
        ok = row_ok[:, None] & (cols < v_end)[None, :]
        z = tl.load(x_row + cols[None, :], mask=ok, other=0.0).to(tl.float32) * inv_t[:, None]
        z = tl.where(ok, z, float("-inf"))
        m_new = tl.maximum(m_vec, z)
        s_vec = s_vec * tl.exp(m_vec - m_new) + tl.exp(z - m_new)
        m_vec = m_new
        score = tl.where(greedy[:, None], z, z + _gumbel(bits, FAST))
        if HAS_THR:
            score = tl.where(_key(z) >= thr[:, None], score, float("-inf"))
        score = tl.where(ok, score, float("-inf"))
        better = score > best_vec  # strict: a lane keeps its first (lowest-index) maximum
        best_vec = tl.where(better, score, best_vec)
        idx_vec = tl.where(better, cols[None, :], idx_vec)
    m = tl.max(m_vec, axis=1)
    s = tl.sum(s_vec * tl.exp(m_vec - m[:, None]), axis=1)
    best = tl.max(best_vec, axis=1)
    best_idx = tl.min(tl.where(best_vec == best[:, None], idx_vec, 2147483647), axis=1)  # ties: lowest index
    out = rows * splits + pid_s
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(best_ptr + out, best, mask=row_ok)
    tl.store(idx_ptr + out, best_idx, mask=row_ok)


@triton.jit(do_not_specialize=["B", "S"])
def _pick_kernel(x_ptr, stride_x, temp_ptr, m_ptr, s_ptr, best_ptr, idx_ptr, tok_ptr, lp_ptr, B, S,
                 ROWS: tl.constexpr, SB: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    sp = tl.arange(0, SB)
    ok = row_ok[:, None] & (sp < S)[None, :]
    offs = rows[:, None] * S + sp[None, :]
    m = tl.load(m_ptr + offs, mask=ok, other=-1e30)
    s = tl.load(s_ptr + offs, mask=ok, other=0.0)
    best = tl.load(best_ptr + offs, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + offs, mask=ok, other=0)
    big = tl.max(m, axis=1)
    total = tl.sum(s * tl.exp(m - big[:, None]), axis=1)
    _, j = tl.max(best, axis=1, return_indices=True)
    tok = tl.sum(tl.where(sp[None, :] == j[:, None], idx, 0), axis=1)
    temp = tl.load(temp_ptr + rows, mask=row_ok, other=1.0)
    inv_t = 1.0 / tl.where(temp <= 0.0, 1.0, temp)
    x = tl.load(x_ptr + rows.to(tl.int64) * stride_x + tok, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(tok_ptr + rows, tok.to(tl.int64), mask=row_ok)
    tl.store(lp_ptr + rows, x * inv_t - big - tl.log(tl.maximum(total, 1e-30)), mask=row_ok)


@triton.jit
def _row_pass(x_ptr, stride_x, rows, row_ok, inv_t, m, thr, V, MODE: tl.constexpr, ROWS: tl.constexpr,
              BLOCK: tl.constexpr):  # fmt: skip
    """MODE 0: row max of z; MODE 1: sum of exp(z - m) over z with key >= thr."""
    if MODE == 0:
        acc = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    else:
        acc = tl.zeros([ROWS], dtype=tl.float32)
    x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        ok = row_ok[:, None] & (cols < V)[None, :]
        z = tl.load(x_row + cols[None, :], mask=ok, other=0.0).to(tl.float32) * inv_t[:, None]
        if MODE == 0:
            acc = tl.maximum(acc, tl.max(tl.where(ok, z, float("-inf")), axis=1))
        else:
            keep = ok & (_key(z) >= thr[:, None])
            acc += tl.sum(tl.where(keep, tl.exp(z - m[:, None]), 0.0), axis=1)
    return acc


@triton.jit
def _search(x_ptr, stride_x, rows, row_ok, inv_t, m, target, lo, V, USE_MASS: tl.constexpr, ROWS: tl.constexpr,
            BLOCK: tl.constexpr, NPIV: tl.constexpr, NPASS: tl.constexpr):  # fmt: skip
    """Largest int32 key t with f(t) >= target, f = count (or exp-mass) of z with key >= t; f(lo) >= target."""
    hi = tl.full([ROWS], 2147483648, dtype=tl.int64)  # f(hi) = 0 < target
    seg = (tl.arange(0, NPIV) + 1).to(tl.int64)
    x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    for _ in range(NPASS):
        piv = lo[:, None] + ((hi - lo)[:, None] * seg[None, :]) // (NPIV + 1)  # lo <= piv < hi: fits int32
        piv32 = piv.to(tl.int32)
        f = tl.zeros([ROWS, NPIV], dtype=tl.float32)
        for v0 in range(0, V, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            ok = row_ok[:, None] & (cols < V)[None, :]
            z = tl.load(x_row + cols[None, :], mask=ok, other=0.0).to(tl.float32) * inv_t[:, None]
            if USE_MASS:
                val = tl.where(ok, tl.exp(z - m[:, None]), 0.0)
            else:
                val = tl.where(ok, 1.0, 0.0)
            ge = _key(z)[:, :, None] >= piv32[:, None, :]
            f += tl.sum(tl.where(ge, val[:, :, None], 0.0), axis=1)
        good = f >= target[:, None]
        lo = tl.max(tl.where(good, piv, lo[:, None]), axis=1)
        hi = tl.min(tl.where(good, hi[:, None], piv), axis=1)
    return lo


@triton.jit(do_not_specialize=["B"])
def _threshold_kernel(x_ptr, stride_x, temp_ptr, k_ptr, p_ptr, lmp_ptr, thr_ptr, B, V, HAS_K: tl.constexpr,
                      HAS_P: tl.constexpr, HAS_MINP: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                      NPIV: tl.constexpr, NPASS: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < B
    temp = tl.load(temp_ptr + rows, mask=row_ok, other=1.0)
    inv_t = 1.0 / tl.where(temp <= 0.0, 1.0, temp)
    thr = tl.full([ROWS], -2147483648, dtype=tl.int64)
    if HAS_K:  # the search only runs when a row of this program asks for it
        k = tl.load(k_ptr + rows, mask=row_ok, other=0)
        k_on = row_ok & (k > 0) & (k < V)
        if tl.max(k_on.to(tl.int32), axis=0) > 0:
            tk = _search(x_ptr, stride_x, rows, row_ok, inv_t, inv_t, k.to(tl.float32), thr, V, False, ROWS, BLOCK,
                         NPIV, NPASS)  # fmt: skip
            thr = tl.where(k_on, tk, thr)
    if HAS_MINP:  # log(min_p) from the host (-inf: off), so both paths compare the same fp32 threshold
        lmp = tl.load(lmp_ptr + rows, mask=row_ok, other=float("-inf"))
        mp_on = row_ok & (lmp > float("-inf"))
        if tl.max(mp_on.to(tl.int32), axis=0) > 0:
            m = _row_pass(x_ptr, stride_x, rows, row_ok, inv_t, inv_t, thr, V, 0, ROWS, BLOCK)
            tm = _key(m + tl.where(mp_on, lmp, 0.0)).to(tl.int64)
            thr = tl.where(mp_on, tl.maximum(thr, tm), thr)
    if HAS_P:
        p = tl.load(p_ptr + rows, mask=row_ok, other=1.0)
        p_on = row_ok & (p < 1.0)
        if tl.max(p_on.to(tl.int32), axis=0) > 0:
            m = _row_pass(x_ptr, stride_x, rows, row_ok, inv_t, inv_t, thr, V, 0, ROWS, BLOCK)
            mass = _row_pass(x_ptr, stride_x, rows, row_ok, inv_t, m, thr, V, 1, ROWS, BLOCK)
            target = tl.maximum(p * mass, 1e-30)  # > 0: the row max always stays
            tp = _search(x_ptr, stride_x, rows, row_ok, inv_t, m, target, thr, V, True, ROWS, BLOCK, NPIV, NPASS)
            thr = tl.where(p_on, tp, thr)
    tl.store(thr_ptr + rows, thr.to(tl.int32), mask=row_ok)



def _triton_sample(logits, temperature, top_k, top_p, log_min_p, seeds, offsets):
    B, V = logits.shape
    dev = logits.device
    interp = interpreting() or not logits.is_cuda
    rows, q = (min(128, triton.next_power_of_2(B)), 16) if interp else (1, 256)
    thr = None
    if top_k is not None or top_p is not None or log_min_p is not None:
        thr = torch.empty(B, dtype=torch.int32, device=dev)
        t_rows, block = (rows, 64) if interp else (1, 1024)
        _threshold_kernel[(triton.cdiv(B, t_rows),)](
            logits, logits.stride(0), temperature, top_k if top_k is not None else seeds,
            top_p if top_p is not None else temperature, log_min_p if log_min_p is not None else temperature, thr,
            B, V, HAS_K=top_k is not None, HAS_P=top_p is not None, HAS_MINP=log_min_p is not None, ROWS=t_rows,
            BLOCK=block, NPIV=_NPIV, NPASS=_NPASS, num_warps=8)  # fmt: skip
    tile = 4 * q
    if interp:
        splits = 2 if V > 2 * tile else 1
    else:  # enough programs to fill the GPU about 4 times over
        splits = max(1, min(triton.cdiv(4 * sm_count(dev.index or 0), B), triton.cdiv(V, 4 * tile)))
    cols_per_split = triton.cdiv(triton.cdiv(V, splits), tile) * tile
    splits = triton.cdiv(V, cols_per_split)
    part = torch.empty(3, B, splits, dtype=torch.float32, device=dev)
    idx = torch.empty(B, splits, dtype=torch.int32, device=dev)
    _race_kernel[(triton.cdiv(B, rows), splits)](
        logits, logits.stride(0), temperature, seeds, offsets, thr if thr is not None else idx, part[0], part[1],
        part[2], idx, B, V, cols_per_split, HAS_THR=thr is not None, ROWS=rows, Q=q, FAST=not interp,
        num_warps=4)  # fmt: skip
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    logprobs = torch.empty(B, dtype=torch.float32, device=dev)
    if interp:
        p_rows, sb = min(64, triton.next_power_of_2(B)), triton.next_power_of_2(splits)
    else:  # one variant per vocabulary size: the widest split count any batch size gives
        sb = triton.next_power_of_2(triton.cdiv(V, 4 * tile))
        p_rows = max(1, min(64, 2048 // sb))
    _pick_kernel[(triton.cdiv(B, p_rows),)](
        logits, logits.stride(0), temperature, part[0], part[1], part[2], idx, tokens, logprobs, B, splits,
        ROWS=p_rows, SB=sb)  # fmt: skip
    return tokens, logprobs


# ------------------------------------------------------------------------------------------------ native path


def _mulhilo(a, mult):
    """(hi, lo) 32-bit halves of a * mult for uint32 values held in int64: the 64-bit product wraps in int64 (two's
    complement, as torch's integer arithmetic does), which keeps all 64 bits; the shift's sign bits are masked off."""
    p = a * mult
    return (p >> 32) & _M32, p & _M32


def philox_bits(seeds, offsets, vocab):
    """The sampler's random bits, [B, vocab] uint32 values in int64: Philox4x32-10 as ``tl.philox`` computes it."""
    mult_a, mult_b, key_a, key_b = _PHILOX
    k0 = (seeds & _M32)[:, None]
    k1 = ((seeds >> 32) & _M32)[:, None]
    c0 = torch.arange(triton.cdiv(vocab, 4), device=seeds.device, dtype=torch.int64)[None, :]
    c1 = (offsets & _M32)[:, None]
    c2 = ((offsets >> 32) & _M32)[:, None]
    c3 = torch.zeros_like(c1)
    for _ in range(10):
        hi_b, lo_b = _mulhilo(c2, mult_b)
        hi_a, lo_a = _mulhilo(c0, mult_a)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + key_a) & _M32
        k1 = (k1 + key_b) & _M32
    words = torch.broadcast_tensors(c0, c1, c2, c3)
    return torch.stack(words, dim=-1).reshape(seeds.shape[0], -1)[:, :vocab]


def _key_torch(z):
    b = z.view(torch.int32)
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b)


def _gumbel_torch(bits):
    v = ((bits.to(torch.float32) + 0.5) * 2.3283064365386963e-10).clamp(max=0.99999994)
    series = v * (1.0 + v * (0.5 + v * (0.33333334 + v * 0.25)))
    return -torch.log(torch.where(v < 0.0078125, series, -torch.log(1.0 - v)))


def _native_threshold(z, key, top_k, top_p, log_min_p=None):
    """Per-row int32-key threshold by sorting (same definition as the Triton bisection)."""
    B, V = z.shape
    skey, order = key.sort(dim=1, descending=True)
    thr = torch.full((B,), _KEY_MIN, dtype=torch.int64, device=z.device)
    if top_k is not None:
        k = top_k.to(torch.int64)
        tk = skey.gather(1, (k - 1).clamp(0, V - 1)[:, None])[:, 0].to(torch.int64)
        thr = torch.where((k > 0) & (k < V), tk, thr)
    if log_min_p is not None:
        on = log_min_p > float("-inf")
        tm = _key_torch(z.max(dim=1).values + torch.where(on, log_min_p, 0.0)).to(torch.int64)
        thr = torch.where(on, torch.maximum(thr, tm), thr)
    if top_p is not None:
        zs = z.gather(1, order)
        mass = torch.exp(zs - zs[:, :1]) * (skey >= thr[:, None])
        cum = mass.cumsum(dim=1)
        target = (top_p.float() * cum[:, -1]).clamp(min=1e-30)
        first = (cum < target[:, None]).sum(dim=1).clamp(max=V - 1)
        tp = skey.gather(1, first[:, None])[:, 0].to(torch.int64)
        thr = torch.where(top_p < 1.0, tp, thr)
    return thr


def _native_sample(logits, temperature, top_k, top_p, log_min_p, seeds, offsets):
    greedy = temperature <= 0
    inv_t = 1.0 / torch.where(greedy, torch.ones_like(temperature), temperature)
    z = logits.float() * inv_t[:, None]
    score = torch.where(greedy[:, None], z, z + _gumbel_torch(philox_bits(seeds, offsets, z.shape[1])))
    if top_k is not None or top_p is not None or log_min_p is not None:
        key = _key_torch(z)
        score = score.masked_fill(key < _native_threshold(z, key, top_k, top_p, log_min_p)[:, None], float("-inf"))
    tokens = score.argmax(dim=1)
    return tokens, z.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(z, dim=1)


# ------------------------------------------------------------------------------------------------ public API


def _per_row(value, B, dtype, device, name):
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        return torch.full((B,), value, dtype=dtype, device=device)
    if value.numel() not in (1, B):
        raise ValueError(f"sample: {name} must be a scalar or have one value per row ({B}), got {tuple(value.shape)}")
    return value.to(device=device, dtype=dtype).reshape(-1).expand(B).contiguous()


def _filters(logits, name, temperature, top_k, top_p, min_p):
    """Per-row tensors of the settings both public functions take; log(min_p) for min_p (0 -> -inf: off)."""
    if logits.dim() != 2:
        raise ValueError(f"{name}: logits must be [B, V], got {tuple(logits.shape)}")
    B, dev = logits.shape[0], logits.device
    min_p = _per_row(min_p, B, torch.float32, dev, "min_p")
    return (_per_row(temperature, B, torch.float32, dev, "temperature"), _per_row(top_k, B, torch.int32, dev, "top_k"),
            _per_row(top_p, B, torch.float32, dev, "top_p"), torch.log(min_p) if min_p is not None else None)


def sampling_probs(logits, *, temperature, top_k=None, top_p=None, min_p=None):
    """The distribution ``sample`` draws each row's token from, fp32 ``[B, V]`` (native, by sorting): softmax of
    the tempered logits over the kept set (min-p, top-k, top-p as in the module docstring); a greedy row
    (temperature <= 0) is one-hot at its argmax (lowest index among ties). Per-row arguments as ``sample``'s."""
    temperature, top_k, top_p, log_min_p = _filters(logits, "sampling_probs", temperature, top_k, top_p, min_p)
    greedy = temperature <= 0
    z = logits.float() * (1.0 / torch.where(greedy, torch.ones_like(temperature), temperature))[:, None]
    if top_k is not None or top_p is not None or log_min_p is not None:
        key = _key_torch(z)
        thr = _native_threshold(z, key, top_k, top_p, log_min_p)
        z = z.masked_fill(key < thr[:, None], float("-inf"))
    probs = torch.softmax(z, dim=1)
    one_hot = torch.zeros_like(probs).scatter_(1, z.argmax(dim=1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def logits_f32(hidden, weight):
    if hidden.dtype == torch.float32:
        return hidden @ weight.T
    if hidden.is_cuda:
        try:
            return torch.mm(hidden, weight.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return hidden.float() @ weight.float().T


def sample(logits=None, *, hidden=None, weight=None, temperature, seeds, offsets, top_k=None, top_p=None,
           min_p=None):
    """Sample one token per row; returns ``(tokens int64 [B], logprobs fp32 [B])`` (see the module docstring).

    Give ``logits [B, V]``, or ``hidden [B, H]`` and ``weight [V, H]`` (the LM head, applied with fp32 output).
    Per row (tensor ``[B]`` or a Python scalar for all rows): ``temperature`` (<= 0: greedy), ``seeds`` int64,
    ``offsets`` int64 (the decode position: fresh noise per step, same seed + offset -> same token), ``top_k``
    (<= 0 or >= V: off), ``top_p`` (>= 1: off), ``min_p`` in [0, 1] (0: off). ``None`` for all three skips the
    filter kernel entirely. The logprob is of the tempered distribution before min-p/top-k/top-p (T <= 0 uses
    T = 1), matching ``linear_logprobs(hidden, weight, tokens, temperature=T)`` on unadjusted logits.
    """
    if logits is None:
        if hidden is None or weight is None:
            raise ValueError("sample: pass logits, or hidden and weight")
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(f"sample: hidden [B, H] and weight [V, H], got {tuple(hidden.shape)}, "
                             f"{tuple(weight.shape)}")  # fmt: skip
        logits = logits_f32(hidden, weight)
    temperature, top_k, top_p, log_min_p = _filters(logits, "sample", temperature, top_k, top_p, min_p)
    B, dev = logits.shape[0], logits.device
    seeds = _per_row(seeds, B, torch.int64, dev, "seeds")
    offsets = _per_row(offsets, B, torch.int64, dev, "offsets")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if use_triton(logits, supported=logits.dtype in _FLOATS):
        return _triton_sample(logits, temperature, top_k, top_p, log_min_p, seeds, offsets)
    return _native_sample(logits, temperature, top_k, top_p, log_min_p, seeds, offsets)

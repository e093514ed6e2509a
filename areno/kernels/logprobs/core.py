"""The shared core of the LM-head log-prob kernels (``forward``: ``linear_logprobs``; ``loss``:
``linear_logprobs_loss``): the Triton statistics and logit-gradient kernels, their native twins, the merge of
partial statistics and the chunked recomputed backward.

    z        = hidden @ weight.T / T                      [N, V], never materialised whole
    logprob  = z[target] - logsumexp(z)                   (0 where target == -100)
    entropy  = -sum_j p_j log p_j,  p = softmax(z)

Statistics: one Triton program per (BLOCK_N tokens, vocab split) loops over [BLOCK_N x BLOCK_V] logit tiles, each a
tl.dot over the hidden dim with fp32 accumulation (as nested loops, or one flat loop so loads stay pipelined across
tiles; autotuned), and keeps an online max m, sum-exp s = sum e^(z-m) and entropy term a = sum e^(z-m) (z-m)
(rescaled as m grows: a' = e^(m-m') (a + (m-m') s)); the target logit is one gathered dot product per token.
Splits (and, with a TP group, ranks) merge the same way, so only max, sums and the target logit cross ranks.
lse = m + log s and entropy = log s - a / s.
Backward recomputes the logits chunk by chunk: for a [C tokens x Vc vocab] chunk a Triton GEMM with an epilogue
writes the logit gradient (bf16 on bf16 weights), then two cuBLAS GEMMs give dhidden += g @ W_c (fp32 accumulator,
beta = 1 in the GEMM) and dweight[chunk] = g^T @ hidden (written in place). Vocab chunks are evened out (default
2^28 elements: 16,384 tokens x 15,360 columns).
d/dz_j of the logprob is onehot_j - p_j; of the entropy -p_j (log p_j + entropy); both divided by T for d/dlogits.
Loads: on sm_90+ the logit tiles come through TMA tensor descriptors (fewer registers than masked pointer loads:
the 128 x 128 x 64 three-stage tile fits two programs per SM, 96 KB shared memory and <= 128 registers each, so one
program's epilogue overlaps the other's MMAs); masked pointer loads elsewhere. Variants: see ``options``.
FLOPs: 2 N V H forward, 6 N V H backward (recompute, dhidden, dweight); no [N, V] memory traffic in the forward.
"""


from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from areno.kernels._device import has_tma, sm_count
from areno.kernels.dispatch import autotune_candidates, interpreting, use_triton

GRAD_CHUNK_ELEMENTS = 1 << 28  # Triton path: default logit-gradient chunk (512 MB in bf16)
NATIVE_CHUNK_ELEMENTS = 1 << 24  # native path: fp32 logits chunk (64 MB, a few temporaries of that size)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
Q_EXP_CAP = 40.0  # linear_logprobs_loss: q = e^(z - ref) is exact for rows whose max logit is within this of ref

# ---------------------------------------------------------------------------------------------- Triton kernels


@triton.jit
def _tile_logits(h, w, r_start, c_start, row_ok, col_ok, H, stride_h, stride_w,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_V] fp32 tile of hidden[r_start:] @ weight[c_start:].T.

    TMA: ``h``/``w`` are tensor descriptors over all of hidden / weight (rows past the end read as 0); otherwise
    pointers, loads masked by ``row_ok`` / ``col_ok``."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    if TMA:
        for k0 in range(0, H, BLOCK_K):
            acc = _dot(h.load([r_start, k0]), w.load([c_start, k0]), acc, IEEE)
    else:
        ks = tl.arange(0, BLOCK_K)
        rows = r_start + tl.arange(0, BLOCK_N)
        cols = c_start + tl.arange(0, BLOCK_V)
        h_ptrs = h + rows.to(tl.int64)[:, None] * stride_h + ks[None, :]
        w_ptrs = w + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                hb = tl.load(h_ptrs, mask=row_ok[:, None], other=0.0)
                wb = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
            else:
                k_ok = (k0 + ks) < H
                hb = tl.load(h_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wb = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(hb, wb, acc, IEEE)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    return acc


@triton.jit
def _dot(hb, wb, acc, IEEE: tl.constexpr):
    """acc + hb @ wb.T; exact fp32 products for fp32 inputs (tf32 would lose 13 bits)."""
    if IEEE:
        return tl.dot(hb, tl.trans(wb), acc, input_precision="ieee")
    return tl.dot(hb, tl.trans(wb), acc)


@triton.jit
def _online_update(acc, col_ok, m, s, a, inv_temp, HAS_ENT: tl.constexpr):
    """Fold one logit tile into the running (max, sum-exp, entropy term) of each row; also returns the tile's
    e^(z - m) under the new max (0 past the vocab end)."""
    z = tl.where(col_ok[None, :], acc * inv_temp, float("-inf"))
    m_new = tl.maximum(m, tl.max(z, axis=1))
    e = tl.exp(z - m_new[:, None])
    alpha = tl.exp(m - m_new)
    if HAS_ENT:
        d = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
        a = alpha * (a + (m - m_new) * s) + tl.sum(e * d, axis=1)
    s = alpha * s + tl.sum(e, axis=1)
    return m_new, s, a, e


@triton.jit
def _store_q_tile(q_ptr, q_desc, e, m, ref, keep, cols, tgt, rows, row_ok, col_ok, r_start, c_start, stride_q,
                  CAP: tl.constexpr, Q_TMA: tl.constexpr):
    """Store q = e^(z - ref) = e * e^(m - ref) (exponent capped at CAP) of one tile, 0 in each row's target
    column (linear_logprobs_loss): with Q_TMA one bulk tensor store of the whole tile through ``q_desc`` (rows past
    N and columns past V clipped by the descriptor; every row of the tile is kept), else per-thread stores of the
    rows in ``keep``."""
    q = e * tl.exp(tl.minimum(m - ref, CAP))[:, None]
    q = tl.where(cols[None, :] == tgt[:, None], 0.0, q)
    if Q_TMA:
        q_desc.store([r_start, c_start], q.to(q_desc.dtype))
    else:
        ptrs = q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :]
        tl.store(ptrs, q.to(q_ptr.dtype.element_ty), mask=(row_ok & keep)[:, None] & col_ok[None, :])


@triton.jit
def _stats_kernel(h_ptr, w_ptr, h_desc, w_desc, tgt_ptr, part_ptr, q_ptr, q_desc, ref_ptr, fix_ptr, N, V, H,
                  vocab_start,
                  inv_temp, cols_per_split, stride_h, stride_w, stride_q,
                  HAS_ENT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, FLAT: tl.constexpr,
                  TMA: tl.constexpr, STORE: tl.constexpr, FIX: tl.constexpr, CAP: tl.constexpr,
                  Q_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                  BLOCK_K: tl.constexpr):  # fmt: skip
    # part_ptr: [4, splits, N] fp32 = (max, sum-exp, entropy term, target logit) of this split's vocab range.
    # TMA: the logit tiles are loaded through the descriptors h_desc / w_desc (over all of hidden / weight).
    # STORE (linear_logprobs_loss): also write every tile's q = e^(z - ref[row]) into q_ptr [N, V] (see _store_q_tile).
    # FIX: only the rows with fix_ptr[row] != 0 are stored (their ref is now the row's max) and no partials are
    # written; a program without such a row loops over nothing. Q_TMA (STORE without FIX, TMA loads): q's tiles
    # leave through the descriptor q_desc (block [BLOCK_N, BLOCK_V]) as bulk stores, not per-thread pointers.
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    r_start = pid_n * BLOCK_N
    rows = r_start + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    keep = row_ok
    ref = tl.zeros([BLOCK_N], dtype=tl.float32)
    if STORE:
        ref = tl.load(ref_ptr + rows, mask=row_ok, other=0.0)
        if FIX:
            keep = row_ok & (tl.load(fix_ptr + rows, mask=row_ok, other=0) != 0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - vocab_start
    v_begin = pid_s * cols_per_split
    v_end = tl.minimum(v_begin + cols_per_split, V)
    if FIX:
        v_end = tl.where(tl.max(keep.to(tl.int32), axis=0) > 0, v_end, v_begin)
    m = tl.full([BLOCK_N], -1e30, dtype=tl.float32)  # finite: keeps (m - m_new) * s at 0 before the first tile
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    a = tl.zeros([BLOCK_N], dtype=tl.float32)
    if FLAT:  # one loop over (vocab tile, k step): the pipeliner keeps loading across vocab-tile boundaries
        k_tiles = tl.cdiv(H, BLOCK_K)
        n_iter = tl.cdiv(v_end - v_begin, BLOCK_V) * k_tiles
        ks = tl.arange(0, BLOCK_K)
        h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
        acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        for it in range(0, n_iter):
            kt = it % k_tiles
            c_start = v_begin + (it // k_tiles) * BLOCK_V
            cols = c_start + tl.arange(0, BLOCK_V)
            col_ok = cols < v_end
            if TMA:
                hb = h_desc.load([r_start, kt * BLOCK_K])
                wb = w_desc.load([c_start, kt * BLOCK_K])
            else:
                k_idx = kt * BLOCK_K + ks
                k_ok = (k_idx < H) | EVEN_K
                hb = tl.load(h_rows + k_idx[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wb = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_w + k_idx[None, :],
                             mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            acc = _dot(hb, wb, acc, IEEE)
            if kt == k_tiles - 1:
                m, s, a, e = _online_update(acc, col_ok, m, s, a, inv_temp, HAS_ENT)
                if STORE:
                    _store_q_tile(q_ptr, q_desc, e, m, ref, keep, cols, tgt, rows, row_ok, col_ok, r_start,
                                  c_start, stride_q, CAP, Q_TMA)
                acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    else:
        for v0 in range(v_begin, v_end, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_ok = cols < v_end
            if TMA:
                acc = _tile_logits(h_desc, w_desc, r_start, v0, row_ok, col_ok, H, stride_h, stride_w,
                                   BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, IEEE, True)  # fmt: skip
            else:
                acc = _tile_logits(h_ptr, w_ptr, r_start, v0, row_ok, col_ok, H, stride_h, stride_w,
                                   BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, IEEE, False)  # fmt: skip
            m, s, a, e = _online_update(acc, col_ok, m, s, a, inv_temp, HAS_ENT)
            if STORE:
                _store_q_tile(q_ptr, q_desc, e, m, ref, keep, cols, tgt, rows, row_ok, col_ok, r_start, v0,
                              stride_q, CAP, Q_TMA)
    if not FIX:
        _store_partials(h_ptr, w_ptr, tgt, part_ptr, rows, row_ok, pid_s, N, V, H, inv_temp, stride_h, stride_w, m, s,
                        a, BLOCK_N, BLOCK_K)


@triton.jit
def _store_partials(h_ptr, w_ptr, tgt, part_ptr, rows, row_ok, pid_s, N, V, H, inv_temp, stride_h, stride_w, m, s, a,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    tz = tl.zeros([BLOCK_N], dtype=tl.float32)
    if pid_s == 0:  # the target logit as one gathered dot product per row, not a reduction per tile
        t_ok = row_ok & (tgt >= 0) & (tgt < V)
        ks = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_h + ks[None, :]
        w_ptrs = w_ptr + tl.where(t_ok, tgt, 0).to(tl.int64)[:, None] * stride_w + ks[None, :]
        for k0 in range(0, H, BLOCK_K):
            k_ok = t_ok[:, None] & ((k0 + ks) < H)[None, :]
            hb = tl.load(h_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            wb = tl.load(w_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            tz += tl.sum(hb * wb, axis=1)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        tz = tz * inv_temp
    out = part_ptr + pid_s * N + rows
    stride_part = tl.num_programs(1) * N
    tl.store(out, m, mask=row_ok)
    tl.store(out + stride_part, s, mask=row_ok)
    tl.store(out + 2 * stride_part, a, mask=row_ok)
    tl.store(out + 3 * stride_part, tz, mask=row_ok)


@triton.jit
def _grad_logits_kernel(h_ptr, w_ptr, h_desc, w_desc, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, out_ptr,
                        C, Vc, H, row0, v0, vocab_start, inv_temp, stride_h, stride_w, stride_out,
                        HAS_ENT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_N: tl.constexpr):  # fmt: skip
    # out[r, c] = (g_lp[r] (onehot - p) - g_ent[r] p (log p + ent[r])) / T for the chunk rows row0.., cols v0..
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(C, BLOCK_N)
    tiles_v = tl.cdiv(Vc, BLOCK_V)
    in_group = GROUP_N * tiles_v
    first_n = (pid // in_group) * GROUP_N
    group_n = tl.minimum(tiles_n - first_n, GROUP_N)
    pid_n = first_n + (pid % in_group) % group_n
    pid_v = (pid % in_group) // group_n
    r_loc = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_loc = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = r_loc < C
    col_ok = c_loc < Vc
    rows = row0 + r_loc
    cols = v0 + c_loc
    if TMA:
        acc = _tile_logits(h_desc, w_desc, row0 + pid_n * BLOCK_N, v0 + pid_v * BLOCK_V, row_ok, col_ok, H,
                           stride_h, stride_w, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, IEEE, True)  # fmt: skip
    else:
        acc = _tile_logits(h_ptr, w_ptr, row0 + pid_n * BLOCK_N, v0 + pid_v * BLOCK_V, row_ok, col_ok, H,
                           stride_h, stride_w, BLOCK_N, BLOCK_V, BLOCK_K, EVEN_K, IEEE, False)  # fmt: skip
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1) - vocab_start
    logp = acc * inv_temp - lse[:, None]
    p = tl.exp(logp)
    g = glp[:, None] * (tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0) - p)
    if HAS_ENT:
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        g -= gent[:, None] * p * (logp + ent[:, None])
    g = g * inv_temp
    out = out_ptr + r_loc.to(tl.int64)[:, None] * stride_out + c_loc[None, :]
    tl.store(out, g.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


_EVEN_K = triton.heuristics({"EVEN_K": lambda args: args["H"] % args["BLOCK_K"] == 0})
_stats = _EVEN_K(_stats_kernel)
_grad_logits = _EVEN_K(_grad_logits_kernel)


def _set_blocks(nargs):
    """Config pre-hook: the tensor descriptors' block shapes follow the config's tile (no-op for pointers)."""
    for name, rows in (("h_desc", "BLOCK_N"), ("w_desc", "BLOCK_V")):
        if isinstance(nargs[name], TensorDescriptor):
            nargs[name].block_shape = [nargs[rows], nargs["BLOCK_K"]]
    if isinstance(nargs.get("q_desc"), TensorDescriptor):
        nargs["q_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_V"]]


def _configs(grad):
    # Few configs on purpose: each costs a compile (seconds) per flag combination. Hopper bf16 GEMM tiles, all
    # checked with ptxas for sm_90 (TMA loads: no spills but 256 x 128 with the entropy terms, 12 bytes). At
    # H = 1024 every tile streams (BLOCK_N + BLOCK_V) x H operands from L2 for 2 BLOCK_N BLOCK_V H FLOPs: 64 FLOP
    # per byte at 128 x 128 (about 450 TFLOP/s if L2 gives ~7 TB/s), 85 at 128 x 256 / 256 x 128 (one program per
    # SM, 144 KB). 128 x 128 with 3 stages fits two programs per SM (96 KB, <= 128 registers), so one program's
    # exp/store epilogue overlaps the other's MMAs. The forward also tries the single-loop shape (FLAT: loads
    # pipelined across vocab tiles) and the nested loops.
    if grad:
        shapes = [(128, 128, 64, 8, 3, {}), (128, 128, 64, 8, 4, {}), (128, 256, 64, 8, 3, {}),
                  (256, 128, 64, 8, 3, {})]  # fmt: skip
    else:
        shapes = [(128, 128, 64, 8, 3, {"FLAT": True}), (128, 128, 64, 8, 4, {"FLAT": True}),
                  (128, 128, 64, 8, 3, {"FLAT": False}), (128, 256, 64, 8, 3, {"FLAT": True}),
                  (256, 128, 64, 8, 3, {"FLAT": True})]  # fmt: skip
    extra = {"GROUP_N": 8} if grad else {}
    return [triton.Config({"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk, **extra, **flat}, num_warps=w, num_stages=st,
                          pre_hook=_set_blocks)
            for bn, bv, bk, w, st, flat in shapes]  # fmt: skip


stats_autotuner = triton.autotune(autotune_candidates(_configs(False)),
                               key=["H", "V", "HAS_ENT", "IEEE", "TMA", "STORE", "FIX", "Q_TMA"])(_stats)
grad_autotuner = triton.autotune(autotune_candidates(_configs(True)), key=["H", "Vc", "HAS_ENT", "IEEE", "TMA"])(
    _grad_logits)
_INTERPRET_CFG = {"BLOCK_N": 32, "BLOCK_V": 128, "BLOCK_K": 32}  # one small config: the interpreter is slow
INTERPRET_FLAT = False  # tests flip it to run the flat-loop forward too



def on_device(t):
    return t.is_cuda and not interpreting()


def tma_possible(*tensors):
    """TMA descriptors need sm_90+ (or the interpreter), 16-byte aligned bases and row strides, unit last stride."""
    if not all(t.is_cuda for t in tensors) and not interpreting():
        return False
    if on_device(tensors[0]) and not has_tma(tensors[0].device):
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 and t.stride(-1) == 1
               for t in tensors)  # fmt: skip


def operands(hidden, weight, tma):
    """(h_desc, w_desc): descriptors over all of hidden / weight (block shapes set per config), or the pointers."""
    if not tma:
        return hidden, weight
    bn, bv, bk = (_INTERPRET_CFG[k] for k in ("BLOCK_N", "BLOCK_V", "BLOCK_K"))
    return TensorDescriptor.from_tensor(hidden, [bn, bk]), TensorDescriptor.from_tensor(weight, [bv, bk])


def triton_stats(hidden, weight, targets, vocab_start, inv_temp, want_entropy, tma, store=None, fix=None,
                  q_tma=True):
    """Per-split (m, s, a, tz) partials: [4, splits, N] fp32. ``store`` = (q [N, V], ref [N] fp32): also write each
    row's q = e^(z - ref) (linear_logprobs_loss); with ``fix`` (int [N]) only the flagged rows are written, no
    partials (returns None); ``q_tma`` lets q leave by TMA stores where the loads use TMA (not with ``fix``)."""
    N, H = hidden.shape
    V = weight.shape[0]
    if not on_device(hidden):
        splits = 2 if V > 2 * _INTERPRET_CFG["BLOCK_V"] else 1
    else:  # ~16 waves of two 128-token programs per SM: tail under 1/16 whether one or two fit an SM
        splits = max(1, min(triton.cdiv(32 * sm_count(hidden.device.index or 0), triton.cdiv(N, 128)), V // 1024))
    cols_per_split = triton.cdiv(triton.cdiv(V, splits), 256) * 256
    splits = triton.cdiv(V, cols_per_split)
    parts = torch.empty(4, splits, N, dtype=torch.float32, device=hidden.device) if fix is None else None
    q, ref = store if store is not None else (None, None)
    q_tma = q_tma and q is not None and fix is None and tma and tma_possible(q)
    q_desc = TensorDescriptor.from_tensor(q, [_INTERPRET_CFG["BLOCK_N"], _INTERPRET_CFG["BLOCK_V"]]) if q_tma else q
    args = (hidden, weight, *operands(hidden, weight, tma), targets, parts, q, q_desc, ref, fix, N, V, H,
            vocab_start, inv_temp, cols_per_split, hidden.stride(0), weight.stride(0),
            q.stride(0) if q is not None else 0)
    flags = {"HAS_ENT": want_entropy, "IEEE": hidden.dtype == torch.float32, "TMA": tma, "STORE": q is not None,
             "FIX": fix is not None, "CAP": Q_EXP_CAP, "Q_TMA": q_tma}
    if not on_device(hidden):
        grid = (triton.cdiv(N, _INTERPRET_CFG["BLOCK_N"]), splits)
        _stats[grid](*args, **flags, **_INTERPRET_CFG, FLAT=INTERPRET_FLAT)
    else:
        stats_autotuner[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), splits)](*args, **flags)
    return parts


def triton_grad_chunk(hidden, weight, targets, lse, ent, g_lp, g_ent, row0, rows, v0, cols, vocab_start, inv_temp,
                       out, operands):  # fmt: skip
    """Write the logit gradient of rows [row0, row0+rows) x vocab [v0, v0+cols) into out[:rows, :cols]."""
    H = hidden.shape[1]
    has_ent = g_ent is not None
    tma = isinstance(operands[0], TensorDescriptor)
    args = (hidden, weight, *operands, targets, lse, ent if has_ent else lse, g_lp, g_ent if has_ent else g_lp, out,
            rows, cols, H, row0, v0, vocab_start, inv_temp, hidden.stride(0), weight.stride(0), out.stride(0))
    flags = {"HAS_ENT": has_ent, "IEEE": hidden.dtype == torch.float32, "TMA": tma}
    if not on_device(hidden):
        cfg = {**_INTERPRET_CFG, "GROUP_N": 2}
        grid = (triton.cdiv(rows, cfg["BLOCK_N"]) * triton.cdiv(cols, cfg["BLOCK_V"]),)
        _grad_logits[grid](*args, **flags, **cfg)
    else:
        grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_N"]) * triton.cdiv(cols, meta["BLOCK_V"]),)
        grad_autotuner[grid](*args, **flags)
    return out[:rows, :cols]


# ------------------------------------------------------------------------------------------------ native path


def matmul_f32(a, b):
    """a @ b with fp32 (or fp64) output and fp32 accumulation, without rounding the product to a 16-bit dtype."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
        return (a @ b).float()
    return a.float() @ b.float()


@functools.lru_cache(maxsize=8)
def _addmm_out_dtype_ok(device_index: int, dtype: torch.dtype) -> bool:
    """Whether torch.addmm(acc32, a16, b16, out_dtype=fp32, out=acc32) accumulates correctly here (checked once)."""
    try:
        dev = torch.device("cuda", device_index)
        a = torch.randn(16, 32, device=dev).to(dtype)
        b = torch.randn(32, 16, device=dev).to(dtype)
        acc = torch.randn(16, 16, device=dev)
        ref = acc + a.float() @ b.float()
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return bool(torch.allclose(acc, ref, rtol=1e-3, atol=1e-3))
    except (TypeError, RuntimeError):
        return False


def accumulate(acc, a, b):
    """acc += a @ b with fp32 accumulation; on CUDA in the GEMM epilogue (beta = 1), no temporary."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda and _addmm_out_dtype_ok(a.device.index, a.dtype):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += matmul_f32(a, b).to(acc.dtype)


def native_stats(hidden, weight, targets, vocab_start, inv_temp, chunk_rows):
    """(m, s, a, tz) as [4, 1, N] over token chunks of at most ``chunk_rows`` x the full (local) vocab."""
    N, V = hidden.shape[0], weight.shape[0]
    ct = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    parts = torch.empty(4, 1, N, dtype=ct, device=hidden.device)
    rows = chunk_rows or max(1, NATIVE_CHUNK_ELEMENTS // V)
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        z = matmul_f32(hidden[r0:r1], weight.T).to(ct) * inv_temp
        m = z.max(dim=1).values
        e = torch.exp(z - m[:, None])
        col = targets[r0:r1] - vocab_start
        inside = (col >= 0) & (col < V)
        parts[0, 0, r0:r1] = m
        parts[1, 0, r0:r1] = e.sum(1)
        parts[2, 0, r0:r1] = (e * (z - m[:, None])).sum(1)
        parts[3, 0, r0:r1] = z.gather(1, col.clamp(0, V - 1)[:, None])[:, 0] * inside
    return parts


def native_grad_chunk(hidden, weight, targets, lse, ent, g_lp, g_ent, row0, rows, v0, cols, vocab_start, inv_temp,
                       out_dtype):  # fmt: skip
    r = slice(row0, row0 + rows)
    z = matmul_f32(hidden[r], weight[v0 : v0 + cols].T).to(lse.dtype) * inv_temp
    logp = z - lse[r, None]
    p = torch.exp(logp)
    g = -p * g_lp[r, None]
    col = targets[r] - vocab_start - v0
    inside = (col >= 0) & (col < cols)
    g.scatter_add_(1, col.clamp(0, cols - 1)[:, None], (g_lp[r] * inside)[:, None])
    if g_ent is not None:
        g -= g_ent[r, None] * p * (logp + ent[r, None])
    return (g * inv_temp).to(out_dtype)


# ------------------------------------------------------------------------------------ merge, backward, autograd


def merge(parts):
    """Merge [4, K, N] partials over K: returns m, s, a, tz of the union (see the module docstring)."""
    m, s, a, tz = parts.unbind(0)
    big = m.max(dim=0).values
    w = torch.exp(m - big)
    return big, (w * s).sum(0), (w * (a + (m - big) * s)).sum(0), tz.sum(0)


def chunk_plan(N, V, chunk_rows, budget):
    """(rows, cols) of a backward chunk: at most ``budget`` elements, vocab chunks evened out (no small last one)."""
    rows = max(1, min(N, chunk_rows or max(1, budget // 4096)))
    if rows * V <= budget:
        return rows, V
    cols = max(256, budget // rows // 256 * 256)
    cols = triton.cdiv(triton.cdiv(V, triton.cdiv(V, cols)), 256) * 256
    return rows, min(cols, V)


def recompute_grads(hidden, weight, targets, vocab_start, inv_temp, lse, ent, g_lp, g_ent, need_dh, need_dw,
                    chunk_rows, triton_path, opts):  # fmt: skip
    """(dhidden, dweight) of the log-probs (and entropy) given their gradients: the logits recomputed chunk by chunk
    into one logit-gradient buffer (Triton, or native), then two GEMMs per chunk (module docstring)."""
    N, H = hidden.shape
    V = weight.shape[0]
    # bf16 logit gradients feed the tensor cores (as torch's own path casts them); fp16 could underflow, so fp32.
    gdt = torch.bfloat16 if weight.dtype == torch.bfloat16 else lse.dtype
    budget = opts.chunk if triton_path else NATIVE_CHUNK_ELEMENTS
    rows, cols = chunk_plan(N, V, chunk_rows, budget)
    acc_dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    dh = torch.zeros(N, H, dtype=acc_dt, device=hidden.device) if need_dh else None
    one_pass = 0 < N <= rows and gdt == weight.dtype  # each dweight row block is written once, in weight's dtype
    dw = None
    if need_dw:
        dw = torch.empty_like(weight) if one_pass else torch.zeros(V, H, dtype=acc_dt, device=weight.device)
    chunks = [(r0, min(rows, N - r0), v0, min(cols, V - v0)) for r0 in range(0, N, rows) for v0 in range(0, V, cols)]
    buf = torch.empty(rows, cols, dtype=gdt, device=hidden.device) if triton_path else None
    tiles = operands(hidden, weight, opts.tma) if triton_path else None
    for r0, nr, v0, nc in chunks:
        chunk_args = (hidden, weight, targets, lse, ent, g_lp, g_ent, r0, nr, v0, nc, vocab_start, inv_temp)
        if triton_path:
            g = triton_grad_chunk(*chunk_args, buf, tiles)
        else:
            g = native_grad_chunk(*chunk_args, gdt)
        h_c = hidden[r0 : r0 + nr]
        h_c = h_c if h_c.dtype == gdt else h_c.to(gdt)
        w_c = weight[v0 : v0 + nc]
        w_c = w_c if w_c.dtype == gdt else w_c.to(gdt)
        if need_dh:
            accumulate(dh[r0 : r0 + nr], g, w_c)
        if need_dw and one_pass:
            torch.mm(g.T, h_c, out=dw[v0 : v0 + nc])
        elif need_dw:
            accumulate(dw[v0 : v0 + nc], g.T, h_c)
    return dh, dw


class Options(NamedTuple):
    tma: bool  # load the logit tiles through TMA descriptors (Triton path)
    chunk: int  # elements of one backward logit-gradient chunk (Triton path)
    q_tma: bool = True  # linear_logprobs_loss: q's tiles leave by TMA bulk stores where the loads use TMA


LOADS = ("auto", "tma", "pointer")
Q_STORES = ("tma", "pointer")


def options(hidden=None, weight=None, triton_path=False, *, loads="auto", bwd_chunk=None, q_store="tma") -> Options:
    """The variants a benchmark compares (the public functions take them as private keywords; the defaults are the
    measured winners; an invalid value raises on every path):

    ``loads``: "auto" (TMA descriptors where the GPU (sm_90+) and the tensors' alignment allow, else pointers),
    "tma" (required: raises where not possible), "pointer" (masked pointer loads).
    ``bwd_chunk``: elements per logit-gradient chunk of the Triton backward (None: 2^28, 512 MB in bf16); at least
    65,536.
    ``q_store`` (``linear_logprobs_loss``): "tma" (q's tiles leave the statistics kernel as bulk tensor stores
    wherever its loads use TMA) or "pointer" (per-thread masked stores)."""
    if loads not in LOADS:
        raise ValueError(f"logprobs: loads must be one of {LOADS}, got {loads!r}")
    if bwd_chunk is not None and (not isinstance(bwd_chunk, int) or bwd_chunk < 1 << 16):
        raise ValueError(f"logprobs: bwd_chunk must be an integer >= 65536 (elements), got {bwd_chunk!r}")
    if q_store not in Q_STORES:
        raise ValueError(f"logprobs: q_store must be one of {Q_STORES}, got {q_store!r}")
    tma = False
    if triton_path and loads != "pointer":
        tma = tma_possible(hidden, weight)
        if loads == "tma" and not tma:
            raise RuntimeError("logprobs: loads='tma' but TMA descriptors cannot be used here (they need sm_90+ or "
                               "the interpreter, 16-byte aligned hidden/weight rows)")  # fmt: skip
    return Options(tma, GRAD_CHUNK_ELEMENTS if bwd_chunk is None else bwd_chunk, q_store == "tma")


def flat_inputs(hidden, weight, targets, temperature, name):
    """Checked ``(hidden [N, H], weight [V, H], targets int64 [N], use the Triton path)`` for the head's kernels;
    a bad shape, dtype or temperature raises ValueError naming ``name``."""
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"{name}: hidden [..., H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"{name}: targets {tuple(targets.shape)} must match hidden's leading dims "
                         f"{tuple(hidden.shape[:-1])}")  # fmt: skip
    if hidden.dtype != weight.dtype:
        raise ValueError(f"{name}: hidden and weight dtypes differ ({hidden.dtype} vs {weight.dtype})")
    if targets.dtype not in (torch.int64, torch.int32) or not temperature > 0:
        raise ValueError(f"{name}: targets must be int64/int32 (got {targets.dtype}) and temperature > 0 "
                         f"(got {temperature})")  # fmt: skip
    h2 = hidden.reshape(-1, hidden.shape[-1])
    h2 = h2 if h2.stride(-1) == 1 else h2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    t = targets.reshape(-1).to(torch.int64).contiguous()
    return h2, w, t, use_triton(h2, w, t, supported=hidden.dtype in _FLOATS and h2.shape[0] > 0)



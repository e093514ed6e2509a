"""Hopper (sm_90) attention kernels written in Gluon (``triton.experimental.gluon``): the forward
(``ARENO_ATTN_FWD=gluon``, the sm_90 default) and a dQ and a dK/dV kernel (``ARENO_ATTN_BWD=gluon``, opt-in).

Same math, packed varlen layout, causal block split and outputs (O, base-2 LSE; dQ, dK, dV) as the TMA kernels in
``attention_tma.py``; what Gluon adds is control over the order of the asynchronous work, which the Triton compiler
decides for itself (each ``tl.dot`` waited for before the code that follows it, a CTA-wide barrier before each TMA
issue):

- plain forward (``_attn_fwd_gluon_kernel``, d64 / d256): K and V stream through a ring of ``STAGES`` shared-memory
  slots by TMA, each with its own mbarrier; a slot is refilled as soon as the wgmma that read it has completed.
  FlashAttention-3's intra-warpgroup pipelining: for key block j the scores S_j = Q K_j^T and the previous block's
  O += P_{j-1} V_{j-1} are issued together as asynchronous wgmma groups; the warpgroup waits for S_j only
  (``warpgroup_mma_wait(1)``: groups complete in order), runs block j's softmax while P V still runs, then waits for
  P V and rescales O. P stays in registers (the wgmma A operand); Q may too (``Q_REGS``);
- warp-specialized forward (``_attn_fwd_gluon_ws_kernel``, d128), FlashAttention-3's layout: a 128-row query tile,
  one load warp issuing every TMA, two consumer warpgroups of 64 rows each running the loop above on their half and
  sharing each K / V tile (half the K / V traffic of two 64-row programs). The partitions meet only at mbarriers
  (ready: the TMA's bytes; empty: both consumers' releases), and ``setmaxnreg`` gives the load warp's group 24
  registers and the consumers the rest;
- dQ (``_attn_bwd_dq_gluon_kernel``): the warp-specialized forward's structure, per key block S = Q K^T and
  dP = dO V^T issued together, P under dP, dQ += dS K;
- dK/dV (``_attn_bwd_dkdv_gluon_kernel``): a 128-key tile, the load warp streaming Q and dO of every query block of
  every query head of the GQA group, two consumer warpgroups of 64 keys each: S^T, dP^T together, dV += P^T dO while
  dS^T forms, dK += dS^T Q.
The backward kernels wait for each step's last products inside the step: a wgmma left in flight across a loop's back
edge makes ptxas serialise every wgmma of the kernel ("insufficient register resources").

Masking, bounds and the rows past a sequence's end are handled as in the TMA kernels (see ``attention_tma.py``): one
descriptor over the packed ``[T, H * D]`` view, key blocks at or past ``full`` masked (keys past Lk, causal), query
rows past Lq computed and not stored (their LSE = +inf makes P = 0 in the backward), key rows past Lk not stored.
A forward query tile that sees no key at all (Lk == 0, or causal with Lq > Lk) runs one fully masked block: O = 0,
LSE = +inf.

Gluon compiles only for a GPU (no ``TRITON_INTERPRET``): the CPU tests compile every candidate offline for sm_90
(``compile_sm90``) and check the PTX's asynchronous structure; the GPU tests compare each with float64. Needs a Triton
with Gluon's Hopper module (3.5+; the device's 3.6 and the CPU's 3.7 agree on what is used here): ``available()``
says whether this one has it, ``applies()`` why a kernel cannot take given inputs, in which case ``attention.py``
runs the TMA kernels instead.
"""

from __future__ import annotations

import functools

import torch
import triton

try:  # Gluon is experimental: older Tritons lack it, and its API moves between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    _IMPORT_ERROR = None
except Exception as e:  # pragma: no cover - depends on the installed triton
    _IMPORT_ERROR = e


def available() -> bool:
    """True when this Triton has Gluon's Hopper language (the kernel below compiles)."""
    return _IMPORT_ERROR is None


if _IMPORT_ERROR is None:

    @gluon.constexpr_function
    def _mma_layout(n, warps):
        """The wgmma accumulator layout of an [M, n] tile: ``warps`` warps stacked along M (a warpgroup per 64 rows),
        one m64 x n x k16 instruction per row group."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, n, 16])

    @gluon.jit
    def _load_kv(desc, smem, bars, j, n_blocks, row0, col, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """Start the TMA load of key block j (K or V) into ring slot j % STAGES, if block j exists."""
        slot = j % STAGES
        pred = j < n_blocks
        bar = bars.index(slot)
        mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(desc, [row0 + j * BLOCK_N, col], bar, smem.index(slot), pred=pred)

    @gluon.jit
    def _softmax_block(qk, m_i, l_i, j, n_full, offs_m, offs_n, diag, Lk, qk_scale, BLOCK_N: gl.constexpr,
                       CAUSAL: gl.constexpr):
        """Online softmax (base 2) of raw scores ``qk`` of key block j: P (fp32), the new running max and sum, and
        alpha, the factor that moves the previous accumulator to the new max. Blocks at or past ``n_full`` mask keys
        past Lk and, if causal, right of the diagonal; a row that has seen no key yet keeps m = -inf without NaNs."""
        if j >= n_full:
            cols = j * BLOCK_N + offs_n
            keep = cols[None, :] < Lk
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
            qk = gl.where(keep, qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(qk * qk_scale - m_sub[:, None])
        alpha = gl.exp2(m_i - m_sub)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _seq_tile(CU_Q, CU_K):
        """A query-tile program's (tile, sequence, head), its sequence's query and key spans in the packed tensors
        and diag = Lk - Lq (queries end-aligned on the keys). Tiles run in reverse: the longest (diagonal-most) ones
        start first."""
        start_m = gl.num_programs(0) - 1 - gl.program_id(0)
        b = gl.program_id(1)
        h = gl.program_id(2)
        q_start = gl.load(CU_Q + b)
        Lq = gl.load(CU_Q + b + 1) - q_start
        k_start = gl.load(CU_K + b)
        Lk = gl.load(CU_K + b + 1) - k_start
        return start_m, h, q_start, Lq, k_start, Lk, Lk - Lq

    @gluon.jit
    def _key_blocks(row0, ROWS: gl.constexpr, Lk, diag, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """Key blocks query rows row0 + [0, ROWS) need: how many cover the keys any of them sees, and how many
        leading ones every row sees whole (no mask)."""
        if CAUSAL:
            hi = gl.maximum(gl.minimum(Lk, row0 + ROWS + diag), 0)
            full = gl.maximum(gl.minimum(row0 + diag + 1, Lk), 0)
        else:
            hi = Lk
            full = Lk
        return gl.cdiv(hi, BLOCK_N), full // BLOCK_N

    @gluon.jit
    def _store_rows(desc, PTR, out, smem, row0, n_valid, col, head, stride_t, stride_h, layout: gl.constexpr):
        """Store the [ROWS, D] tile ``out`` (in ``layout``) at rows row0 + [0, n_valid) of a packed [T, H, D]
        tensor: through ``smem`` and a TMA store when all ROWS rows are the sequence's, else (its last rows: a
        descriptor store would write into the next sequence) by masked stores; nothing when n_valid <= 0."""
        ROWS: gl.constexpr = out.shape[0]
        HEAD_D: gl.constexpr = out.shape[1]
        if n_valid >= ROWS:
            smem.store(out)
            fence_async_shared()
            tma.async_copy_shared_to_global(desc, [row0, col], smem)
            tma.store_wait(0)
        elif n_valid > 0:
            rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
            offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, layout))
            ptrs = PTR + (row0 + rows)[:, None].to(gl.int64) * stride_t + head * stride_h + offs_d[None, :]
            gl.store(ptrs, out, mask=(rows < n_valid)[:, None])

    @gluon.jit
    def _release(desc, smem, ready, empty, blk, n_blocks, row0, col, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 WS: gl.constexpr):
        """Done with key block ``blk``'s K (or V) slot: a warp-specialized consumer hands it back to the load warp
        (its empty barrier); the plain kernel refills it itself with block blk + STAGES."""
        if WS:
            mbarrier.arrive(empty.index(blk % STAGES), count=1)
        else:
            _load_kv(desc, smem, ready, blk + STAGES, n_blocks, row0, col, BLOCK_N, STAGES)

    @gluon.jit
    def _attend(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, desc_k, desc_v, k_start, kv_col, n_iter,
                n_blocks, n_full, offs_m, offs_n, diag, Lk, qk_scale, acc, m_i, l_i, zero_s, p_layout: gl.constexpr,
                row_o: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                WS: gl.constexpr):
        """The forward's pipelined loop over key blocks [0, n_iter) of the ring: for block j, S_j = Q K_j^T and
        P_{j-1} V_{j-1} issued as async wgmma groups, block j's softmax while P V runs, then O rescaled; each K / V
        slot released (``_release``) as soon as the wgmma that read it has completed. Returns O (unnormalised), the
        running max and sum."""
        dtype: gl.constexpr = k_smem.dtype
        # block 0: scores and softmax only (no P V before it)
        mbarrier.wait(k_ready.index(0), 0)
        qk = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(0, deps=(qk, ))
        _release(desc_k, k_smem, k_ready, k_empty, 0, n_blocks, k_start, kv_col, BLOCK_N, STAGES, WS)
        p, m_i, l_i, alpha = _softmax_block(qk, m_i, l_i, 0, n_full, offs_m, offs_n, diag, Lk, qk_scale, BLOCK_N,
                                            CAUSAL)
        p = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_iter):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
            qk = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
            acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            qk = warpgroup_mma_wait(1, deps=(qk, ))  # S_j done, P_{j-1} V_{j-1} may still run
            _release(desc_k, k_smem, k_ready, k_empty, j, n_blocks, k_start, kv_col, BLOCK_N, STAGES, WS)
            p_next, m_i, l_i, alpha = _softmax_block(qk, m_i, l_i, j, n_full, offs_m, offs_n, diag, Lk, qk_scale,
                                                     BLOCK_N, CAUSAL)
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))
            _release(desc_v, v_smem, v_ready, v_empty, j - 1, n_blocks, k_start, kv_col, BLOCK_N, STAGES, WS)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p = gl.convert_layout(p_next.to(dtype), p_layout)
        last = n_iter - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        if WS:  # the plain kernel has nothing left to load
            mbarrier.arrive(v_empty.index(last % STAGES), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _normalise(acc, m_i, l_i, row_o: gl.constexpr, dtype: gl.constexpr):
        """O = acc / l in ``dtype`` and the base-2 LSE = m + log2(l); a row that saw no key: O = 0, LSE = +inf
        (P = 0 in the backward)."""
        l_o = gl.convert_layout(l_i, row_o)
        o = (acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]).to(dtype)
        lse = gl.where(l_i == 0.0, float("inf"), m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i)))
        return o, lse

    @gluon.jit(do_not_specialize=["stride_lh"])
    def _attn_fwd_gluon_kernel(
        desc_q, desc_k, desc_v, desc_o, O, LSE, CU_Q, CU_K, qk_scale, stride_ot, stride_oh, stride_lh, GROUP,
        SEQ_BUCKET, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        Q_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        HEAD_D: gl.constexpr = desc_q.block_type.shape[1]
        dtype: gl.constexpr = desc_q.dtype
        start_m, h, q_start, Lq, k_start, Lk, diag = _seq_tile(CU_Q, CU_K)
        if start_m * BLOCK_M >= Lq:
            return
        n_blocks, n_full = _key_blocks(start_m * BLOCK_M, BLOCK_M, Lk, diag, BLOCK_N, CAUSAL)
        n_blocks = gl.maximum(n_blocks, 1)  # a tile that sees no key runs one fully masked block

        s_layout: gl.constexpr = _mma_layout(BLOCK_N, num_warps)
        o_layout: gl.constexpr = _mma_layout(HEAD_D, num_warps)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], desc_q.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], desc_k.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], desc_v.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)

        q_row = q_start + start_m * BLOCK_M
        q_col = h * HEAD_D
        kv_col = (h // GROUP) * HEAD_D
        mbarrier.expect(q_bar, desc_q.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q, [q_row, q_col], q_bar, q_smem)
        for i in gl.static_range(STAGES):
            _load_kv(desc_k, k_smem, k_bars, i, n_blocks, k_start, kv_col, BLOCK_N, STAGES)
            _load_kv(desc_v, v_smem, v_bars, i, n_blocks, k_start, kv_col, BLOCK_N, STAGES)

        offs_m = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
        acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)

        mbarrier.wait(q_bar, 0)
        if Q_REGS:  # Q as the wgmma's register operand: each score product reads only K from shared memory
            q = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        else:
            q = q_smem
        acc, m_i, l_i = _attend(q, k_smem, v_smem, k_bars, v_bars, k_bars, v_bars, desc_k, desc_v, k_start, kv_col,
                                n_blocks, n_blocks, n_full, offs_m, offs_n, diag, Lk, qk_scale, acc, m_i, l_i, zero_s,
                                p_layout, row_o, BLOCK_N, STAGES, CAUSAL, False)
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))
        o, lse = _normalise(acc, m_i, l_i, row_o, dtype)
        # through q_smem: every wgmma that read Q has completed
        _store_rows(desc_o, O, o, q_smem, q_row, Lq - start_m * BLOCK_M, q_col, h, stride_ot, stride_oh, o_layout)
        gl.store(LSE + h * stride_lh + q_start + offs_m, lse, mask=offs_m < Lq)


    @gluon.jit
    def _stream_kv(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, k_start, kv_col, n_blocks,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """A load partition's loop: K and V of key blocks [0, n_blocks) into the ring, each slot once both consumer
        warpgroups have released it (``*_empty``, count 2), signalling ``*_ready`` by the TMA's byte count."""
        for j in range(n_blocks):
            slot = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_empty.index(slot), phase ^ 1)  # a fresh barrier passes parity 1 at once
            mbarrier.expect(k_ready.index(slot), desc_k.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_k, [k_start + j * BLOCK_N, kv_col], k_ready.index(slot),
                                            k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), phase ^ 1)
            mbarrier.expect(v_ready.index(slot), desc_v.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_v, [k_start + j * BLOCK_N, kv_col], v_ready.index(slot),
                                            v_smem.index(slot))

    @gluon.jit
    def _release_kv(k_ready, v_ready, k_empty, v_empty, lo, hi, STAGES: gl.constexpr):
        """A consumer's release of ring blocks [lo, hi) it does not read (each once loaded, in order)."""
        for j in range(lo, hi):
            slot = j % STAGES
            mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
            mbarrier.arrive(k_empty.index(slot), count=1)
            mbarrier.wait(v_ready.index(slot), (j // STAGES) & 1)
            mbarrier.arrive(v_empty.index(slot), count=1)

    @gluon.jit
    def _kv_ring(desc_k, desc_v, STAGES: gl.constexpr):
        """The warp-specialized kernels' K / V ring: STAGES tiles of each, ready barriers (the TMA's bytes) and
        empty barriers (both consumer warpgroups' releases)."""
        k_smem = gl.allocate_shared_memory(desc_k.dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
        v_smem = gl.allocate_shared_memory(desc_v.dtype, [STAGES] + desc_v.block_type.shape, desc_v.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)
        return k_smem, v_smem, k_ready, v_ready, k_empty, v_empty

    @gluon.jit
    def _ws_loader(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, q_row,
                   q_col, k_start, kv_col, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """The warp-specialized forward's load partition (one warp): both 64-row halves of the Q tile, then K and V
        block by block."""
        HALF: gl.constexpr = desc_q.block_type.shape[0]
        mbarrier.expect(q_bar, 2 * desc_q.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q, [q_row, q_col], q_bar, q_smem.index(0))
        tma.async_copy_global_to_shared(desc_q, [q_row + HALF, q_col], q_bar, q_smem.index(1))
        _stream_kv(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, k_start, kv_col, n_blocks,
                   BLOCK_N, STAGES)

    @gluon.jit
    def _ws_consumer(desc_o, O, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, WG, q_start,
                     row0, Lq, Lk, diag, h, q_col, n_blocks, qk_scale, stride_ot, stride_oh, stride_lh,
                     CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """A consumer partition (one warpgroup): query rows row0 + [0, 64) of the tile (half WG of the Q tile), the
        pipelined loop of ``_attn_fwd_gluon_kernel`` over its own key blocks, releasing each K / V slot once its
        wgmma has completed; key blocks of the tile past its own causal range are only released."""
        HALF: gl.constexpr = desc_o.block_type.shape[0]
        HEAD_D: gl.constexpr = desc_o.block_type.shape[1]
        dtype: gl.constexpr = desc_o.dtype
        s_layout: gl.constexpr = _mma_layout(BLOCK_N, 4)
        o_layout: gl.constexpr = _mma_layout(HEAD_D, 4)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        n_mine, n_full = _key_blocks(row0, HALF, Lk, diag, BLOCK_N, CAUSAL)
        n_mine = gl.minimum(gl.maximum(n_mine, 1), n_blocks)
        offs_m = row0 + gl.arange(0, HALF, layout=row_s)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        zero_s = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
        m_i = gl.full([HALF], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([HALF], gl.float32, row_s)
        acc = gl.zeros([HALF, HEAD_D], gl.float32, o_layout)
        q_half = q_smem.index(WG)

        mbarrier.wait(q_bar, 0)
        q = q_half.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        acc, m_i, l_i = _attend(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, None, None, 0, 0, n_mine,
                                n_blocks, n_full, offs_m, offs_n, diag, Lk, qk_scale, acc, m_i, l_i, zero_s, p_layout,
                                row_o, BLOCK_N, STAGES, CAUSAL, True)
        # the tile's blocks right of this half's diagonal: released in order, unread
        _release_kv(k_ready, v_ready, k_empty, v_empty, n_mine, n_blocks, STAGES)
        o, lse = _normalise(acc, m_i, l_i, row_o, dtype)
        # through this half's Q tile, no longer read
        _store_rows(desc_o, O, o, q_half, q_start + row0, Lq - row0, q_col, h, stride_ot, stride_oh, o_layout)
        gl.store(LSE + h * stride_lh + q_start + offs_m, lse, mask=offs_m < Lq)

    @gluon.jit(do_not_specialize=["stride_lh"])
    def _attn_fwd_gluon_ws_kernel(
        desc_q, desc_k, desc_v, desc_o, O, LSE, CU_Q, CU_K, qk_scale, stride_ot, stride_oh, stride_lh, GROUP,
        SEQ_BUCKET, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """Warp-specialized forward, FlashAttention-3's layout: a [BLOCK_M = 128, D] query tile per program, one
        load warp (TMA for Q, K, V) and two consumer warpgroups of 64 query rows each sharing every K / V tile (half
        the K / V traffic of two 64-row programs), synchronised only through mbarriers (no CTA-wide barrier in the
        loop). The descriptors' blocks: Q and O [64, D], K and V [BLOCK_N, D]."""
        HALF: gl.constexpr = desc_q.block_type.shape[0]
        HEAD_D: gl.constexpr = desc_q.block_type.shape[1]
        dtype: gl.constexpr = desc_q.dtype
        gl.static_assert(BLOCK_M == 2 * HALF)
        start_m, h, q_start, Lq, k_start, Lk, diag = _seq_tile(CU_Q, CU_K)
        if start_m * BLOCK_M >= Lq:
            return
        n_blocks, _ = _key_blocks(start_m * BLOCK_M, BLOCK_M, Lk, diag, BLOCK_N, CAUSAL)
        n_blocks = gl.maximum(n_blocks, 1)

        q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_D], desc_q.layout)
        k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = _kv_ring(desc_k, desc_v, STAGES)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)

        row0 = start_m * BLOCK_M
        q_col = h * HEAD_D
        kv_col = (h // GROUP) * HEAD_D
        gl.warp_specialize([
            (_ws_consumer, (desc_o, O, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, 0,
                            q_start, row0, Lq, Lk, diag, h, q_col, n_blocks, qk_scale, stride_ot, stride_oh,
                            stride_lh, CAUSAL, BLOCK_N, STAGES)),
            (_ws_consumer, (desc_o, O, LSE, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, 1,
                            q_start, row0 + HALF, Lq, Lk, diag, h, q_col, n_blocks, qk_scale, stride_ot, stride_oh,
                            stride_lh, CAUSAL, BLOCK_N, STAGES)),
            (_ws_loader, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                          q_start + row0, q_col, k_start, kv_col, n_blocks, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])


    @gluon.jit
    def _dq_loader(desc_q, desc_do, desc_k, desc_v, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                   k_empty, v_empty, q_row, q_col, k_start, kv_col, n_blocks, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr):
        """The dQ kernel's load partition: both halves of the Q and dO tiles, then K and V block by block."""
        HALF: gl.constexpr = desc_q.block_type.shape[0]
        mbarrier.expect(q_bar, 4 * desc_q.block_type.nbytes)
        for w in gl.static_range(2):
            tma.async_copy_global_to_shared(desc_q, [q_row + w * HALF, q_col], q_bar, q_smem.index(w))
            tma.async_copy_global_to_shared(desc_do, [q_row + w * HALF, q_col], q_bar, do_smem.index(w))
        _stream_kv(desc_k, desc_v, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, k_start, kv_col, n_blocks,
                   BLOCK_N, STAGES)

    @gluon.jit
    def _dq_consumer(desc_dq, DQ, LSE, DELTA, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                     v_empty, WG, q_start, row0, Lq, Lk, diag, h, q_col, n_blocks, qk_scale, sm_scale, stride_dqt,
                     stride_dqh, stride_lh, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """A dQ consumer warpgroup: query rows row0 + [0, 64): per key block S = Q K^T and dP = dO V^T issued
        together, P = exp2(S - LSE) while dP runs, dS = P (dP - delta), dQ += dS K; each slot released as soon as
        its last reader has completed."""
        HALF: gl.constexpr = desc_dq.block_type.shape[0]
        HEAD_D: gl.constexpr = desc_dq.block_type.shape[1]
        dtype: gl.constexpr = desc_dq.dtype
        s_layout: gl.constexpr = _mma_layout(BLOCK_N, 4)
        dq_layout: gl.constexpr = _mma_layout(HEAD_D, 4)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        n_mine, n_full = _key_blocks(row0, HALF, Lk, diag, BLOCK_N, CAUSAL)
        n_mine = gl.minimum(n_mine, n_blocks)
        offs_m = row0 + gl.arange(0, HALF, layout=row_s)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        row_ok = offs_m < Lq
        lse = gl.load(LSE + h * stride_lh + q_start + offs_m, mask=row_ok, other=float("inf"))
        delta = gl.load(DELTA + h * stride_lh + q_start + offs_m, mask=row_ok, other=0.0)
        zero_s = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
        dq = gl.zeros([HALF, HEAD_D], gl.float32, dq_layout)
        q_half = q_smem.index(WG)
        mbarrier.wait(q_bar, 0)
        for j in range(0, n_mine):
            slot = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            qk = warpgroup_mma(q_half, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(slot), phase)
            dp = warpgroup_mma(do_smem.index(WG), v_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                               is_async=True)
            qk = warpgroup_mma_wait(1, deps=(qk, ))
            p = gl.exp2(qk * qk_scale - lse[:, None])
            if j >= n_full:
                cols = j * BLOCK_N + offs_n
                keep = cols[None, :] < Lk
                if CAUSAL:
                    keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
                p = gl.where(keep, p, 0.0)
            dp = warpgroup_mma_wait(0, deps=(dp, ))
            mbarrier.arrive(v_empty.index(slot), count=1)
            ds = (p * (dp - delta[:, None])).to(dtype)
            ds = gl.convert_layout(ds, gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2))
            dq = warpgroup_mma(ds, k_smem.index(slot), dq, is_async=True)
            # waited here, not under the next block's products: a wgmma left in flight across the loop's back edge
            # makes ptxas serialize every wgmma of the kernel ("insufficient register resources")
            dq, ds = warpgroup_mma_wait(0, deps=(dq, ds))
            mbarrier.arrive(k_empty.index(slot), count=1)
        # the tile's blocks right of this half's diagonal: released in order, unread
        _release_kv(k_ready, v_ready, k_empty, v_empty, n_mine, n_blocks, STAGES)

        out = (dq * sm_scale).to(dtype)
        # through this half's Q tile: every wgmma that read it has completed
        _store_rows(desc_dq, DQ, out, q_half, q_start + row0, Lq - row0, q_col, h, stride_dqt, stride_dqh,
                    dq_layout)

    @gluon.jit(do_not_specialize=["stride_lh"])
    def _attn_bwd_dq_gluon_kernel(
        desc_q, desc_k, desc_v, desc_do, desc_dq, DQ, LSE, DELTA, CU_Q, CU_K, qk_scale, sm_scale, stride_dqt,
        stride_dqh, stride_lh, GROUP, SEQ_BUCKET, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """dQ = sm_scale * sum_j dS_j K_j for a [128, D] query tile, warp-specialized as the forward: a load warp
        (Q and dO halves, then the K / V ring) and two consumer warpgroups of 64 query rows each. A query half that
        sees no key stores dQ = 0."""
        HALF: gl.constexpr = desc_q.block_type.shape[0]
        HEAD_D: gl.constexpr = desc_q.block_type.shape[1]
        dtype: gl.constexpr = desc_q.dtype
        gl.static_assert(BLOCK_M == 2 * HALF)
        start_m, h, q_start, Lq, k_start, Lk, diag = _seq_tile(CU_Q, CU_K)
        if start_m * BLOCK_M >= Lq:
            return
        n_blocks, _ = _key_blocks(start_m * BLOCK_M, BLOCK_M, Lk, diag, BLOCK_N, CAUSAL)

        q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_D], desc_q.layout)
        do_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_D], desc_do.layout)
        k_smem, v_smem, k_ready, v_ready, k_empty, v_empty = _kv_ring(desc_k, desc_v, STAGES)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)

        row0 = start_m * BLOCK_M
        q_col = h * HEAD_D
        kv_col = (h // GROUP) * HEAD_D
        gl.warp_specialize([
            (_dq_consumer, (desc_dq, DQ, LSE, DELTA, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                            v_empty, 0, q_start, row0, Lq, Lk, diag, h, q_col, n_blocks, qk_scale, sm_scale,
                            stride_dqt, stride_dqh, stride_lh, CAUSAL, BLOCK_N, STAGES)),
            (_dq_consumer, (desc_dq, DQ, LSE, DELTA, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                            v_empty, 1, q_start, row0 + HALF, Lq, Lk, diag, h, q_col, n_blocks, qk_scale, sm_scale,
                            stride_dqt, stride_dqh, stride_lh, CAUSAL, BLOCK_N, STAGES)),
            (_dq_loader, (desc_q, desc_do, desc_k, desc_v, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                          k_empty, v_empty, q_start + row0, q_col, k_start, kv_col, n_blocks, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])

    @gluon.jit
    def _rows_stats(LSE, DELTA, t, n_iter, nq, m_lo, hk, GROUP, q_start, Lq, stride_lh, offs_q,
                    BLOCK_M: gl.constexpr):
        """LSE and delta of the dK/dV loop's step t (query head hk * GROUP + t // nq, rows of its query block);
        rows past Lq, and every row of a step past the loop, read LSE = +inf and delta = 0."""
        g = t // gl.maximum(nq, 1)
        h = hk * GROUP + g
        rows = m_lo + (t - g * nq) * BLOCK_M + offs_q
        ok = (rows < Lq) & (t < n_iter)
        lse = gl.load(LSE + h * stride_lh + q_start + rows, mask=ok, other=float("inf"))
        delta = gl.load(DELTA + h * stride_lh + q_start + rows, mask=ok, other=0.0)
        return lse, delta

    @gluon.jit
    def _dkdv_loader(desc_q, desc_do, desc_k, desc_v, q_ring, do_ring, k_smem, v_smem, kv_bar, q_ready, q_empty,
                     k_row, kv_col, q_start, m_lo, nq, hk, GROUP, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """The dK/dV kernel's load partition: both 64-row halves of the K and V tiles, then Q and dO of every query
        block [m_lo, Lq) of every query head of the GQA group, into the ring."""
        HALF: gl.constexpr = desc_k.block_type.shape[0]
        HEAD_D: gl.constexpr = desc_k.block_type.shape[1]
        mbarrier.expect(kv_bar, 4 * desc_k.block_type.nbytes)
        for w in gl.static_range(2):
            tma.async_copy_global_to_shared(desc_k, [k_row + w * HALF, kv_col], kv_bar, k_smem.index(w))
            tma.async_copy_global_to_shared(desc_v, [k_row + w * HALF, kv_col], kv_bar, v_smem.index(w))
        for t in range(GROUP * nq):
            slot = t % STAGES
            g = t // nq
            row = q_start + m_lo + (t - g * nq) * BLOCK_M
            col = (hk * GROUP + g) * HEAD_D
            mbarrier.wait(q_empty.index(slot), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(q_ready.index(slot), 2 * desc_q.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_q, [row, col], q_ready.index(slot), q_ring.index(slot))
            tma.async_copy_global_to_shared(desc_do, [row, col], q_ready.index(slot), do_ring.index(slot))

    @gluon.jit
    def _dkdv_consumer(desc_dk, desc_dv, DK, DV, LSE, DELTA, q_ring, do_ring, k_smem, v_smem, kv_bar, q_ready,
                       q_empty, WG, k_start, key0, Lq, Lk, diag, hk, q_start, m_lo, nq, GROUP, qk_scale, sm_scale,
                       stride_dkt, stride_dkh, stride_lh, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                       STAGES: gl.constexpr):
        """A dK/dV consumer warpgroup: keys key0 + [0, 64). Per query block: S^T = K Q^T and dP^T = V dO^T issued
        together, P^T = exp2(S^T - LSE) while dP^T runs, dV += P^T dO issued, then dS^T = P^T (dP^T - delta) and
        dK += dS^T Q (dV still running); the block's Q / dO slot is released once both have completed."""
        HALF: gl.constexpr = desc_dk.block_type.shape[0]
        HEAD_D: gl.constexpr = desc_dk.block_type.shape[1]
        dtype: gl.constexpr = desc_dk.dtype
        st_layout: gl.constexpr = _mma_layout(BLOCK_M, 4)
        kv_layout: gl.constexpr = _mma_layout(HEAD_D, 4)
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, st_layout)
        keys = key0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
        offs_q = gl.arange(0, BLOCK_M, layout=col_s)
        if CAUSAL:  # query blocks from m_full on see every key of this half: no mask
            m_full = gl.cdiv(gl.maximum(key0 + HALF - 1 - diag, 0), BLOCK_M) * BLOCK_M
        else:
            m_full = 0
        zero_st = gl.zeros([HALF, BLOCK_M], gl.float32, st_layout)
        dk = gl.zeros([HALF, HEAD_D], gl.float32, kv_layout)
        dv = gl.zeros([HALF, HEAD_D], gl.float32, kv_layout)
        k_half = k_smem.index(WG)
        v_half = v_smem.index(WG)
        n_iter = GROUP * nq
        lse, delta = _rows_stats(LSE, DELTA, 0, n_iter, nq, m_lo, hk, GROUP, q_start, Lq, stride_lh, offs_q,
                                 BLOCK_M)
        mbarrier.wait(kv_bar, 0)
        for t in range(n_iter):
            slot = t % STAGES
            g = t // nq
            mb = m_lo + (t - g * nq) * BLOCK_M
            rows = mb + offs_q
            mbarrier.wait(q_ready.index(slot), (t // STAGES) & 1)
            st = warpgroup_mma(k_half, q_ring.index(slot).permute((1, 0)), zero_st, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_half, do_ring.index(slot).permute((1, 0)), zero_st, use_acc=False, is_async=True)
            # the next block's LSE / delta, loaded while this block's products run
            lse_next, delta_next = _rows_stats(LSE, DELTA, t + 1, n_iter, nq, m_lo, hk, GROUP, q_start, Lq,
                                               stride_lh, offs_q, BLOCK_M)
            st = warpgroup_mma_wait(1, deps=(st, ))
            pt = gl.exp2(st * qk_scale - lse[None, :])  # rows past Lq: LSE = +inf, P = 0
            if mb < m_full:
                pt = gl.where(rows[None, :] + diag >= keys[:, None], pt, 0.0)
            pt_op = gl.convert_layout(pt.to(dtype), op_layout)
            dv = warpgroup_mma(pt_op, do_ring.index(slot), dv, is_async=True)
            dpt = warpgroup_mma_wait(1, deps=(dpt, ))  # dP^T done, dV may still run
            dst_op = gl.convert_layout((pt * (dpt - delta[None, :])).to(dtype), op_layout)
            dk = warpgroup_mma(dst_op, q_ring.index(slot), dk, is_async=True)
            # both waited here (see the dQ consumer: nothing left in flight across the back edge)
            dk, dv, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dk, dv, pt_op, dst_op))
            mbarrier.arrive(q_empty.index(slot), count=1)
            lse = lse_next
            delta = delta_next

        dk_out = (dk * sm_scale).to(dtype)
        dv_out = dv.to(dtype)
        # through this half's K and V tiles: every wgmma that read them has completed
        _store_rows(desc_dk, DK, dk_out, k_half, k_start + key0, Lk - key0, hk * HEAD_D, hk, stride_dkt, stride_dkh,
                    kv_layout)
        _store_rows(desc_dv, DV, dv_out, v_half, k_start + key0, Lk - key0, hk * HEAD_D, hk, stride_dkt, stride_dkh,
                    kv_layout)

    @gluon.jit(do_not_specialize=["stride_lh"])
    def _attn_bwd_dkdv_gluon_kernel(
        desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, DK, DV, LSE, DELTA, CU_Q, CU_K, qk_scale, sm_scale,
        stride_dkt, stride_dkh, stride_lh, GROUP, SEQ_BUCKET, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """dK, dV of a [BLOCK_N = 128, D] key tile of one KV head, warp-specialized: a load warp (the K / V halves,
        then Q and dO of each query block of each query head of the group) and two consumer warpgroups of 64 keys
        each sharing every Q / dO tile. Blocks the tile's first half needs and its second does not (left of the
        second half's diagonal) are computed by both, fully masked for the second."""
        HALF: gl.constexpr = desc_k.block_type.shape[0]
        HEAD_D: gl.constexpr = desc_k.block_type.shape[1]
        dtype: gl.constexpr = desc_k.dtype
        gl.static_assert(BLOCK_N == 2 * HALF)
        n0 = gl.program_id(0) * BLOCK_N
        b = gl.program_id(1)
        hk = gl.program_id(2)
        k_start = gl.load(CU_K + b)
        Lk = gl.load(CU_K + b + 1) - k_start
        if n0 >= Lk:
            return
        q_start = gl.load(CU_Q + b)
        Lq = gl.load(CU_Q + b + 1) - q_start
        diag = Lk - Lq
        if CAUSAL:
            m_lo = gl.maximum(n0 - diag, 0) // BLOCK_M * BLOCK_M
        else:
            m_lo = 0
        nq = gl.maximum(gl.cdiv(Lq - m_lo, BLOCK_M), 0)

        q_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], desc_q.layout)
        do_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], desc_do.layout)
        k_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_D], desc_k.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_D], desc_v.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)

        kv_col = hk * HEAD_D
        gl.warp_specialize([
            (_dkdv_consumer, (desc_dk, desc_dv, DK, DV, LSE, DELTA, q_ring, do_ring, k_smem, v_smem, kv_bar, q_ready,
                              q_empty, 0, k_start, n0, Lq, Lk, diag, hk, q_start, m_lo, nq, GROUP, qk_scale, sm_scale,
                              stride_dkt, stride_dkh, stride_lh, CAUSAL, BLOCK_M, STAGES)),
            (_dkdv_consumer, (desc_dk, desc_dv, DK, DV, LSE, DELTA, q_ring, do_ring, k_smem, v_smem, kv_bar, q_ready,
                              q_empty, 1, k_start, n0 + HALF, Lq, Lk, diag, hk, q_start, m_lo, nq, GROUP, qk_scale,
                              sm_scale, stride_dkt, stride_dkh, stride_lh, CAUSAL, BLOCK_M, STAGES)),
            (_dkdv_loader, (desc_q, desc_do, desc_k, desc_v, q_ring, do_ring, k_smem, v_smem, kv_bar, q_ready,
                            q_empty, k_start + n0, kv_col, q_start, m_lo, nq, hk, GROUP, BLOCK_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])

def _is_ws(kwargs: dict) -> bool:
    return "CONSUMER_REGS" in kwargs


def _fit(args: dict) -> None:
    """Autotune pre_hook: each descriptor's block rows follow the config (Q, O: BLOCK_M, or BLOCK_M / 2 for the
    warp-specialized kernels' consumer halves; K, V: BLOCK_N; the dK/dV kernel: Q, dO BLOCK_M, K, V, dK, dV
    BLOCK_N / 2)."""
    if "desc_dk" in args:  # the dK/dV kernel: 64-key halves, whole query blocks
        q_rows, k_rows = args["BLOCK_M"], args["BLOCK_N"] // 2
    else:
        q_rows, k_rows = (args["BLOCK_M"] // 2 if _is_ws(args) else args["BLOCK_M"]), args["BLOCK_N"]
    for name, rows in (("desc_q", q_rows), ("desc_o", q_rows), ("desc_do", q_rows), ("desc_dq", q_rows),
                       ("desc_k", k_rows), ("desc_v", k_rows), ("desc_dk", k_rows), ("desc_dv", k_rows)):
        if name in args:
            args[name].block_shape = [rows, args[name].block_shape[1]]


def _config(bm: int, bn: int, warps: int, stages: int, q_regs: bool = False) -> triton.Config:
    """A candidate of the plain kernel: BLOCK_M x BLOCK_N tiles on ``warps`` warps, a K/V ring of ``stages``."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "STAGES": stages, "Q_REGS": q_regs}, num_warps=warps,
                         pre_hook=_fit)


def _ws_config(bn: int, stages: int, consumer_regs: int = 240, maxnreg: int = 168) -> triton.Config:
    """A candidate of the warp-specialized kernel (128 query rows, two consumer warpgroups and a load warp: 12 warps
    of registers at ``maxnreg``, the load warp's group at 24 and the consumers at ``consumer_regs``)."""
    return triton.Config({"BLOCK_M": 128, "BLOCK_N": bn, "STAGES": stages, "CONSUMER_REGS": consumer_regs},
                         num_warps=4, maxnreg=maxnreg, pre_hook=_fit)


# Candidates per head dim; the first decides the kernel the autotuner chooses among (plain or warp-specialized).
# Shared memory per program: Q [BLOCK_M, D] plus STAGES K and V tiles [BLOCK_N, D] (bf16); 64-row plain tiles on 4
# warps leave room for two programs per SM. d128 measured (H200, K1 forward, ``.devsrc``-free: see bench/RESULTS.md,
# K1): warp-specialized 128 x 128 / 232 registers 1.06-1.11 ms, 128 x 64 1.13-1.17, plain 64 x 64 with Q in
# registers 1.11-1.21, the Triton TMA forward 1.19-1.35 (SDPA cuDNN 1.00-1.07 in the same runs).
CONFIGS = {
    64: [_config(64, 64, 4, 2, True), _config(128, 128, 8, 2), _config(64, 128, 4, 2), _config(128, 64, 8, 3)],
    128: [_ws_config(128, 2, 232), _ws_config(64, 2, 232), _ws_config(128, 2), _config(64, 64, 4, 2, True),
          _config(64, 64, 4, 3, True)],
    256: [_config(64, 64, 4, 2), _config(128, 64, 8, 2), _config(64, 32, 4, 2)],
}


def _dkdv_config(bm: int, stages: int, consumer_regs: int = 240, maxnreg: int = 168) -> triton.Config:
    """A candidate of the dK/dV kernel: 128 keys (two 64-key consumer warpgroups) per program, query blocks of
    ``bm`` rows in a ring of ``stages``."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": 128, "STAGES": stages, "CONSUMER_REGS": consumer_regs},
                         num_warps=4, maxnreg=maxnreg, pre_hook=_fit)


# dK/dV, d128 measured (H200, K1): 32-row query blocks / 3 stages 2.28-2.33 ms, 64 / 2 2.51-2.54 (the Triton TMA
# dK/dV kernel: 2.19). The dQ kernel: 1.32-1.35 ms (Triton's: 1.33).
DKDV_CONFIGS = {
    64: [_dkdv_config(32, 3), _dkdv_config(64, 2)],
    128: [_dkdv_config(32, 3), _dkdv_config(32, 2), _dkdv_config(32, 4)],
}
# The dQ kernel (warp-specialized only): shared memory holds both halves of Q and dO besides the K / V ring.
DQ_CONFIGS = {
    64: [_ws_config(64, 2), _ws_config(128, 2), _ws_config(64, 3)],
    128: [_ws_config(64, 2), _ws_config(64, 3), _ws_config(128, 2)],
}


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str = "fwd") -> str | None:
    """Why the Gluon forward (``kind`` "fwd"), dQ ("dq") or dK/dV ("dkdv") kernel cannot run these inputs (None
    when it can): it needs this Triton's Gluon, an sm_90 GPU, bf16/fp16 and a head_dim of its candidate lists (fwd
    64, 128, 256; dq and dkdv 64, 128) packed as the TMA kernels need it."""
    from areno.kernels.attention_tma import tma_layout_ok

    if not available():
        return f"this triton ({triton.__version__}) has no Gluon Hopper language: {_IMPORT_ERROR}"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "it needs an sm_90 (Hopper) GPU"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"it needs bf16 or fp16 inputs, got {q.dtype}"
    dims = {"dq": DQ_CONFIGS, "dkdv": DKDV_CONFIGS}.get(kind, CONFIGS)
    if q.shape[-1] not in dims:
        return f"it needs head_dim {' / '.join(map(str, dims))}, got {q.shape[-1]}"
    if not tma_layout_ok(q, k, v):
        return "it needs [T, H, D] tensors with heads packed and 16-byte aligned rows"
    return None


def descriptor(t: torch.Tensor, rows: int = 64):
    """``[T, H, D]`` -> Gluon descriptor over the packed ``[T, H * D]`` view, block ``[rows, D]`` (rows set per
    config by ``_fit``); the shared layout is the default swizzle for a D-wide tile, the same for every row count."""
    d = t.shape[2]
    layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl.float16 if t.dtype == torch.float16 else gl.bfloat16)
    return GluonDescriptor(t, [t.shape[0], t.shape[1] * d], [t.stride(0), 1], [rows, d], layout)


@functools.cache
def _tuned(head_dim: int, kind: str):
    """The autotuned kernel of ``kind``: "fwd" (plain), "fwd_ws" (warp-specialized), "dq" or "dkdv"."""
    from areno.kernels.dispatch import autotune_candidates

    if kind == "dq":
        configs, kernel = DQ_CONFIGS[head_dim], _attn_bwd_dq_gluon_kernel
    elif kind == "dkdv":
        configs, kernel = DKDV_CONFIGS[head_dim], _attn_bwd_dkdv_gluon_kernel
    else:
        configs = [c for c in CONFIGS[head_dim] if _is_ws(c.kwargs) == (kind == "fwd_ws")]
        kernel = _attn_fwd_gluon_ws_kernel if kind == "fwd_ws" else _attn_fwd_gluon_kernel
    return triton.autotune(configs=autotune_candidates(configs), key=["SEQ_BUCKET", "CAUSAL", "GROUP"])(kernel)


FORCE_CONFIG: dict = {}  # tests pin one config per kind here ({"fwd", "dq" or "dkdv": triton.Config})


def forward(q, k, v, o, lse, cu_q, cu_k, max_q, seq_bucket, causal, qk_scale):
    """Fill ``o`` ([T, Hq, D], packed) and ``lse`` ([Hq, T], base 2) for packed varlen inputs (``applies`` holds).
    The first candidate of the head dim's list decides the kernel (plain or warp-specialized); the autotuner picks
    among that kernel's candidates."""
    B, Hq, D = cu_q.numel() - 1, q.shape[1], q.shape[2]
    args = (descriptor(q), descriptor(k), descriptor(v), descriptor(o), o, lse, cu_q, cu_k, qk_scale, o.stride(0),
            o.stride(1), lse.stride(0), Hq // k.shape[1], seq_bucket)
    if "fwd" in FORCE_CONFIG:
        kernel = _attn_fwd_gluon_ws_kernel if _is_ws(FORCE_CONFIG["fwd"].kwargs) else _attn_fwd_gluon_kernel
        _launch_forced(kernel, FORCE_CONFIG["fwd"], args, max_q, B, Hq, causal)
        return
    grid = lambda meta: (triton.cdiv(max_q, meta["BLOCK_M"]), B, Hq)  # noqa: E731
    _tuned(D, "fwd_ws" if _is_ws(CONFIGS[D][0].kwargs) else "fwd")[grid](*args, CAUSAL=causal)


def backward_dq(q, k, v, do, dq, lse, delta, cu_q, cu_k, max_q, seq_bucket, causal, qk_scale, sm_scale):
    """Fill ``dq`` ([T, Hq, D], packed, q's dtype) from the forward's base-2 ``lse`` and ``delta`` = rowsum(dO * O)
    (both [Hq, T]) for packed varlen inputs (``applies(..., kind="dq")`` holds)."""
    B, Hq, D = cu_q.numel() - 1, q.shape[1], q.shape[2]
    args = (descriptor(q), descriptor(k), descriptor(v), descriptor(do), descriptor(dq), dq, lse, delta, cu_q, cu_k,
            qk_scale, sm_scale, dq.stride(0), dq.stride(1), lse.stride(0), Hq // k.shape[1], seq_bucket)
    if "dq" in FORCE_CONFIG:
        _launch_forced(_attn_bwd_dq_gluon_kernel, FORCE_CONFIG["dq"], args, max_q, B, Hq, causal)
        return
    grid = lambda meta: (triton.cdiv(max_q, meta["BLOCK_M"]), B, Hq)  # noqa: E731
    _tuned(D, "dq")[grid](*args, CAUSAL=causal)


def backward_dkdv(q, k, v, do, dk, dv, lse, delta, cu_q, cu_k, max_k, seq_bucket, causal, qk_scale, sm_scale):
    """Fill ``dk``, ``dv`` ([T, Hkv, D], packed, k's dtype) as ``backward_dq`` fills dQ."""
    B, Hkv, D = cu_k.numel() - 1, k.shape[1], k.shape[2]
    args = (descriptor(q), descriptor(k), descriptor(v), descriptor(do), descriptor(dk), descriptor(dv), dk, dv, lse,
            delta, cu_q, cu_k, qk_scale, sm_scale, dk.stride(0), dk.stride(1), lse.stride(0), q.shape[1] // Hkv,
            seq_bucket)
    if "dkdv" in FORCE_CONFIG:
        _launch_forced(_attn_bwd_dkdv_gluon_kernel, FORCE_CONFIG["dkdv"], args, max_k, B, Hkv, causal, "BLOCK_N")
        return
    grid = lambda meta: (triton.cdiv(max_k, meta["BLOCK_N"]), B, Hkv)  # noqa: E731
    _tuned(D, "dkdv")[grid](*args, CAUSAL=causal)


def _launch_forced(kernel, cfg: triton.Config, args: tuple, rows: int, B: int, H: int, causal: bool,
                   tile: str = "BLOCK_M") -> None:
    named = dict(zip(kernel.arg_names, args))
    _fit({**named, **cfg.kwargs})
    grid = (triton.cdiv(rows, cfg.kwargs[tile]), B, H)
    kernel[grid](*args, CAUSAL=causal, **cfg.kwargs, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg)


def compile_sm90(cfg: triton.Config, head_dim: int = 128, causal: bool = True, dtype: str = "bf16",
                 kind: str = "fwd"):
    """Compile a kernel (``kind``: "fwd", or "dq" for the dQ kernel) for sm_90 without a GPU (CPU tests, offline
    inspection): the CompiledKernel, with its ``asm["ptx"]`` and ``metadata.shared``."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    ws = _is_ws(cfg.kwargs)
    bm, bn = cfg.kwargs["BLOCK_M"] // (2 if ws else 1), cfg.kwargs["BLOCK_N"]
    if kind == "dkdv":
        bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"] // 2
    gdt = gl.bfloat16 if dtype == "bf16" else gl.float16
    lay = {r: gl.NVMMASharedLayout.get_default_for([r, head_dim], gdt) for r in (bm, bn)}
    desc = {r: f"tensordesc<{dtype}[{r}, {head_dim}],{lay[r]!r}>" for r in (bm, bn)}
    if kind == "dkdv":
        kernel = _attn_bwd_dkdv_gluon_kernel
        sig = {"desc_q": desc[bm], "desc_k": desc[bn], "desc_v": desc[bn], "desc_do": desc[bm], "desc_dk": desc[bn],
               "desc_dv": desc[bn], "DK": f"*{dtype}", "DV": f"*{dtype}", "LSE": "*fp32", "DELTA": "*fp32",
               "CU_Q": "*i32", "CU_K": "*i32", "qk_scale": "fp32", "sm_scale": "fp32", "stride_dkt": "i32",
               "stride_dkh": "i32", "stride_lh": "i32"}
    elif kind == "dq":
        kernel = _attn_bwd_dq_gluon_kernel
        sig = {"desc_q": desc[bm], "desc_k": desc[bn], "desc_v": desc[bn], "desc_do": desc[bm], "desc_dq": desc[bm],
               "DQ": f"*{dtype}", "LSE": "*fp32", "DELTA": "*fp32", "CU_Q": "*i32", "CU_K": "*i32",
               "qk_scale": "fp32", "sm_scale": "fp32", "stride_dqt": "i32", "stride_dqh": "i32", "stride_lh": "i32"}
    else:
        kernel = _attn_fwd_gluon_ws_kernel if ws else _attn_fwd_gluon_kernel
        sig = {"desc_q": desc[bm], "desc_k": desc[bn], "desc_v": desc[bn], "desc_o": desc[bm], "O": f"*{dtype}",
               "LSE": "*fp32", "CU_Q": "*i32", "CU_K": "*i32", "qk_scale": "fp32", "stride_ot": "i32",
               "stride_oh": "i32", "stride_lh": "i32"}
    sig.update({"GROUP": "i32", "SEQ_BUCKET": "i32", "CAUSAL": "constexpr"})
    sig.update({name: "constexpr" for name in cfg.kwargs})
    sig["num_warps"] = "constexpr"
    consts = {"CAUSAL": causal, **cfg.kwargs, "num_warps": cfg.num_warps}
    options = {"num_warps": cfg.num_warps, "maxnreg": cfg.maxnreg}
    return triton.compile(GluonASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32), options=options)

"""Hopper (sm_90) attention kernels written in Gluon (``triton.experimental.gluon``): the forward
(``attention(_fwd="gluon")``) and the single-pass backward (``_bwd="gluon"``), the sm_90 defaults.

Same math, packed varlen layout, causal block split and outputs (O, base-2 LSE; dQ, dK, dV) as the TMA kernels in
``tma.py``; what Gluon adds is control over the order of the asynchronous work, which the Triton compiler
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
- single-pass backward (``_attn_bwd_gluon_kernel``, d128), FlashAttention-3's: a 128-key tile of one KV head, one
  load warp streaming K / V once, then Q, dO and the rows' LSE and delta of every query block of every query head of
  the GQA group; two consumer warpgroups of 64 keys each: S^T, dP^T issued together, P^T under dP^T, dV += P^T dO,
  dS^T = P^T (dP^T - delta), dK += dS^T Q; both dS^T halves meet in shared memory (an mbarrier per step), and each
  warpgroup forms half the head dims of dQ^T = K^T dS^T and adds it into an fp32 dQ accumulator by a TMA reduce
  (``cp.reduce.async.bulk.tensor``), which runs under the next step's products. Five products per (query block,
  key tile) where the Triton backward's two kernels take seven. Each step's products are waited for inside the step:
  a wgmma left in flight across a loop's back edge makes ptxas serialise every wgmma of the kernel ("insufficient
  register resources").

Masking, bounds and the rows past a sequence's end are handled as in the TMA kernels (see ``tma.py``): one
descriptor over the packed ``[T, H * D]`` view, key blocks at or past ``full`` masked (keys past Lk, causal), query
rows past Lq computed and not stored, key rows past Lk not stored; in the backward, P = 0 for query rows past Lq
(their Q and dO tiles hold the next sequence's rows; their LSE loads as +inf) and, by mask, for key rows past Lk
(their dS would reach dQ).
A forward query tile that sees no key at all (Lk == 0, or causal with Lq > Lk) runs one fully masked block: O = 0,
LSE = +inf.

Gluon compiles only for a GPU (no ``TRITON_INTERPRET``): the CPU tests compile every candidate offline for sm_90
(``compile_sm90``) and check the PTX's asynchronous structure; the GPU tests compare each with float64. Needs a Triton
with Gluon's Hopper module (3.5+; the device's 3.6 and the CPU's 3.7 agree on what is used here): ``available()``
says whether this one has it, ``applies()`` why a kernel cannot take given inputs, in which case ``packed.py``
runs the TMA kernels instead.
"""

from __future__ import annotations

import functools

import torch
import triton

from areno.kernels._device import capability

try:  # Gluon is experimental: older Tritons lack it, and its API moves between releases
    from triton._C.libtriton import ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    # a barrier of the calling partition's warps (bar.sync with its own id inside warp_specialize): 3.6 names it
    # thread_barrier, 3.7 barrier
    _wg_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

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

    @gluon.constexpr_function
    def _shared_layout(rows, cols, bits):
        """The default NVMMA shared layout (wgmma operand / TMA tile) of a [rows, cols] tile of ``bits``-bit
        elements."""
        return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16 if bits == 16 else gl.float32)

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


    @builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """Start an asynchronous bulk add of shared-memory tile ``src`` into ``tensor_desc`` at ``coord`` (PTX
        ``cp.reduce.async.bulk.tensor .add``; completes like a TMA store: ``tma.store_wait``). Triton's Gluon
        builder has the op; its Python module does not wrap it (3.6, 3.7)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    @gluon.jit
    def _bwd_loader(desc_q, desc_do, desc_k, desc_v, LSE, DELTA, q_ring, do_ring, lse_ring, delta_ring, k_smem,
                    v_smem, kv_bar, q_ready, q_empty, k_row, kv_col, q_start, Lq, m_lo, nq, hk, GROUP, stride_lh,
                    BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """The single-pass backward's load partition (one warp): both 64-key halves of the K and V tiles, then per
        step Q and dO by TMA and the rows' LSE and delta (rows past Lq: +inf and 0) by loads into shared memory (a
        TMA box of the [Hq, T] tensors would start at any row, and TMA needs 16-byte aligned inner coordinates), of
        every query block [m_lo, Lq) of every query head of the GQA group, into the ring. The warp's stores are
        published by the same arrive as the TMA's bytes."""
        HALF: gl.constexpr = desc_k.block_type.shape[0]
        HEAD_D: gl.constexpr = desc_k.block_type.shape[1]
        rows_layout: gl.constexpr = gl.BlockedLayout([1, BLOCK_M // 32], [1, 32], [1, 1], [1, 0])
        offs = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, rows_layout))[None, :]
        mbarrier.expect(kv_bar, 4 * desc_k.block_type.nbytes)
        for w in gl.static_range(2):
            tma.async_copy_global_to_shared(desc_k, [k_row + w * HALF, kv_col], kv_bar, k_smem.index(w))
            tma.async_copy_global_to_shared(desc_v, [k_row + w * HALF, kv_col], kv_bar, v_smem.index(w))
        for t in range(GROUP * nq):
            slot = t % STAGES
            g = t // nq
            row = q_start + m_lo + (t - g * nq) * BLOCK_M
            h = hk * GROUP + g
            bar = q_ready.index(slot)
            ok = row - q_start + offs < Lq
            lse = gl.load(LSE + h * stride_lh + row + offs, mask=ok, other=float("inf"))
            delta = gl.load(DELTA + h * stride_lh + row + offs, mask=ok, other=0.0)
            mbarrier.wait(q_empty.index(slot), ((t // STAGES) & 1) ^ 1)
            lse_ring.index(slot).store(lse)
            delta_ring.index(slot).store(delta)
            _wg_barrier()  # every lane's stores before the (single-thread) arrive that publishes them
            mbarrier.expect(bar, 2 * desc_q.block_type.nbytes)
            tma.async_copy_global_to_shared(desc_q, [row, h * HEAD_D], bar, q_ring.index(slot))
            tma.async_copy_global_to_shared(desc_do, [row, h * HEAD_D], bar, do_ring.index(slot))

    @gluon.jit
    def _bwd_consumer(desc_dk, desc_dv, desc_dqa, DK, DV, q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem,
                      ds_smem, dq_smem, kv_bar, q_ready, q_empty, ds_bar, end_bar, WG, k_start, key0, Lq, Lk, diag,
                      hk, q_start, m_lo, nq, GROUP, qk_scale, sm_scale, stride_dkt, stride_dkh, CAUSAL: gl.constexpr,
                      BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """A consumer warpgroup of the single-pass backward: keys key0 + [0, 64). Per query block: S^T = K Q^T and
        dP^T = V dO^T issued together, P^T under dP^T, dV += P^T dO, dS^T = P^T (dP^T - delta), dK += dS^T Q; dS^T
        also goes to shared memory, where, once the other warpgroup's half is there too (``ds_bar``), this
        warpgroup forms its half of the head dims of dQ^T = K^T dS^T over all 128 keys and adds it into the fp32
        dQ accumulator by a TMA reduce."""
        HALF: gl.constexpr = desc_dk.block_type.shape[0]
        HEAD_D: gl.constexpr = desc_dk.block_type.shape[1]
        DQ_COLS: gl.constexpr = desc_dqa.block_type.shape[1]
        dtype: gl.constexpr = desc_dk.dtype
        st_layout: gl.constexpr = _mma_layout(BLOCK_M, 4)
        kv_layout: gl.constexpr = _mma_layout(HEAD_D, 4)
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        keys = key0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
        offs_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        if CAUSAL:  # query blocks from m_full on see every key of this half
            m_full = gl.cdiv(gl.maximum(key0 + HALF - 1 - diag, 0), BLOCK_M) * BLOCK_M
        else:
            m_full = 0
        keys_past = key0 + HALF > Lk  # this half holds rows past the sequence's keys: masked everywhere
        zero_st = gl.zeros([HALF, BLOCK_M], gl.float32, st_layout)
        dk = gl.zeros([HALF, HEAD_D], gl.float32, kv_layout)
        dv = gl.zeros([HALF, HEAD_D], gl.float32, kv_layout)
        k_half = k_smem.index(WG)
        v_half = v_smem.index(WG)
        # this warpgroup's dQ head dims, as the wgmma A operand K^T [DQ_COLS, 64 keys] of each key half
        kt0 = k_smem.index(0).permute((1, 0)).slice(WG * DQ_COLS, DQ_COLS, dim=0)
        kt1 = k_smem.index(1).permute((1, 0)).slice(WG * DQ_COLS, DQ_COLS, dim=0)
        n_iter = GROUP * nq
        mbarrier.wait(kv_bar, 0)
        for t in range(n_iter):
            slot = t % STAGES
            buf = t % 2
            g = t // nq
            mb = m_lo + (t - g * nq) * BLOCK_M
            rows = mb + offs_q
            mbarrier.wait(q_ready.index(slot), (t // STAGES) & 1)
            st = warpgroup_mma(k_half, q_ring.index(slot).permute((1, 0)), zero_st, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_half, do_ring.index(slot).permute((1, 0)), zero_st, use_acc=False, is_async=True)
            lse = lse_ring.index(slot).load(st_layout)  # [1, BLOCK_M]
            st = warpgroup_mma_wait(1, deps=(st, ))
            pt = gl.exp2(st * qk_scale - lse)
            if (mb < m_full) | keys_past:  # (rows past Lq need no mask: their LSE is +inf, P = 0)
                keep = keys[:, None] < Lk
                if CAUSAL:
                    keep = keep & (rows[None, :] + diag >= keys[:, None])
                pt = gl.where(keep, pt, 0.0)
            pt_op = gl.convert_layout(pt.to(dtype), op_layout)
            dv = warpgroup_mma(pt_op, do_ring.index(slot), dv, is_async=True)
            delta = delta_ring.index(slot).load(st_layout)
            dpt = warpgroup_mma_wait(1, deps=(dpt, ))  # dP^T done, dV may still run
            dst = (pt * (dpt - delta)).to(dtype)
            ds_smem.index(2 * buf + WG).store(dst)
            dst_op = gl.convert_layout(dst, op_layout)
            dk = warpgroup_mma(dst_op, q_ring.index(slot), dk, is_async=True)
            # both halves of dS^T in shared memory: this one's stores visible to the async proxy, then the hand-off
            fence_async_shared()
            _wg_barrier()
            mbarrier.arrive(ds_bar.index(buf), count=1)
            mbarrier.wait(ds_bar.index(buf), (t // 2) & 1)
            dqt = warpgroup_mma(kt0, ds_smem.index(2 * buf), zero_st, use_acc=False, is_async=True)
            dqt = warpgroup_mma(kt1, ds_smem.index(2 * buf + 1), dqt, is_async=True)
            dk, dv, pt_op, dst_op, dqt = warpgroup_mma_wait(0, deps=(dk, dv, pt_op, dst_op, dqt))
            mbarrier.arrive(q_empty.index(slot), count=1)
            tma.store_wait(0)  # the previous step's reduce has read dq_smem
            _wg_barrier()
            dq_smem.permute((1, 0)).store(dqt * sm_scale)
            fence_async_shared()
            _wg_barrier()
            _tma_reduce_add(desc_dqa, [q_start + mb, (hk * GROUP + g) * HEAD_D + WG * DQ_COLS], dq_smem)
        tma.store_wait(0)

        # dV through this half's V tile (read only by this warpgroup); dK through the K tile once the other
        # warpgroup's last dQ^T product (which reads both K halves) has completed
        _store_rows(desc_dv, DV, dv.to(dtype), v_half, k_start + key0, Lk - key0, hk * HEAD_D, hk, stride_dkt,
                    stride_dkh, kv_layout)
        mbarrier.arrive(end_bar, count=1)
        mbarrier.wait(end_bar, 0)
        _store_rows(desc_dk, DK, (dk * sm_scale).to(dtype), k_half, k_start + key0, Lk - key0, hk * HEAD_D, hk,
                    stride_dkt, stride_dkh, kv_layout)

    @gluon.jit(do_not_specialize=["stride_lh"])
    def _attn_bwd_gluon_kernel(
        desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, desc_dqa, DK, DV, DQA, LSE, DELTA, CU_Q, CU_K, qk_scale,
        sm_scale, stride_dkt, stride_dkh, stride_lh, GROUP, SEQ_BUCKET, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """The single-pass backward (FlashAttention-3's): dK, dV of a [BLOCK_N = 128, D] key tile of one KV head and
        its share of every dQ row block, added into an fp32 accumulator (zeroed beforehand) by TMA reduces; five
        products per (query block, key tile) instead of the Triton backward's seven. Warp-specialized: a load warp
        and two consumer warpgroups of 64 keys each, which meet once per step to share dS^T for dQ."""
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
        lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], _ROWS_SMEM)
        delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], _ROWS_SMEM)
        k_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_D], desc_k.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_D], desc_v.layout)
        ds_smem = gl.allocate_shared_memory(dtype, [4, HALF, BLOCK_M], _shared_layout(HALF, BLOCK_M, 16))
        dq_smem0 = gl.allocate_shared_memory(gl.float32, desc_dqa.block_type.shape, desc_dqa.layout)
        dq_smem1 = gl.allocate_shared_memory(gl.float32, desc_dqa.block_type.shape, desc_dqa.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        end_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        mbarrier.init(end_bar, count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(ds_bar.index(i), count=2)

        kv_col = hk * HEAD_D
        gl.warp_specialize([
            (_bwd_consumer, (desc_dk, desc_dv, desc_dqa, DK, DV, q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem,
                             ds_smem, dq_smem0, kv_bar, q_ready, q_empty, ds_bar, end_bar, 0, k_start, n0, Lq, Lk,
                             diag, hk, q_start, m_lo, nq, GROUP, qk_scale, sm_scale, stride_dkt, stride_dkh, CAUSAL,
                             BLOCK_M, STAGES)),
            (_bwd_consumer, (desc_dk, desc_dv, desc_dqa, DK, DV, q_ring, do_ring, lse_ring, delta_ring, k_smem, v_smem,
                             ds_smem, dq_smem1, kv_bar, q_ready, q_empty, ds_bar, end_bar, 1, k_start, n0 + HALF, Lq,
                             Lk, diag, hk, q_start, m_lo, nq, GROUP, qk_scale, sm_scale, stride_dkt, stride_dkh,
                             CAUSAL, BLOCK_M, STAGES)),
            (_bwd_loader, (desc_q, desc_do, desc_k, desc_v, LSE, DELTA, q_ring, do_ring, lse_ring, delta_ring, k_smem,
                           v_smem, kv_bar, q_ready, q_empty, k_start + n0, kv_col, q_start, Lq, m_lo, nq, hk, GROUP,
                           stride_lh, BLOCK_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])


def _is_ws(kwargs: dict) -> bool:
    return "CONSUMER_REGS" in kwargs


def _fit(args: dict) -> None:
    """Autotune pre_hook: each descriptor's block rows follow the config (Q, O: BLOCK_M, or BLOCK_M / 2 for the
    warp-specialized forward's consumer halves; K, V: BLOCK_N; the backward: Q, dO BLOCK_M, K, V, dK, dV
    BLOCK_N / 2, the dQ accumulator's tiles BLOCK_M rows)."""
    if "desc_dqa" in args:  # the single-pass backward: dQ tiles follow BLOCK_M
        args["desc_dqa"].block_shape = [args["BLOCK_M"], args["desc_dqa"].block_shape[1]]
    if "desc_dk" in args:  # the backward: 64-key halves, whole query blocks
        q_rows, k_rows = args["BLOCK_M"], args["BLOCK_N"] // 2
    else:
        q_rows, k_rows = (args["BLOCK_M"] // 2 if _is_ws(args) else args["BLOCK_M"]), args["BLOCK_N"]
    for name, rows in (("desc_q", q_rows), ("desc_o", q_rows), ("desc_do", q_rows),
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


def _bwd_config(bm: int, stages: int, consumer_regs: int = 240, maxnreg: int = 168) -> triton.Config:
    """A candidate of the single-pass backward: 128 keys (two 64-key consumer warpgroups) per program, query blocks
    of ``bm`` rows in a ring of ``stages``."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": 128, "STAGES": stages, "CONSUMER_REGS": consumer_regs},
                         num_warps=4, maxnreg=maxnreg, pre_hook=_fit)


# The single-pass backward, d128 only: each consumer forms dQ^T for half the head dims, a wgmma M of 64 (d64 would
# need 32). Measured (H200, K1, whole backward with delta and the dQ cast): 64-row query blocks / 2 stages 3.01-3.03
# ms, 32 / 3 3.41-3.48, 32 / 2 3.34-3.44 (the merged Triton backward 3.83, SDPA cuDNN's 3.08-3.35 in the same runs).
BWD_CONFIGS = {
    128: [_bwd_config(64, 2), _bwd_config(32, 3), _bwd_config(32, 2)],
}


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str = "fwd") -> str | None:
    """Why the Gluon forward (``kind`` "fwd") or backward ("bwd") kernel cannot run these inputs (None
    when it can): it needs this Triton's Gluon, an sm_90 GPU, bf16/fp16 and a head_dim of its candidate lists (fwd
    64, 128, 256; bwd 128) packed as the TMA kernels need it."""
    from areno.kernels.attention.tma import tma_layout_ok

    if not available():
        return f"this triton ({triton.__version__}) has no Gluon Hopper language: {_IMPORT_ERROR}"
    if not q.is_cuda or capability(q.device)[0] != 9:
        return "it needs an sm_90 (Hopper) GPU"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"it needs bf16 or fp16 inputs, got {q.dtype}"
    dims = BWD_CONFIGS if kind == "bwd" else CONFIGS
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
    """The autotuned kernel of ``kind``: "fwd" (plain), "fwd_ws" (warp-specialized) or "bwd"."""
    from areno.kernels.dispatch import autotune_candidates

    if kind == "bwd":
        configs, kernel = BWD_CONFIGS[head_dim], _attn_bwd_gluon_kernel
        return triton.autotune(configs=autotune_candidates(configs), key=["SEQ_BUCKET", "CAUSAL", "GROUP"],
                               reset_to_zero=["DQA"])(kernel)
    configs = [c for c in CONFIGS[head_dim] if _is_ws(c.kwargs) == (kind == "fwd_ws")]
    kernel = _attn_fwd_gluon_ws_kernel if kind == "fwd_ws" else _attn_fwd_gluon_kernel
    return triton.autotune(configs=autotune_candidates(configs), key=["SEQ_BUCKET", "CAUSAL", "GROUP"])(kernel)


FORCE_CONFIG: dict = {}  # tests pin one config per kind here ({"fwd" or "bwd": triton.Config})


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


def backward(q, k, v, do, dqa, dk, dv, lse, delta, cu_q, cu_k, max_k, seq_bucket, causal, qk_scale, sm_scale):
    """The single-pass backward: fill ``dk``, ``dv`` ([T, Hkv, D], packed, k's dtype) and add sm_scale * dQ into
    ``dqa`` ([T, Hq, D] fp32, zeroed by the caller) from the forward's base-2 ``lse`` and ``delta`` = rowsum(dO * O)
    (both [Hq, T], the same row stride) for packed varlen inputs (``applies(..., kind="bwd")`` holds)."""
    B, Hq, Hkv, D = cu_k.numel() - 1, q.shape[1], k.shape[1], k.shape[2]
    assert lse.stride() == delta.stride() and lse.stride(1) == 1, "lse and delta need the same [Hq, T] layout"
    acc = GluonDescriptor(dqa, [dqa.shape[0], Hq * D], [dqa.stride(0), 1], [64, D // 2], _dq_layout(64, D))
    args = (descriptor(q), descriptor(k), descriptor(v), descriptor(do), descriptor(dk), descriptor(dv), acc, dk, dv,
            dqa, lse, delta, cu_q, cu_k, qk_scale, sm_scale, dk.stride(0), dk.stride(1), lse.stride(0), Hq // Hkv,
            seq_bucket)
    if "bwd" in FORCE_CONFIG:
        _launch_forced(_attn_bwd_gluon_kernel, FORCE_CONFIG["bwd"], args, max_k, B, Hkv, causal, "BLOCK_N")
        return
    grid = lambda meta: (triton.cdiv(max_k, meta["BLOCK_N"]), B, Hkv)  # noqa: E731
    _tuned(D, "bwd")[grid](*args, CAUSAL=causal)


def _launch_forced(kernel, cfg: triton.Config, args: tuple, rows: int, B: int, H: int, causal: bool,
                   tile: str = "BLOCK_M") -> None:
    named = dict(zip(kernel.arg_names, args))
    _fit({**named, **cfg.kwargs})
    grid = (triton.cdiv(rows, cfg.kwargs[tile]), B, H)
    kernel[grid](*args, CAUSAL=causal, **cfg.kwargs, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg)


def compile_sm90(cfg: triton.Config, head_dim: int = 128, causal: bool = True, dtype: str = "bf16",
                 kind: str = "fwd"):
    """Compile a kernel (``kind``: "fwd", or "bwd", the single-pass backward) for sm_90 without a GPU
    (CPU tests, offline inspection): the CompiledKernel, with its ``asm["ptx"]`` and ``metadata.shared``."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    ws = _is_ws(cfg.kwargs)
    bm, bn = cfg.kwargs["BLOCK_M"] // (2 if ws else 1), cfg.kwargs["BLOCK_N"]
    if kind == "bwd":
        bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"] // 2
    gdt = gl.bfloat16 if dtype == "bf16" else gl.float16
    lay = {r: gl.NVMMASharedLayout.get_default_for([r, head_dim], gdt) for r in (bm, bn)}
    desc = {r: f"tensordesc<{dtype}[{r}, {head_dim}],{lay[r]!r}>" for r in (bm, bn)}
    if kind == "bwd":
        kernel = _attn_bwd_gluon_kernel
        dqa = f"tensordesc<fp32[{bm}, {head_dim // 2}],{_dq_layout(bm, head_dim)!r}>"
        sig = {"desc_q": desc[bm], "desc_k": desc[bn], "desc_v": desc[bn], "desc_do": desc[bm], "desc_dk": desc[bn],
               "desc_dv": desc[bn], "desc_dqa": dqa, "DK": f"*{dtype}", "DV": f"*{dtype}", "DQA": "*fp32",
               "LSE": "*fp32", "DELTA": "*fp32", "CU_Q": "*i32", "CU_K": "*i32", "qk_scale": "fp32",
               "sm_scale": "fp32", "stride_dkt": "i32", "stride_dkh": "i32", "stride_lh": "i32"}
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


# The single-pass backward's row statistics (LSE, delta) sit in shared memory as [1, BLOCK_M] rows, unswizzled; its
# dQ accumulator ([T, Hq * D] fp32) takes [BLOCK_M, D / 2] tiles, one per consumer.
_ROWS_SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2) if available() else None


def _dq_layout(bm: int, head_dim: int):
    return gl.NVMMASharedLayout.get_default_for([bm, head_dim // 2], gl.float32)

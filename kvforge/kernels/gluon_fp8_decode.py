"""Paged decode attention over an fp8 KV cache, written in Gluon (Triton's explicit-layout dialect).

Why not ``tl.dot``: for ``P V`` the token axis of V is the reduction axis, and Hopper has no 8-bit
transposing shared-memory load, so Triton reads the staged fp8 V tile byte by byte and spends
more instructions per token than the bf16 kernel. Gluon lets these
kernels pick every layout. Both copy raw fp8 K/V tiles into a ``NUM_STAGES`` ring of shared buffers
with ``cp.async`` (zero-filled past the context end), read K straight into the ``mma`` B-operand
layout (head_dim, its reduction axis, is contiguous), convert fp8 -> fp16 in registers and run
``mma_v2`` with fp16 operands. The softmax scale, log2(e) and ``k_scale`` are folded into one
factor that multiplies the float32 scores; ``v_scale`` multiplies the accumulator once.

* ``_gluon_fp8_decode_warp_kernel`` ("warp": large grids at any context with one warp a program,
  long contexts on smaller grids with four): each warp owns ``WT`` tokens of
  every ``NUM_WARPS * WT``-token tile and keeps its own online-softmax state. Its ``[16, D]``
  accumulator is one slice of a rank-3 batched ``mma``. No cross-warp traffic happens per tile;
  the warps merge once at the end. With one warp per program (the routing table's row for large
  grids, ``tiling`` ``warps=1``) there is nothing to merge and no warp waits for another.
* ``_gluon_fp8_decode_kernel`` ("cta", the other batches: short contexts on small grids): the warps
  split the tile's tokens for ``Q K^T`` and head_dim for ``P V``. V is staged as fp16 for ``ldmatrix.trans``.
  Cheaper per program, dearer per tile.

Which of the two runs, in which configuration (a row's ``tiling``), with how many splits, and which
calls come here at all is the Triton paged backend's routing table
(:mod:`kvforge.attention.routing.paged`): decode only (one query token per sequence), fp8 e4m3/e5m2
cache, bf16/fp16 query, head size 64/128/256, at most 16 query heads per KV head (the rows of the 16-row
``mma`` tile; rows >= G are masked), the Gluon gate open. Block sizes: any multiple of 16. Split-K
partials use the layout of :mod:`kvforge.kernels.triton_paged_attention` and its merge kernel.

Invariants: K/V bytes of tokens past a program's context end are zero-filled, because an fp8
byte pattern can be NaN and ``0 * NaN`` would poison ``P V``. Every offset that multiplies a
block id or a token row is int64. The query is rounded to fp16, which assumes ``|q| < 65504``.
Sequences with no new token this step are skipped. The warp kernel's grid may walk the sequences
through a permutation (``order_ptr``, longest context first); without split-K the values do not
depend on it, with split-K its first sequence sizes the chunks (every token stays in its splits).
"""

from __future__ import annotations

from kvforge.kernels.gluon_support import HAS_GLUON, async_copy, gl, gluon, mma_v2

if HAS_GLUON:

    @gluon.jit
    def _issue_tile(
        k_buf,
        v_buf,
        kv_base,
        bt_row,
        start,
        hi,
        stride_cb,
        stride_ckv,
        stride_cs,
        BLOCK_SIZE: gl.constexpr,
        TILE_N: gl.constexpr,
        HEAD_D: gl.constexpr,
        COPY_LAYOUT: gl.constexpr,
    ):
        """Start the async copies of tokens ``start .. start+TILE_N-1`` (zero past ``hi``)."""
        n = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, COPY_LAYOUT))
        d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, COPY_LAYOUT))
        pos = start + n
        ok = pos < hi
        blk = gl.load(bt_row + pos // BLOCK_SIZE, mask=ok, other=0).to(gl.int64)
        row = blk * stride_cb + (pos % BLOCK_SIZE).to(gl.int64) * stride_cs
        off = row[:, None] + d[None, :]
        mask = ok[:, None] & (d < HEAD_D)[None, :]
        async_copy.async_copy_global_to_shared(k_buf, kv_base + off, mask=mask)
        async_copy.async_copy_global_to_shared(v_buf, kv_base + stride_ckv + off, mask=mask)
        async_copy.commit_group()

    @gluon.jit(do_not_specialize=["num_splits", "stride_bt"])
    def _gluon_fp8_decode_kernel(
        q_ptr,
        kv_ptr,
        out_ptr,
        part_acc_ptr,
        part_ml_ptr,
        qsl_ptr,
        seq_lens_ptr,
        bt_ptr,
        k_scale_ptr,
        v_scale_ptr,
        qk_scale_log2,
        window,
        num_splits,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_cb,
        stride_ckv,
        stride_ch,
        stride_cs,
        stride_bt,
        NUM_Q_HEADS: gl.constexpr,
        G: gl.constexpr,
        HEAD_D: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
        TILE_N: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        USE_SPLIT: gl.constexpr,
        USE_WINDOW: gl.constexpr,
        COPY_THREADS_D: gl.constexpr,
    ):
        M: gl.constexpr = 16
        NW: gl.constexpr = gl.num_warps()
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8]
        )
        # k_width 4: the K operand arrives as fp8 (4 per 32 bits) and is upcast in place; the query
        # operand must use the same k order.
        Q_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
        K_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
        P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        V_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        COPY: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, 16],
            threads_per_warp=[32 // COPY_THREADS_D, COPY_THREADS_D],
            warps_per_cta=[NW, 1],
            order=[1, 0],
        )
        ROW16: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, 8], threads_per_warp=[1, 32], warps_per_cta=[NW, 1], order=[1, 0]
        )
        RAW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
        V16_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])

        seq = gl.program_id(0)
        kvh = gl.program_id(1)
        split = gl.program_id(2)
        tok = gl.load(qsl_ptr + seq)
        if gl.load(qsl_ptr + seq + 1) <= tok:
            return  # no new token for this sequence this step (allowed by the metadata contract)
        seq_len = gl.load(seq_lens_ptr + seq)

        # The query rows: the G heads of this KV head, padded to 16.
        g = gl.arange(0, M, layout=gl.SliceLayout(1, ROW16))
        dq = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ROW16))
        qh = (kvh * G + g).to(gl.int64)
        q = gl.load(
            q_ptr + tok.to(gl.int64) * stride_qt + qh[:, None] * stride_qh + dq[None, :],
            mask=(g < G)[:, None] & (dq < HEAD_D)[None, :],
            other=0.0,
        )
        q_op = gl.convert_layout(q.to(gl.float16), Q_OP)
        qk_scale = qk_scale_log2 * gl.load(k_scale_ptr + kvh)

        hi = seq_len
        lo = 0
        if USE_WINDOW:
            lo = gl.maximum(seq_len - window, 0)
        if USE_SPLIT:
            chunk = gl.cdiv(gl.cdiv(hi - lo, num_splits), TILE_N) * TILE_N
            lo = lo + split * chunk
            hi = gl.minimum(lo + chunk, hi)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), TILE_N)

        k_ring = gl.allocate_shared_memory(kv_ptr.dtype.element_ty, [NUM_STAGES, TILE_N, HEAD_D], RAW_SMEM)
        v_ring = gl.allocate_shared_memory(kv_ptr.dtype.element_ty, [NUM_STAGES, TILE_N, HEAD_D], RAW_SMEM)
        v16 = gl.allocate_shared_memory(gl.float16, [2, TILE_N, HEAD_D], V16_SMEM)

        kv_base = kv_ptr + kvh.to(gl.int64) * stride_ch
        bt_row = bt_ptr + seq.to(gl.int64) * stride_bt
        for j in gl.static_range(NUM_STAGES - 1):
            _issue_tile(
                k_ring.index(j),
                v_ring.index(j),
                kv_base,
                bt_row,
                lo + j * TILE_N,
                hi,
                stride_cb,
                stride_ckv,
                stride_cs,
                BLOCK_SIZE,
                TILE_N,
                HEAD_D,
                COPY,
            )

        m_i = gl.full([M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
        l_i = gl.zeros([M], gl.float32, layout=gl.SliceLayout(1, MMA))
        acc = gl.zeros([M, HEAD_D], gl.float32, layout=MMA)
        n_off = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, MMA))
        for i in range(num_tiles):
            stage = i % NUM_STAGES
            async_copy.wait_group(NUM_STAGES - 2)
            gl.thread_barrier()  # every thread's copies of tile i landed; tile i-1's buffer is free
            nxt = i + NUM_STAGES - 1
            _issue_tile(
                k_ring.index(nxt % NUM_STAGES),
                v_ring.index(nxt % NUM_STAGES),
                kv_base,
                bt_row,
                lo + nxt * TILE_N,
                hi,
                stride_cb,
                stride_ckv,
                stride_cs,
                BLOCK_SIZE,
                TILE_N,
                HEAD_D,
                COPY,
            )
            start = lo + i * TILE_N

            k_op = k_ring.index(stage).permute((1, 0)).load(K_OP).to(gl.float16)
            s = mma_v2(q_op, k_op, gl.zeros([M, TILE_N], gl.float32, layout=MMA))
            s = s * qk_scale
            s = gl.where((start + n_off < hi)[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new

            v_rows = v_ring.index(stage).load(ROW16).to(gl.float16)
            v16.index(i % 2).store(v_rows)
            gl.thread_barrier()
            v_op = v16.index(i % 2).load(V_OP)
            p_op = gl.convert_layout(p.to(gl.float16), P_OP)
            acc = mma_v2(p_op, v_op, acc * alpha[:, None])
        async_copy.wait_group(0)

        acc = acc * gl.load(v_scale_ptr + kvh)
        rows = gl.arange(0, M, layout=gl.SliceLayout(1, MMA))
        d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, MMA))
        row_ok = rows < G
        qh_o = (kvh * G + rows).to(gl.int64)
        if USE_SPLIT:
            pidx = (tok.to(gl.int64) * NUM_Q_HEADS + qh_o) * num_splits + split
            gl.store(part_acc_ptr + pidx[:, None] * HEAD_D + d[None, :], acc, mask=row_ok[:, None])
            ml_rows = gl.convert_layout(pidx, gl.SliceLayout(1, MMA))
            gl.store(part_ml_ptr + ml_rows * 2, m_i, mask=row_ok)
            gl.store(part_ml_ptr + ml_rows * 2 + 1, l_i, mask=row_ok)
        else:
            o = acc / l_i[:, None]
            gl.store(
                out_ptr + tok.to(gl.int64) * stride_ot + qh_o[:, None] * stride_oh + d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )

    @gluon.jit
    def _issue_tile_3d(
        k_buf,
        v_buf,
        kv_base,
        bt_row,
        start,
        hi,
        stride_cb,
        stride_ckv,
        stride_cs,
        BLOCK_SIZE: gl.constexpr,
        NW: gl.constexpr,
        WT: gl.constexpr,
        HEAD_D: gl.constexpr,
        L3: gl.constexpr,
    ):
        """Async copies of one tile as ``[NW, WT, D]``: warp ``w`` gets tokens ``start + w*WT ...``."""
        w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        n = gl.arange(0, WT, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        pos = start + w[:, None] * WT + n[None, :]
        ok = pos < hi
        blk = gl.load(bt_row + pos // BLOCK_SIZE, mask=ok, other=0).to(gl.int64)
        row = blk * stride_cb + (pos % BLOCK_SIZE).to(gl.int64) * stride_cs
        off = row[:, :, None] + d[None, None, :]
        mask = ok[:, :, None] & (d < HEAD_D)[None, None, :]
        async_copy.async_copy_global_to_shared(k_buf, kv_base + off, mask=mask)
        async_copy.async_copy_global_to_shared(v_buf, kv_base + stride_ckv + off, mask=mask)
        async_copy.commit_group()

    @gluon.jit(do_not_specialize=["num_splits", "stride_bt"])
    def _gluon_fp8_decode_warp_kernel(
        q_ptr,
        kv_ptr,
        out_ptr,
        part_acc_ptr,
        part_ml_ptr,
        qsl_ptr,
        seq_lens_ptr,
        bt_ptr,
        k_scale_ptr,
        v_scale_ptr,
        qk_scale_log2,
        window,
        num_splits,
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_cb,
        stride_ckv,
        stride_ch,
        stride_cs,
        stride_bt,
        order_ptr,  # int32 [num_seqs]: program slot -> sequence (read where USE_ORDER)
        NUM_Q_HEADS: gl.constexpr,
        G: gl.constexpr,
        HEAD_D: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
        WT: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        USE_SPLIT: gl.constexpr,
        USE_WINDOW: gl.constexpr,
        COPY_THREADS_D: gl.constexpr,
        V_MODE: gl.constexpr,
        HEADS_FIRST: gl.constexpr,
        USE_ORDER: gl.constexpr,
        CHUNK_BY_LONGEST: gl.constexpr,
    ):
        """Warp-independent variant: each warp owns ``WT`` tokens of every tile and keeps its own
        (max, sum, acc); the warps are merged once at the end. No cross-warp traffic per tile."""
        M: gl.constexpr = 16
        NW: gl.constexpr = gl.num_warps()
        TILE_N: gl.constexpr = NW * WT
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8]
        )
        Q_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
        K_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
        PV_KW: gl.constexpr = 2 if V_MODE == 2 else 4
        P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=PV_KW)
        V_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=PV_KW)
        V16_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0])
        L3: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, 1, 16],
            threads_per_warp=[1, 32 // COPY_THREADS_D, COPY_THREADS_D],
            warps_per_cta=[NW, 1, 1],
            order=[2, 1, 0],
        )
        RAW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[2, 1, 0])

        if HEADS_FIRST:
            kvh = gl.program_id(0)
            slot = gl.program_id(1)
        else:
            slot = gl.program_id(0)
            kvh = gl.program_id(1)
        split = gl.program_id(2)
        if USE_ORDER:
            seq = gl.load(order_ptr + slot)
        else:
            seq = slot
        tok = gl.load(qsl_ptr + seq)
        if gl.load(qsl_ptr + seq + 1) <= tok:
            return  # no new token for this sequence this step (allowed by the metadata contract)
        seq_len = gl.load(seq_lens_ptr + seq)

        # Every warp holds the whole query tile (rows = the G heads of this KV head, padded to 16).
        g = gl.arange(0, M, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        dq = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        wq = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        qh = (kvh * G + g).to(gl.int64)
        q_off = (wq * 0)[:, None, None] + (qh * stride_qh)[None, :, None] + dq[None, None, :]
        q_mask = (wq >= 0)[:, None, None] & (g < G)[None, :, None] & (dq < HEAD_D)[None, None, :]
        q = gl.load(q_ptr + tok.to(gl.int64) * stride_qt + q_off, mask=q_mask, other=0.0)
        # The scale multiplies the float32 scores, not the fp16 query: a calibrated e5m2 k_scale
        # (~amax / 57344) would push a pre-scaled query into fp16 subnormals.
        qk_scale = qk_scale_log2 * gl.load(k_scale_ptr + kvh)
        q_op = gl.convert_layout(q.to(gl.float16), Q_OP)

        hi = seq_len
        lo = 0
        if USE_WINDOW:
            lo = gl.maximum(seq_len - window, 0)
        if USE_SPLIT:
            span = hi - lo
            if CHUNK_BY_LONGEST:
                # Chunks sized for the batch's longest sequence (the decode order's first): a shorter one
                # takes fewer, full chunks and its remaining splits exit empty. max() keeps every token
                # of this sequence inside its splits whichever sequence comes first.
                longest = gl.load(seq_lens_ptr + gl.load(order_ptr))
                if USE_WINDOW:
                    longest = gl.minimum(longest, window)
                span = gl.maximum(span, longest)
            chunk = gl.cdiv(gl.cdiv(span, num_splits), TILE_N) * TILE_N
            lo = lo + split * chunk
            hi = gl.minimum(lo + chunk, hi)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), TILE_N)

        k_ring = gl.allocate_shared_memory(kv_ptr.dtype.element_ty, [NUM_STAGES, NW, WT, HEAD_D], RAW_SMEM)
        v_ring = gl.allocate_shared_memory(kv_ptr.dtype.element_ty, [NUM_STAGES, NW, WT, HEAD_D], RAW_SMEM)
        if V_MODE == 2:
            # One buffer is enough: tile i-1's reads of it finish before the loop-top barrier of tile i.
            v16 = gl.allocate_shared_memory(gl.float16, [NW, WT, HEAD_D], V16_SMEM)

        kv_base = kv_ptr + kvh.to(gl.int64) * stride_ch
        bt_row = bt_ptr + seq.to(gl.int64) * stride_bt
        for j in gl.static_range(NUM_STAGES - 1):
            _issue_tile_3d(
                k_ring.index(j), v_ring.index(j), kv_base, bt_row, lo + j * TILE_N, hi,
                stride_cb, stride_ckv, stride_cs, BLOCK_SIZE, NW, WT, HEAD_D, L3,
            )  # fmt: skip

        m_i = gl.full([NW, M], float("-inf"), gl.float32, layout=gl.SliceLayout(2, MMA))
        l_i = gl.zeros([NW, M], gl.float32, layout=gl.SliceLayout(2, MMA))
        acc = gl.zeros([NW, M, HEAD_D], gl.float32, layout=MMA)
        w_s = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(1, MMA)))
        n_s = gl.arange(0, WT, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
        tok_in_tile = w_s[:, None] * WT + n_s[None, :]  # [NW, WT]
        for i in range(num_tiles):
            stage = i % NUM_STAGES
            async_copy.wait_group(NUM_STAGES - 2)
            gl.thread_barrier()  # every thread's copies of tile i landed; tile i-1's buffer is free
            nxt = i + NUM_STAGES - 1
            _issue_tile_3d(
                k_ring.index(nxt % NUM_STAGES), v_ring.index(nxt % NUM_STAGES), kv_base, bt_row,
                lo + nxt * TILE_N, hi, stride_cb, stride_ckv, stride_cs, BLOCK_SIZE, NW, WT, HEAD_D, L3,
            )  # fmt: skip
            start = lo + i * TILE_N

            k_op = k_ring.index(stage).permute((0, 2, 1)).load(K_OP).to(gl.float16)
            s = mma_v2(q_op, k_op, gl.zeros([NW, M, WT], gl.float32, layout=MMA)) * qk_scale
            s = gl.where((start + tok_in_tile < hi)[:, None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 2))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s - m_use[:, :, None])
            l_i = l_i * alpha + gl.sum(p, 2)
            m_i = m_new

            if V_MODE == 2:
                v16.store(v_ring.index(stage).load(L3).to(gl.float16))
                gl.thread_barrier()
                v_op = v16.load(V_OP)
            else:
                v_op = v_ring.index(stage).load(V_OP).to(gl.float16)
            p_op = gl.convert_layout(p.to(gl.float16), P_OP)
            acc = mma_v2(p_op, v_op, acc * alpha[:, :, None])
        async_copy.wait_group(0)

        # Merge the warps' partial softmax states (once per program).
        m_all = gl.max(m_i, 0)  # [M]
        m_all_use = gl.where(m_all == float("-inf"), 0.0, m_all)
        w_scale = gl.where(m_i == float("-inf"), 0.0, gl.exp2(m_i - m_all_use[None, :]))
        l_all = gl.sum(l_i * w_scale, 0)
        acc_all = gl.sum(acc * w_scale[:, :, None], 0) * gl.load(v_scale_ptr + kvh)  # [M, D]

        OUT_L: gl.constexpr = gl.SliceLayout(0, MMA)
        rows = gl.arange(0, M, layout=gl.SliceLayout(1, OUT_L))
        d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, OUT_L))
        row_ok = rows < G
        qh_o = (kvh * G + rows).to(gl.int64)
        if USE_SPLIT:
            pidx = (tok.to(gl.int64) * NUM_Q_HEADS + qh_o) * num_splits + split
            gl.store(part_acc_ptr + pidx[:, None] * HEAD_D + d[None, :], acc_all, mask=row_ok[:, None])
            ml_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, MMA))
            ml_rows = gl.convert_layout(pidx, ml_l)
            ml_ok = gl.convert_layout(row_ok, ml_l)
            gl.store(part_ml_ptr + ml_rows * 2, m_all, mask=ml_ok)
            gl.store(part_ml_ptr + ml_rows * 2 + 1, l_all, mask=ml_ok)
        else:
            l_out = gl.convert_layout(l_all, gl.SliceLayout(1, OUT_L))
            o = acc_all / l_out[:, None]
            gl.store(
                out_ptr + tok.to(gl.int64) * stride_ot + qh_o[:, None] * stride_oh + d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )


#: With ``meta.decode_order``, the warp kernel's split-K chunks are the longest sequence's context over the
#: split count (a shorter sequence fills fewer splits), not each sequence's own context over it.
#: Benchmarks set it False to compare.
SPLITS_SIZED_BY_LONGEST: bool = True


def _tiling(head_dim: int, variant: str) -> dict:
    """Default tile/stage/warp choice per head size."""
    if variant == "warp":
        # D 256 keeps 16 tokens per warp and two stages to stay clear of spills.
        return dict(wt=16, num_stages=3 if head_dim <= 128 else 2, num_warps=4)
    return dict(tile_n=64 if head_dim <= 128 else 32, num_stages=2, num_warps=4)


#: What ``tiling`` may override (tests): tokens per warp (warp kernel), tile tokens (cta kernel), ring stages,
#: warps, the register cap, and the warp kernel's V staging mode.
TILING_KEYS: frozenset[str] = frozenset({"wt", "tile_n", "stages", "warps", "maxnreg", "v_mode"})


def launch_gluon_fp8_decode(
    q, kv_cache, out, part_acc, part_ml, meta, k_scale, v_scale, qk_scale_log2, window, splits, warp, tiling=None,
    heads_first=True,
):
    """Launch the "warp" (``warp`` True) or "cta" kernel over grid (num_seqs, Hkv, splits); arguments as the
    Triton decode path prepares them (the routing table chose the kernel and ``splits``). ``heads_first``
    (the warp kernel): grid (Hkv, num_seqs, splits), the sequences taken in ``meta.decode_order`` when it
    is set (:mod:`kvforge.attention.metadata`, "Decode order").

    With ``splits > 1`` it writes the (acc, max, sum) partials that
    ``triton_paged_attention.merge_split_partials`` merges; otherwise ``out``.
    """
    hq, d = q.shape[1], q.shape[2]
    hkv, bs = kv_cache.shape[2], kv_cache.shape[3]
    # Split partials are [T, Hq, S, D_PAD] with the tl.dot path's padded D: equal to d here.
    assert d & (d - 1) == 0, d
    cfg = dict(tiling or {})
    unknown = set(cfg) - TILING_KEYS
    if unknown:
        raise ValueError(f"unknown Gluon tiling keys {sorted(unknown)}; choose from {sorted(TILING_KEYS)}")
    variant = "warp" if warp else "cta"
    tiling = _tiling(d, variant)
    stages = max(2, cfg.get("stages") or tiling["num_stages"])  # the ring needs >= 2 buffers
    warps = cfg.get("warps") or tiling["num_warps"]
    args = (
        q,
        kv_cache,
        out,
        part_acc,
        part_ml,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        k_scale,
        v_scale,
        qk_scale_log2,
        window,
        splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        meta.block_tables.stride(0),
    )
    common = dict(
        NUM_Q_HEADS=hq,
        G=hq // hkv,
        HEAD_D=d,
        BLOCK_SIZE=bs,
        NUM_STAGES=stages,
        USE_SPLIT=splits > 1,
        USE_WINDOW=window > 0,
        COPY_THREADS_D=min(32, d // 16),
        num_warps=warps,
    )
    if cfg.get("maxnreg"):
        common["maxnreg"] = cfg["maxnreg"]
    grid = (meta.num_seqs, hkv, splits)
    if variant == "cta":
        return _gluon_fp8_decode_kernel[grid](
            *args, TILE_N=cfg.get("tile_n") or tiling["tile_n"], **common
        )
    wt = cfg.get("wt") or tiling["wt"]
    if heads_first:
        grid = (hkv, meta.num_seqs, splits)
    order = meta.decode_order if heads_first else None
    return _gluon_fp8_decode_warp_kernel[grid](
        *args, order_ptr=order if order is not None else meta.seq_lens, WT=wt, V_MODE=cfg.get("v_mode", 0),
        HEADS_FIRST=heads_first, USE_ORDER=order is not None,
        CHUNK_BY_LONGEST=order is not None and SPLITS_SIZED_BY_LONGEST, **common,
    )

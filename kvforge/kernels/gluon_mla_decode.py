"""MLA decode on Hopper tensor cores (``wgmma``) with the cached tokens as the M dimension.

At 8-32 heads per rank MLA decode is memory-bound: every cached row (``R`` = 512 latent + ``P`` = 64
rope values) is read once per step and used by only a few heads. ``mma_v2`` kernels (the tl.dot kernel
in :mod:`kvforge.kernels.triton_mla_decode`) put the heads on
M, padded to 16, and spend their instruction budget moving operands from shared memory to registers
(byte by byte for an fp8 ``P C``). Here both products run as warpgroup MMAs that read their operands
straight from shared memory, with the tile's tokens on the side that must be 64 wide:

1. ``S^T [TILE_N, NH] = C [TILE_N, R] q_lat^T [R, NH] + C_rope [TILE_N, P] q_rope^T [P, NH]``
   (A = the cached rows, K-major; B = the query, K-major);
2. online softmax over the tokens (axis 0 of ``S^T``; one cross-warp max per tile, the denominator summed
   once at the end; the running max moves lazily, ``RESCALE_LOG2``);
3. ``O^T [R, NH] += C^T [R, TILE_N] P^T [TILE_N, NH]`` (A = the same cached rows read transposed,
   which ``wgmma`` supports for 16-bit types; B = ``P^T`` written to shared memory).

The accumulator ``O^T`` is ``R x NH`` float32 over one warpgroup: ``4 * NH`` registers per thread
(the fp8 register path at 32 heads runs two warpgroups on 128-token tiles instead: ``2 * NH`` each).
An fp8 cache tile is converted to fp16 in shared memory once per tile (fp8 -> fp16 is exact; the
per-tensor scale multiplies the float32 scores and the final accumulator), because an fp8 ``wgmma``
cannot read an MN-major operand. With a bf16/fp16 cache the async copies land directly in the
swizzled layout ``wgmma`` reads. Rows at or past the context end are zero-filled by the copies and
masked to ``-inf`` in the scores, so fp8 NaN bytes never reach ``P C``.

Invariants: one program = one sequence x one block of ``NH`` heads x one split of the context; the
partials use the paged-attention merge layout (``merge_split_partials``); block-id and row offsets
are int64. Scope: the ``gluon_mla_wgmma`` row of :mod:`kvforge.attention.routing.mla`.
"""

from __future__ import annotations

import torch

from kvforge.attention.fp8 import FP8_DTYPES, storage_dtype_name
from kvforge.attention.routing import mla as mla_routing
from kvforge.kernels.gluon_support import HAS_GLUON, async_copy, gl, gluon, gluon_runs_on, num_sms
from kvforge.kernels.triton_paged_attention import LOG2E, merge_split_partials

if HAS_GLUON:
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

TILE_N: int = 64  # wgmma's M: 4 warps x 16 rows
#: Lazy softmax rescaling (:func:`lazy_rescale`): the running max moves only when a tile's max exceeds it by
#: more than this many powers of two, so unnormalized probabilities stay at most 2^8 = 256 (within fp16/bf16
#: P's range; the float32 sums and accumulator lose nothing) and most tiles skip rescaling acc.
RESCALE_LOG2: float = 8.0
if HAS_GLUON:  # what the kernel reads (a jit function sees only constexpr globals)
    _RESCALE_LOG2 = gl.constexpr(RESCALE_LOG2)


if HAS_GLUON:

    @gluon.jit
    def _issue_rows(
        lat_buf, rope_buf, cache_ptr, bt_row, start, hi, stride_cb, stride_cs,
        BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr, R: gl.constexpr, P: gl.constexpr,
        LAT_COPY: gl.constexpr, ROPE_COPY: gl.constexpr,
    ):  # fmt: skip
        """One commit group: rows ``start .. start+TILE-1`` of the sequence (zero-filled at or past ``hi``)
        into ``lat_buf [TILE, R]`` and ``rope_buf [TILE, P]``."""
        row, ok = _row_offsets(bt_row, start, hi, stride_cb, stride_cs, BLOCK_SIZE, TILE, gl.SliceLayout(1, LAT_COPY))
        c = gl.arange(0, R, layout=gl.SliceLayout(0, LAT_COPY))
        async_copy.async_copy_global_to_shared(
            lat_buf, cache_ptr + row[:, None] + c[None, :], mask=ok[:, None] & (c >= 0)[None, :]
        )
        nr = gl.arange(0, TILE, layout=gl.SliceLayout(1, ROPE_COPY))
        cr = gl.arange(0, P, layout=gl.SliceLayout(0, ROPE_COPY))
        row_r = gl.convert_layout(row, gl.SliceLayout(1, ROPE_COPY))
        ok_r = (start + nr) < hi
        async_copy.async_copy_global_to_shared(
            rope_buf, cache_ptr + R + row_r[:, None] + cr[None, :], mask=ok_r[:, None] & (cr >= 0)[None, :]
        )
        async_copy.commit_group()

    @gluon.jit
    def _fp8_block_ids(bt_row, start, hi, BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr, STAGE_L: gl.constexpr,
                       ROPE_COPY: gl.constexpr):  # fmt: skip
        """The block-table entries (int32) of tile ``start``'s tokens in the two layouts :func:`_load_fp8_rows`
        reads with. Loaded two tiles ahead and turned into offsets (:func:`_fp8_row_offsets`) one iteration
        later: the entry is a global load whose result the offsets depend on, and using it in the iteration
        that loaded it stalls every warp there on the load's latency."""
        return (_block_ids(bt_row, start, hi, BLOCK_SIZE, TILE, gl.SliceLayout(1, STAGE_L)),
                _block_ids(bt_row, start, hi, BLOCK_SIZE, TILE, gl.SliceLayout(1, ROPE_COPY)))  # fmt: skip

    @gluon.jit
    def _fp8_row_offsets(blk, blk_r, start, hi, stride_cb, stride_cs, BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr,
                         STAGE_L: gl.constexpr, ROPE_COPY: gl.constexpr):  # fmt: skip
        """:func:`_offsets_of` tile ``start`` in the two layouts :func:`_load_fp8_rows` reads with, from the
        entries :func:`_fp8_block_ids` loaded an iteration earlier."""
        row, ok = _offsets_of(blk, start, hi, stride_cb, stride_cs, BLOCK_SIZE, TILE, gl.SliceLayout(1, STAGE_L))
        row_r, ok_r = _offsets_of(blk_r, start, hi, stride_cb, stride_cs, BLOCK_SIZE, TILE,
                                  gl.SliceLayout(1, ROPE_COPY))  # fmt: skip
        return row, ok, row_r, ok_r

    @gluon.jit
    def _load_fp8_rows(cache_ptr, row, ok, row_r, ok_r, R: gl.constexpr, P: gl.constexpr, COLS: gl.constexpr,
                       STAGE_L: gl.constexpr, ROPE_COPY: gl.constexpr):  # fmt: skip
        """The rows at offsets ``row`` / ``row_r`` (:func:`_fp8_row_offsets`) into registers (zeros where not
        ``ok``): four ``[TILE, COLS]`` latent column chunks and the ``[TILE, P]`` rope part, 16 bytes per load."""
        gl.static_assert(R == 4 * COLS)
        c = gl.arange(0, COLS, layout=gl.SliceLayout(0, STAGE_L))
        ptr = cache_ptr + row[:, None] + c[None, :]
        mask = ok[:, None] & (c >= 0)[None, :]
        c0 = gl.load(ptr, mask=mask, other=0.0)
        c1 = gl.load(ptr + COLS, mask=mask, other=0.0)
        c2 = gl.load(ptr + 2 * COLS, mask=mask, other=0.0)
        c3 = gl.load(ptr + 3 * COLS, mask=mask, other=0.0)
        cr = gl.arange(0, P, layout=gl.SliceLayout(0, ROPE_COPY))
        cr_v = gl.load(cache_ptr + R + row_r[:, None] + cr[None, :], mask=ok_r[:, None] & (cr >= 0)[None, :],
                       other=0.0)  # fmt: skip
        return c0, c1, c2, c3, cr_v

    @gluon.jit
    def _stage_fp16(lat16, rope16, c0, c1, c2, c3, cr_v, COLS: gl.constexpr):
        """fp8 rows (registers) -> the fp16 copy both products read (fp8 -> fp16 is exact)."""
        lat16.slice(0, COLS, dim=1).store(c0.to(gl.float16))
        lat16.slice(COLS, COLS, dim=1).store(c1.to(gl.float16))
        lat16.slice(2 * COLS, COLS, dim=1).store(c2.to(gl.float16))
        lat16.slice(3 * COLS, COLS, dim=1).store(c3.to(gl.float16))
        rope16.store(cr_v.to(gl.float16))

    @gluon.jit
    def _block_ids(bt_row, start, hi, BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr, ROW_L: gl.constexpr):
        """The block-table entries of the sequence's tokens ``start .. start+TILE-1`` (0 at or past ``hi``)."""
        pos = start + gl.arange(0, TILE, layout=ROW_L)
        return gl.load(bt_row + pos // BLOCK_SIZE, mask=pos < hi, other=0)

    @gluon.jit
    def _offsets_of(blk, start, hi, stride_cb, stride_cs, BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr,
                    ROW_L: gl.constexpr):  # fmt: skip
        """Cache offsets (int64, in elements) and validity of tokens ``start .. start+TILE-1`` whose block-table
        entries are ``blk`` (:func:`_block_ids`, same layout)."""
        pos = start + gl.arange(0, TILE, layout=ROW_L)
        return blk.to(gl.int64) * stride_cb + (pos % BLOCK_SIZE).to(gl.int64) * stride_cs, pos < hi

    @gluon.jit
    def _row_offsets(bt_row, start, hi, stride_cb, stride_cs, BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr,
                     ROW_L: gl.constexpr):  # fmt: skip
        """Cache offsets (int64, in elements) and validity of the sequence's tokens ``start .. start+TILE-1``,
        gathered through its block-table row, in the 1-D layout ``ROW_L``."""
        return _offsets_of(_block_ids(bt_row, start, hi, BLOCK_SIZE, TILE, ROW_L), start, hi, stride_cb, stride_cs,
                           BLOCK_SIZE, TILE, ROW_L)  # fmt: skip

    @gluon.jit(do_not_specialize=["num_splits", "stride_bt"])
    def _wgmma_mla_decode_kernel(
        ql_ptr,
        qr_ptr,
        cache_ptr,
        out_ptr,
        part_acc_ptr,
        part_ml_ptr,
        qsl_ptr,
        seq_lens_ptr,
        bt_ptr,
        scale_ptr,
        sm_scale_log2,
        num_splits,
        stride_qlt,
        stride_qlh,
        stride_qrt,
        stride_qrh,
        stride_ot,
        stride_oh,
        stride_cb,
        stride_cs,
        stride_bt,
        NUM_HEADS: gl.constexpr,
        NH: gl.constexpr,
        R: gl.constexpr,
        P: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
        TILE: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        IS_FP8: gl.constexpr,
        USE_SPLIT: gl.constexpr,
        FP8_PATH: gl.constexpr,
        LAZY_RESCALE: gl.constexpr,
    ):
        NW: gl.constexpr = gl.num_warps()
        CACHE_T: gl.constexpr = cache_ptr.dtype.element_ty
        if IS_FP8:
            DOT_T: gl.constexpr = gl.float16
        else:
            DOT_T: gl.constexpr = CACHE_T
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, NH, 16])
        VEC: gl.constexpr = 128 // CACHE_T.primitive_bitwidth  # elements per 16-byte copy
        LAT_COPY: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, VEC], threads_per_warp=[1, 32], warps_per_cta=[NW, 1], order=[1, 0]
        )
        ROPE_COPY: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, VEC], threads_per_warp=[32 // (P // VEC), P // VEC], warps_per_cta=[NW, 1],
            order=[1, 0],
        )  # fmt: skip
        OP_LAT: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        OP_ROPE: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        if IS_FP8:
            RAW: gl.constexpr = gl.SwizzledSharedLayout(vec=VEC, per_phase=1, max_phase=8, order=[1, 0])
        else:
            RAW: gl.constexpr = OP_LAT
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, NH], DOT_T)
        STAGE_COLS: gl.constexpr = 128  # fp8 -> fp16 staging in column chunks (bounds live registers)
        # Eight rows of four threads per warp: a thread's 16 fp8 become two 16-byte fp16 units (2k, 2k+1) of
        # a 128-byte swizzle row, and the stores run a quarter warp (8 threads) at a time; two rows (swizzle
        # phases r and r+1) per quarter warp reach all eight bank groups. One row of eight threads reached
        # only the even ones: a 2-way conflict on every staging store.
        STAGE_L: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, VEC], threads_per_warp=[8, 4], warps_per_cta=[NW, 1], order=[1, 0]
        )
        Q_L: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, 8], threads_per_warp=[1, 32], warps_per_cta=[NW, 1], order=[1, 0]
        )

        seq = gl.program_id(0)
        hb = gl.program_id(1)
        split = gl.program_id(2)
        tok = gl.load(qsl_ptr + seq)
        if gl.load(qsl_ptr + seq + 1) <= tok:
            return  # no new token for this sequence this step (allowed by the metadata contract)
        seq_len = gl.load(seq_lens_ptr + seq)
        if IS_FP8:
            qk_scale = sm_scale_log2 * gl.load(scale_ptr)
        else:
            qk_scale = sm_scale_log2

        # The query block [NH, R] and [NH, P], zero rows for padded heads, in the dot dtype.
        t64 = tok.to(gl.int64)
        hq = hb * NH + gl.arange(0, NH, layout=gl.SliceLayout(1, Q_L))
        cq = gl.arange(0, R, layout=gl.SliceLayout(0, Q_L))
        cr = gl.arange(0, P, layout=gl.SliceLayout(0, Q_L))
        ql = gl.load(
            ql_ptr + t64 * stride_qlt + (hq.to(gl.int64) * stride_qlh)[:, None] + cq[None, :],
            mask=(hq < NUM_HEADS)[:, None] & (cq >= 0)[None, :],
            other=0.0,
        )
        qr = gl.load(
            qr_ptr + t64 * stride_qrt + (hq.to(gl.int64) * stride_qrh)[:, None] + cr[None, :],
            mask=(hq < NUM_HEADS)[:, None] & (cr >= 0)[None, :],
            other=0.0,
        )
        ql_smem = gl.allocate_shared_memory(DOT_T, [NH, R], Q_SMEM, ql.to(DOT_T))
        qr_smem = gl.allocate_shared_memory(DOT_T, [NH, P], Q_SMEM, qr.to(DOT_T))

        lo = 0
        hi = seq_len
        if USE_SPLIT:
            chunk = gl.cdiv(gl.cdiv(hi, num_splits), TILE) * TILE
            lo = split * chunk
            hi = gl.minimum(lo + chunk, hi)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), TILE)

        # fp8 paths: 0 = an fp8 cp.async ring, 1 = rows through registers into an fp16 copy (the FP8_PATH
        # docstring above the launcher).
        STAGED_RING: gl.constexpr = not IS_FP8 or FP8_PATH == 0
        if STAGED_RING:
            lat_ring = gl.allocate_shared_memory(CACHE_T, [NUM_STAGES, TILE, R], RAW)
            rope_ring = gl.allocate_shared_memory(CACHE_T, [NUM_STAGES, TILE, P], RAW)
        if IS_FP8:
            # One fp16 copy of the current tile; both products read it (tile i-1's wgmmas finish before
            # the loop-top barrier of tile i).
            lat16 = gl.allocate_shared_memory(gl.float16, [TILE, R], OP_LAT)
            rope16 = gl.allocate_shared_memory(gl.float16, [TILE, P], OP_ROPE)
        p_smem = gl.allocate_shared_memory(DOT_T, [TILE, NH], P_SMEM)
        fence_async_shared()  # the query's generic-proxy stores, before any wgmma reads them

        bt_row = bt_ptr + seq.to(gl.int64) * stride_bt
        if STAGED_RING:
            for j in gl.static_range(NUM_STAGES - 1):
                _issue_rows(lat_ring.index(j), rope_ring.index(j), cache_ptr, bt_row, lo + j * TILE, hi,
                            stride_cb, stride_cs, BLOCK_SIZE, TILE, R, P, LAT_COPY, ROPE_COPY)  # fmt: skip
        else:
            # fp8 rows go global -> registers -> fp16 shared memory; tile i+1's loads are in flight while
            # tile i's products run (no fp8 ring in shared memory: 94 KB per program, 2 programs per SM).
            # Entering iteration i: the offsets of tile i+1 (row, ...) and the block ids of tile i+2 (blk, ...).
            blk, blk_r = _fp8_block_ids(bt_row, lo, hi, BLOCK_SIZE, TILE, STAGE_L, ROPE_COPY)
            row, ok, row_r, ok_r = _fp8_row_offsets(blk, blk_r, lo, hi, stride_cb, stride_cs, BLOCK_SIZE, TILE,
                                                    STAGE_L, ROPE_COPY)  # fmt: skip
            c0, c1, c2, c3, cr_v = _load_fp8_rows(cache_ptr, row, ok, row_r, ok_r, R, P, STAGE_COLS, STAGE_L,
                                                  ROPE_COPY)  # fmt: skip
            blk, blk_r = _fp8_block_ids(bt_row, lo + TILE, hi, BLOCK_SIZE, TILE, STAGE_L, ROPE_COPY)
            row, ok, row_r, ok_r = _fp8_row_offsets(blk, blk_r, lo + TILE, hi, stride_cb, stride_cs, BLOCK_SIZE,
                                                    TILE, STAGE_L, ROPE_COPY)  # fmt: skip
            blk, blk_r = _fp8_block_ids(bt_row, lo + 2 * TILE, hi, BLOCK_SIZE, TILE, STAGE_L, ROPE_COPY)
            _stage_fp16(lat16, rope16, c0, c1, c2, c3, cr_v, STAGE_COLS)

        m_i = gl.full([NH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
        # The softmax denominator is kept per score element ([TILE, NH], 8-16 registers a thread) and summed
        # over the tokens once after the loop: a per-tile sum would be a second cross-warp reduction (shuffles,
        # shared memory, a barrier) on every tile's critical path.
        l_tile = gl.zeros([TILE, NH], gl.float32, layout=MMA)
        acc = gl.zeros([R, NH], gl.float32, layout=MMA)
        n_off = gl.arange(0, TILE, layout=gl.SliceLayout(1, MMA))
        s_zero = gl.zeros([TILE, NH], gl.float32, layout=MMA)
        for i in range(num_tiles):
            if not STAGED_RING:
                # lat16 holds tile i (staged at the end of iteration i-1, or before the loop). Tile i+1's
                # loads go out now and land while tile i's products run; they are consumed in this same
                # iteration (fp8 values carried across iterations would cost a register per byte).
                c0, c1, c2, c3, cr_v = _load_fp8_rows(cache_ptr, row, ok, row_r, ok_r, R, P, STAGE_COLS, STAGE_L,
                                                      ROPE_COPY)  # fmt: skip
                row, ok, row_r, ok_r = _fp8_row_offsets(blk, blk_r, lo + (i + 2) * TILE, hi, stride_cb, stride_cs,
                                                        BLOCK_SIZE, TILE, STAGE_L, ROPE_COPY)  # fmt: skip
                blk, blk_r = _fp8_block_ids(bt_row, lo + (i + 3) * TILE, hi, BLOCK_SIZE, TILE, STAGE_L, ROPE_COPY)
                lat = lat16
                rope = rope16
            else:
                stage = i % NUM_STAGES
                async_copy.wait_group(NUM_STAGES - 2)
                gl.thread_barrier()  # tile i landed for every thread; tile i-1's buffers are free
                nxt = i + NUM_STAGES - 1
                _issue_rows(lat_ring.index(nxt % NUM_STAGES), rope_ring.index(nxt % NUM_STAGES), cache_ptr,
                            bt_row, lo + nxt * TILE, hi, stride_cb, stride_cs, BLOCK_SIZE, TILE, R, P, LAT_COPY,
                            ROPE_COPY)  # fmt: skip
                if IS_FP8:
                    for c in gl.static_range(R // STAGE_COLS):
                        part = lat_ring.index(stage).slice(c * STAGE_COLS, STAGE_COLS, dim=1).load(STAGE_L)
                        lat16.slice(c * STAGE_COLS, STAGE_COLS, dim=1).store(part.to(gl.float16))
                    rope16.store(rope_ring.index(stage).load(ROPE_COPY).to(gl.float16))
                    lat = lat16
                    rope = rope16
                else:
                    lat = lat_ring.index(stage)
                    rope = rope_ring.index(stage)
            fence_async_shared()  # cp.async / staging writes -> wgmma (async proxy) reads
            gl.thread_barrier()

            s = warpgroup_mma(lat, ql_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(rope, qr_smem.permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            s = s * qk_scale
            s = gl.where((lo + i * TILE + n_off < hi)[:, None], s, float("-inf"))
            if LAZY_RESCALE:
                # The running max m_i (log2 units) moves only when some head's tile max exceeds it by more
                # than RESCALE_LOG2; otherwise p = exp2(s - m_i) <= 2^RESCALE_LOG2 under a stale max, which
                # the sums, the partials' m and the merge all share, so the result is unchanged up to
                # rounding. Each skip saves the alpha multiplies of acc ([R, NH]: 64 a thread at 16 heads).
                m_cand = gl.maximum(m_i, gl.max(s, 0))
                if gl.max((m_cand - m_i > _RESCALE_LOG2).to(gl.int32), 0) > 0:  # also true on the first tile
                    m_use = gl.where(m_cand == float("-inf"), 0.0, m_cand)
                    alpha = gl.exp2(m_i - m_use)
                    acc = acc * alpha[None, :]
                    l_tile = l_tile * alpha[None, :]
                    m_i = m_cand
                p = gl.exp2(s - gl.where(m_i == float("-inf"), 0.0, m_i)[None, :])
                l_tile = l_tile + p
            else:
                m_new = gl.maximum(m_i, gl.max(s, 0))
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_use)
                p = gl.exp2(s - m_use[None, :])
                l_tile = l_tile * alpha[None, :] + p
                acc = acc * alpha[None, :]
                m_i = m_new
            p_smem.store(p.to(DOT_T))
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(lat.permute((1, 0)), p_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            if not STAGED_RING:
                gl.thread_barrier()  # every warp's wgmmas are done reading tile i's fp16 copy
                _stage_fp16(lat16, rope16, c0, c1, c2, c3, cr_v, STAGE_COLS)
        if STAGED_RING:
            async_copy.wait_group(0)
        l_i = gl.sum(l_tile, 0)

        if IS_FP8:
            acc = acc * gl.load(scale_ptr)
        ho = hb * NH + gl.arange(0, NH, layout=gl.SliceLayout(0, MMA))
        co = gl.arange(0, R, layout=gl.SliceLayout(1, MMA))
        h_ok = ho < NUM_HEADS
        mask = (co >= 0)[:, None] & h_ok[None, :]
        if USE_SPLIT:
            pidx = (t64 * NUM_HEADS + ho.to(gl.int64)) * num_splits + split  # paged merge-kernel layout
            if num_tiles > 0:  # an empty split (short sequence, many splits) writes only m = -inf, l = 0
                gl.store(part_acc_ptr + (pidx * R)[None, :] + co[:, None], acc, mask=mask)
            gl.store(part_ml_ptr + pidx * 2, m_i, mask=h_ok)
            gl.store(part_ml_ptr + pidx * 2 + 1, l_i, mask=h_ok)
        else:
            o = acc / l_i[None, :]
            gl.store(
                out_ptr + t64 * stride_ot + (ho.to(gl.int64) * stride_oh)[None, :] + co[:, None],
                o.to(out_ptr.dtype.element_ty),
                mask=mask,
            )


def lazy_rescale(is_fp8: bool, nh: int, fp8_path: int) -> bool:
    """Whether the kernel rescales lazily (``RESCALE_LOG2``; ``cfg["lazy_rescale"]`` overrides): only for the
    fp8 register path at 16 and 32 heads per program (the configurations where it pays)."""
    return is_fp8 and nh in (16, 32) and fp8_path == FP8_PATH_REGS


def default_stages(is_fp8: bool) -> int:
    """Ring depth: 3 for fp8 (110 KB of rows), 2 for 16-bit rows (147 KB); both fit one CTA per SM."""
    return 3 if is_fp8 else 2


#: fp8 row paths (``cfg["fp8_path"]``). RING: an fp8 cp.async ring (205-226 KB at 16-32 heads per
#: program, one program per SM). REGS: global -> registers -> one fp16 copy that both products read (94 KB,
#: two per SM; the default for every fp8 cache).
FP8_PATH_RING: int = 0
FP8_PATH_REGS: int = 1


def fp8_in_registers(is_fp8: bool, nh: int) -> bool:
    """fp8 rows staged through registers rather than an fp8 ring (205-226 KB, one program per SM): always
    (at most 32 heads per program, :func:`kvforge.attention.routing.mla.wgmma_heads_per_program`). Up to 16 heads per program with 4 warps (94 KB of shared memory,
    two programs per SM); at 32 with 8 warps and 128-token tiles (:func:`default_num_warps`)."""
    return is_fp8 and nh <= 32


def default_num_warps(fp8_regs: bool, nh: int) -> int:
    """8 warps for the fp8 register path at 32 heads per program, where 4 warps would spill; else 4. With 8,
    two warpgroups share 128-token tiles, one program per SM (194 KB of shared memory; 246 registers with
    lazy rescaling, 252 without). 8 warps are refused at fewer heads per program (untested there; they
    faulted at 8 heads)."""
    return 8 if fp8_regs and nh == 32 else 4


#: What ``cfg`` may set (benchmarks and tests): heads per program, the fp8 path, the ring depth, lazy
#: rescaling, warps per program.
CFG_KEYS: frozenset[str] = frozenset({"heads_per_program", "fp8_path", "stages", "lazy_rescale", "num_warps"})


def mla_decode_wgmma(q_latent, q_rope, cache, meta, scale, softmax_scale, *, num_splits=None, out=None, cfg=None,
                     query_dtype=None):  # fmt: skip
    """``o_latent [T, H, R]`` like ``triton_mla_decode.mla_decode``, on the wgmma kernel; split partials merged
    by the paged-attention merge kernel. ``out`` (optional) receives the result; tokens past
    ``query_start_loc[num_seqs]`` are left untouched. ``num_splits`` (None or 0: the kernel's split rule,
    :func:`kvforge.attention.routing.mla.wgmma_splits`). ``query_dtype``: the plan's query dtype, checked
    against the kernel's scope; the kernel computes with the model-dtype query either way. ``cfg`` (tests):
    see :data:`CFG_KEYS`."""
    t, h, r = q_latent.shape
    shape = mla_routing.MLAShape(t, h, r, cache.shape[-1] - r, 0,
                                 storage_dtype_name(q_latent.dtype), storage_dtype_name(cache.dtype))
    if not (gluon_runs_on(q_latent) and mla_routing.wgmma_accepts(shape, query_dtype)):
        raise ValueError("outside the wgmma MLA kernel's scope (see kvforge.attention.routing.mla.wgmma_accepts)")
    cfg = dict(cfg or {})
    unknown = set(cfg) - CFG_KEYS
    if unknown:
        raise ValueError(f"unknown wgmma MLA config keys {sorted(unknown)}; choose from {sorted(CFG_KEYS)}")
    if out is None:
        out = torch.empty((t, h, r), dtype=q_latent.dtype, device=q_latent.device)
    is_fp8 = cache.dtype in FP8_DTYPES
    nh = cfg.get("heads_per_program") or mla_routing.wgmma_heads_per_program(h)
    head_blocks = -(-h // nh)
    path = cfg.get("fp8_path", FP8_PATH_REGS if fp8_in_registers(is_fp8, nh) else FP8_PATH_RING)
    if type(path) is not int or path not in (FP8_PATH_RING, FP8_PATH_REGS):
        raise ValueError(f"fp8_path {path}: choose {FP8_PATH_RING} (ring) or {FP8_PATH_REGS} (registers)")
    regs = path != FP8_PATH_RING
    nw = cfg.get("num_warps", default_num_warps(is_fp8 and regs, nh))
    if nw not in (4, 8):
        raise ValueError(f"num_warps {nw}: choose 4 (64-token tiles) or 8 (128-token tiles)")
    if nw == 8 and not (is_fp8 and regs and nh == 32):
        raise ValueError("num_warps 8 (128-token tiles) runs only the fp8 register path at 32 heads per program "
                         "(a ring of 128-token tiles does not fit in shared memory; other head counts were slower "
                         "or untested)")
    if nw == 4 and is_fp8 and regs and nh > 16:
        raise ValueError(f"the fp8 register path at {nh} heads per program needs num_warps 8 (4 warps spill)")
    scale = scale.to(torch.float32).reshape(-1)[:1] if is_fp8 else meta.seq_lens  # unused when 16-bit
    splits = mla_routing.wgmma_splits(meta.num_seqs, h, meta.max_seq_len, num_sms(q_latent.device), is_fp8, nh,
                                      fp8_in_registers=regs, forced=num_splits)  # fmt: skip
    if splits > 1:
        part_acc = torch.empty((t, h, splits, r), dtype=torch.float32, device=q_latent.device)
        part_ml = torch.empty((t, h, splits, 2), dtype=torch.float32, device=q_latent.device)
    else:
        part_acc = part_ml = out
    _wgmma_mla_decode_kernel[(meta.num_seqs, head_blocks, splits)](
        q_latent, q_rope, cache, out, part_acc, part_ml, meta.query_start_loc, meta.seq_lens,
        meta.block_tables, scale, float(softmax_scale) * LOG2E, splits,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0),
        out.stride(1), cache.stride(0), cache.stride(1), meta.block_tables.stride(0),
        NUM_HEADS=h, NH=nh, R=r, P=q_rope.shape[-1], BLOCK_SIZE=cache.shape[1], TILE=TILE_N * nw // 4,
        NUM_STAGES=cfg.get("stages") or default_stages(is_fp8), IS_FP8=is_fp8, USE_SPLIT=splits > 1,
        FP8_PATH=path, LAZY_RESCALE=bool(cfg.get("lazy_rescale", lazy_rescale(is_fp8, nh, path))), num_warps=nw,
    )  # fmt: skip
    if splits > 1:
        merge_split_partials(part_acc, part_ml, out, meta.query_start_loc, meta.num_seqs)
    return out

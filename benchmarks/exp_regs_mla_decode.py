"""Experiment: fp8 MLA decode with both ``wgmma`` A operands taken from registers (no fp16 copy of the tile).

    PYTHONUNBUFFERED=1 python3 benchmarks/exp_regs_mla_decode.py [--out DIR]

Status: not adopted. Written in the seventh session and compiled offline for sm_90 (Triton 3.6). Its
first GPU run (08:22 UTC, 1x H200) was correct on the first try: max relative difference to the tl.dot
kernel 6.3e-4 to 5.3e-3 (e4m3), 2.3e-3 (e5m2); bound 2^-6. It was slower than the engine's wgmma kernel:
- 16 heads, 32 x 64k: 573.9 vs 472.1 us (50% vs 60% of the copy bandwidth);
- 8 heads, 128 x 64k: 2254.8 vs 1718.9 us (50% vs 66%);
- 16 heads, 1 x 64k: 56.1 vs 36.5 us.

Each program has one tile's loads in flight and nothing across iterations (255 registers, two programs
per SM), so the DRAM latency is exposed.

The ``from_ring`` variants (``regs_ring2``, ``regs_ring3`` in ``VARIANTS``) were written after that run.
cp.async lands the rows in a 2- or 3-stage ring of raw fp8 tiles, and the operands are read from it with
16-byte shared loads in the same register layouts. The next tiles' copies are then in flight across the
whole iteration. Each tile passes shared memory once written and twice read as fp8: about 106 KB instead
of about 212 KB. 2 stages take 95 KB of shared memory (two programs per SM) with an 8-byte spill; 3
stages take 132 KB (one program) with 24. Run in the eighth session (09:51 UTC, 1x H200): correct, and
``regs_ring2`` is the fastest fp8 data flow measured, but only just: 60% (16 heads, 32 x 64k; engine 60%),
64% (128 x 64k; 63%), 70% (8 heads, 128 x 64k; 66%), and slower at batch 1 (16% vs 24%). ``regs_ring3``
reached 40-47%. ``ncu`` and the SASS count put its limit in one warpgroup's instruction stream: 1,183
instructions per tile at 5.1 cycles each with two warps per scheduler (docs/MLA.md). Not routed.
Kept out of the ``kvforge`` package; nothing routes here. ``main`` checks it against the tl.dot kernel and
times it beside the engine's wgmma kernel (:mod:`kvforge.kernels.gluon_mla_decode`).

Why: the engine's fp8 path stages each 64-token tile into an fp16 copy in shared memory that both products
read. Per tile (16 heads) that is ~266 KB of L1/shared-memory traffic for 37 KB of DRAM bytes. ``ncu`` put
the L1 pipe at 77% with DRAM at 48% of peak, which caps that data flow near 70% of the copy bandwidth
(docs/MLA.md, "A ceiling for this data flow"). Here the tile never goes through shared memory:

1. ``S^T [64 tokens, NH] = C [64, 576] q^T``. A is loaded straight from global memory into the
   ``wgmma`` register-operand layout, nine 64-column chunks, two 16-byte loads per thread per chunk.
   The layout gives each thread 4 columns per 16-column k-step. Since the contraction order is free,
   logical column ``k`` of a chunk is read from physical column ``c(k)`` (:func:`chunk_column`). That
   turns a thread's 16 logical columns into 16 contiguous bytes. The query columns are stored permuted
   the same way, so the product is unchanged.
2. Online softmax over the tokens (cross-warp max; the denominator summed once after the loop).
3. ``O^T [512, NH] += C^T [512, 64] P^T``. A (the latent part, transposed) is loaded again from global
   memory; the lines are still in L1 from step 1. The layout gives each thread 16 tokens x 16 latent
   columns. Here the free permutation is of the output columns: accumulator row ``m`` holds physical
   latent column ``latent_column(m)``, applied when the result is stored. Four accumulators of 128
   rows keep the fp16 A operand at 32 registers per product.

L1 traffic per tile: 37 KB of loads for the scores, 32 KB (L1 hits) for ``P x V``, 18 KB of query and
2 KB of P. That is about 89 KB, a third of the fp16-copy path's. Shared memory holds only the query and
P (20 KB), so registers decide occupancy. The relabelings compile to no data movement:
``convert_layout(..., assert_trivial=True)`` accepts them.

Scope: fp8 (e4m3/e5m2) cache, bf16/fp16 query (regime a), R = 512, P = 64, at most 16 heads per program,
block size any power of two. Same partial layout and merge as the engine's kernels.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvforge.kernels.gluon_support import HAS_GLUON, async_copy, gl, gluon, gluon_runs_on  # noqa: E402
from kvforge.kernels.triton_paged_attention import _LOG2E, _num_sms, merge_split_partials  # noqa: E402

if HAS_GLUON:
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from kvforge.kernels.gluon_mla_decode import _issue_rows
    from kvforge.kernels.gluon_mla_decode_ws import (
        PV_OPERAND_LAYOUT,
        SCORE_CHUNK_LAYOUT,
        _latent_column_of,
        _permuted_query,
        _pv_operand,
        _score_operand,
    )

from kvforge.kernels.gluon_mla_decode_ws import chunk_column, latent_column  # noqa: E402,F401  (the maps)

R, P = 512, 64
if HAS_GLUON:  # what the kernel reads (a jit function sees only constexpr globals)
    _R = gl.constexpr(R)
    _P = gl.constexpr(P)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


if HAS_GLUON:

    @gluon.jit
    def _token_offsets(bt_row, start, hi, stride_cb, stride_cs, BLOCK_SIZE: gl.constexpr, ROW_L: gl.constexpr):
        """int64 cache offsets and validity of tokens ``start .. start+63`` in the 1-D layout ``ROW_L``."""
        pos = start + gl.arange(0, 64, layout=ROW_L)
        ok = pos < hi
        blk = gl.load(bt_row + pos // BLOCK_SIZE, mask=ok, other=0).to(gl.int64)
        return blk * stride_cb + (pos % BLOCK_SIZE).to(gl.int64) * stride_cs, ok

    @gluon.jit
    def _regs_mla_decode_kernel(
        ql_ptr, qr_ptr, cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, scale_ptr,
        sm_scale_log2, num_splits,
        stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
        NUM_HEADS: gl.constexpr, NH: gl.constexpr, BLOCK_SIZE: gl.constexpr, USE_SPLIT: gl.constexpr,
        FROM_RING: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 16])
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        LX: gl.constexpr = SCORE_CHUNK_LAYOUT  # the operand layouts (gluon_mla_decode_ws)
        LY: gl.constexpr = PV_OPERAND_LAYOUT
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, NH], gl.float16)
        Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])

        seq = gl.program_id(0)
        hb = gl.program_id(1)
        split = gl.program_id(2)
        tok = gl.load(qsl_ptr + seq)
        if gl.load(qsl_ptr + seq + 1) <= tok:
            return
        seq_len = gl.load(seq_lens_ptr + seq)
        qk_scale = sm_scale_log2 * gl.load(scale_ptr)

        # The query, columns permuted chunk by chunk (chunk_column), fp16, zero rows for padded heads.
        t64 = tok.to(gl.int64)
        ql_smem, qr_smem = _permuted_query(ql_ptr, qr_ptr, t64, hb, stride_qlt, stride_qlh, stride_qrt, stride_qrh,
                                           NH, NUM_HEADS, Q_L, Q_SMEM)  # fmt: skip
        p_smem = gl.allocate_shared_memory(gl.float16, [64, NH], P_SMEM)
        fence_async_shared()

        lo = 0
        hi = seq_len
        if USE_SPLIT:
            chunk = gl.cdiv(gl.cdiv(hi, num_splits), 64) * 64
            lo = split * chunk
            hi = gl.minimum(lo + chunk, hi)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), 64)
        bt_row = bt_ptr + seq.to(gl.int64) * stride_bt
        cx = gl.arange(0, 64, layout=gl.SliceLayout(0, LX))
        cy = gl.arange(0, _R, layout=gl.SliceLayout(0, LY))
        if FROM_RING:
            # FROM_RING: the rows land in a NUM_STAGES-deep ring of raw fp8 tiles by cp.async (as the engine's
            # fp8 ring path lands them), and both operands are read from it with 16-byte shared loads in the
            # same register layouts. Nothing reads the ring through the async proxy, so it needs no proxy
            # fence, and the copies of later tiles stay in flight across the one before P x V. The 16-byte
            # XOR swizzle keeps both read patterns free of bank conflicts (worked out by hand, not measured).
            RAW: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
            LAT_COPY: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0])
            ROPE_COPY: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
            lat_ring = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [NUM_STAGES, 64, _R], RAW)
            rope_ring = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [NUM_STAGES, 64, _P], RAW)
            for j in gl.static_range(NUM_STAGES - 1):
                _issue_rows(lat_ring.index(j), rope_ring.index(j), cache_ptr, bt_row, lo + j * 64, hi, stride_cb,
                            stride_cs, BLOCK_SIZE, 64, _R, _P, LAT_COPY, ROPE_COPY)  # fmt: skip

        m_i = gl.full([NH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
        l_tile = gl.zeros([64, NH], gl.float32, layout=MMA)
        acc0 = gl.zeros([128, NH], gl.float32, layout=MMA)
        acc1 = gl.zeros([128, NH], gl.float32, layout=MMA)
        acc2 = gl.zeros([128, NH], gl.float32, layout=MMA)
        acc3 = gl.zeros([128, NH], gl.float32, layout=MMA)
        n_off = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
        s_zero = gl.zeros([64, NH], gl.float32, layout=MMA)
        # No prefetch across iterations: a load in flight at the proxy fence before P x V would be waited for
        # there (the fence is a MEMBAR). A rotated loop that issued the next tile's score rows before this
        # tile's P x V was compiled offline (sm_90, Triton 3.6): ptxas sank those loads below the P x V wgmmas,
        # next to their use, so it prefetched nothing and was dropped.
        for i in range(num_tiles):
            start = lo + i * 64
            if FROM_RING:
                stage = i % NUM_STAGES
                async_copy.wait_group(NUM_STAGES - 2)
                gl.thread_barrier()  # tile i landed for every thread; tile i-1's stage is free
                nxt = i + NUM_STAGES - 1
                _issue_rows(lat_ring.index(nxt % NUM_STAGES), rope_ring.index(nxt % NUM_STAGES), cache_ptr, bt_row,
                            lo + nxt * 64, hi, stride_cb, stride_cs, BLOCK_SIZE, 64, _R, _P, LAT_COPY,
                            ROPE_COPY)  # fmt: skip
                lat = lat_ring.index(stage)
                x0 = lat.slice(0, 64, dim=1).load(LX)
                x1 = lat.slice(64, 64, dim=1).load(LX)
                x2 = lat.slice(128, 64, dim=1).load(LX)
                x3 = lat.slice(192, 64, dim=1).load(LX)
                x4 = lat.slice(256, 64, dim=1).load(LX)
                x5 = lat.slice(320, 64, dim=1).load(LX)
                x6 = lat.slice(384, 64, dim=1).load(LX)
                x7 = lat.slice(448, 64, dim=1).load(LX)
                x8 = rope_ring.index(stage).load(LX)
            else:
                row_x, ok_x = _token_offsets(bt_row, start, hi, stride_cb, stride_cs, BLOCK_SIZE,
                                             gl.SliceLayout(1, LX))  # fmt: skip
                px = cache_ptr + row_x[:, None] + cx[None, :]
                mx = ok_x[:, None] & (cx >= 0)[None, :]
                # the whole tile's score operand goes out at once (72 registers of fp8)
                x0 = gl.load(px, mask=mx, other=0.0)
                x1 = gl.load(px + 64, mask=mx, other=0.0)
                x2 = gl.load(px + 128, mask=mx, other=0.0)
                x3 = gl.load(px + 192, mask=mx, other=0.0)
                x4 = gl.load(px + 256, mask=mx, other=0.0)
                x5 = gl.load(px + 320, mask=mx, other=0.0)
                x6 = gl.load(px + 384, mask=mx, other=0.0)
                x7 = gl.load(px + 448, mask=mx, other=0.0)
                x8 = gl.load(px + 512, mask=mx, other=0.0)
            # One chunk's wgmma in flight while the next chunk converts; an operand's registers stay alive
            # (the wait's deps) until the wait that retires its wgmma.
            a0 = _score_operand(x0, DOT_A)
            s = warpgroup_mma(a0, ql_smem.slice(0, 64, dim=1).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            a1 = _score_operand(x1, DOT_A)
            s = warpgroup_mma(a1, ql_smem.slice(64, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a0 = warpgroup_mma_wait(1, deps=(s, a0))
            a2 = _score_operand(x2, DOT_A)
            s = warpgroup_mma(a2, ql_smem.slice(128, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a1 = warpgroup_mma_wait(1, deps=(s, a1))
            a3 = _score_operand(x3, DOT_A)
            s = warpgroup_mma(a3, ql_smem.slice(192, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a2 = warpgroup_mma_wait(1, deps=(s, a2))
            a4 = _score_operand(x4, DOT_A)
            s = warpgroup_mma(a4, ql_smem.slice(256, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a3 = warpgroup_mma_wait(1, deps=(s, a3))
            a5 = _score_operand(x5, DOT_A)
            s = warpgroup_mma(a5, ql_smem.slice(320, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a4 = warpgroup_mma_wait(1, deps=(s, a4))
            a6 = _score_operand(x6, DOT_A)
            s = warpgroup_mma(a6, ql_smem.slice(384, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a5 = warpgroup_mma_wait(1, deps=(s, a5))
            a7 = _score_operand(x7, DOT_A)
            s = warpgroup_mma(a7, ql_smem.slice(448, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a6 = warpgroup_mma_wait(1, deps=(s, a6))
            a8 = _score_operand(x8, DOT_A)
            s = warpgroup_mma(a8, qr_smem.permute((1, 0)), s, is_async=True)
            s, a7 = warpgroup_mma_wait(1, deps=(s, a7))
            if not FROM_RING:
                row_y, ok_y = _token_offsets(bt_row, start, hi, stride_cb, stride_cs, BLOCK_SIZE,
                                             gl.SliceLayout(1, LY))  # fmt: skip
            s, a8 = warpgroup_mma_wait(0, deps=(s, a8))

            s = s * qk_scale
            s = gl.where((start + n_off < hi)[:, None], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 0))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s - m_use[None, :])
            l_tile = l_tile * alpha[None, :] + p
            m_i = m_new
            gl.thread_barrier()  # every warp's previous P x V finished reading p_smem
            p_smem.store(p.to(gl.float16))
            fence_async_shared()
            gl.thread_barrier()
            # The P x V operand: the same lines again, now in L1. Loaded only here, after the barrier: hoisted
            # above the score product (as ptxas did) it doubled the live fp8 registers and spilled; before the
            # proxy fence it would be waited for there (the fence is a MEMBAR).
            if FROM_RING:
                y = lat.load(LY)
            else:
                y = gl.load(cache_ptr + row_y[:, None] + cy[None, :], mask=ok_y[:, None] & (cy >= 0)[None, :],
                            other=0.0)  # fmt: skip
            y = gl.reshape(y, [64, 32, 2, 2, 4])  # (token, c4..c8, c3, c2, c0 c1), still fp8: 64 registers
            y = gl.permute(y, (0, 1, 3, 4, 2))
            y_c3lo, y_c3hi = gl.split(y)
            y0, y1 = gl.split(gl.permute(y_c3lo, (0, 1, 3, 2)))
            y2, y3 = gl.split(gl.permute(y_c3hi, (0, 1, 3, 2)))
            b0 = _pv_operand(y0, DOT_A)
            acc0 = warpgroup_mma(b0, p_smem, acc0 * alpha[None, :], is_async=True)
            b1 = _pv_operand(y1, DOT_A)
            acc1 = warpgroup_mma(b1, p_smem, acc1 * alpha[None, :], is_async=True)
            acc0, b0 = warpgroup_mma_wait(1, deps=(acc0, b0))
            b2 = _pv_operand(y2, DOT_A)
            acc2 = warpgroup_mma(b2, p_smem, acc2 * alpha[None, :], is_async=True)
            acc1, b1 = warpgroup_mma_wait(1, deps=(acc1, b1))
            b3 = _pv_operand(y3, DOT_A)
            acc3 = warpgroup_mma(b3, p_smem, acc3 * alpha[None, :], is_async=True)
            acc2, b2 = warpgroup_mma_wait(1, deps=(acc2, b2))
            acc3, b3 = warpgroup_mma_wait(0, deps=(acc3, b3))

        if FROM_RING:
            async_copy.wait_group(0)
        l_i = gl.sum(l_tile, 0)
        scale = gl.load(scale_ptr)
        ho = hb * NH + gl.arange(0, NH, layout=gl.SliceLayout(0, MMA))
        h_ok = ho < NUM_HEADS
        # accumulator j holds rows m = 128 j + r, i.e. physical latent columns latent_column(128 j + r)
        mrow = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
        co0 = _latent_column_of(mrow)
        co1 = _latent_column_of(mrow + 128)
        co2 = _latent_column_of(mrow + 256)
        co3 = _latent_column_of(mrow + 384)
        mask = (mrow >= 0)[:, None] & h_ok[None, :]
        if USE_SPLIT:
            pidx = (t64 * NUM_HEADS + ho.to(gl.int64)) * num_splits + split
            if num_tiles > 0:
                base = part_acc_ptr + (pidx * _R)[None, :]
                gl.store(base + co0[:, None], acc0 * scale, mask=mask)
                gl.store(base + co1[:, None], acc1 * scale, mask=mask)
                gl.store(base + co2[:, None], acc2 * scale, mask=mask)
                gl.store(base + co3[:, None], acc3 * scale, mask=mask)
            gl.store(part_ml_ptr + pidx * 2, m_i, mask=h_ok)
            gl.store(part_ml_ptr + pidx * 2 + 1, l_i, mask=h_ok)
        else:
            inv = scale / l_i
            base = out_ptr + t64 * stride_ot + (ho.to(gl.int64) * stride_oh)[None, :]
            ty = out_ptr.dtype.element_ty
            gl.store(base + co0[:, None], (acc0 * inv[None, :]).to(ty), mask=mask)
            gl.store(base + co1[:, None], (acc1 * inv[None, :]).to(ty), mask=mask)
            gl.store(base + co2[:, None], (acc2 * inv[None, :]).to(ty), mask=mask)
            gl.store(base + co3[:, None], (acc3 * inv[None, :]).to(ty), mask=mask)


def supports(q_latent: torch.Tensor, cache: torch.Tensor) -> bool:
    """fp8 cache, bf16/fp16 query, R = 512, P = 64, at most 16 heads, sm_90 with the tested Triton."""
    _t, h, r = q_latent.shape
    return (gluon_runs_on(q_latent) and cache.dtype in _FP8 and q_latent.dtype in (torch.bfloat16, torch.float16)
            and r == R and cache.shape[-1] == R + P and h <= 16)  # fmt: skip


def mla_decode_regs(q_latent, q_rope, cache, meta, scale, softmax_scale, *, num_splits=None, programs_per_sm=2,
                    from_ring=False, stages=2):
    """``o_latent [T, H, R]`` as ``gluon_mla_decode.mla_decode_wgmma`` computes it (fp8 cache only).
    ``from_ring``: operands read from a ``stages``-deep cp.async ring (kernel comment) instead of global."""
    if not supports(q_latent, cache):
        raise ValueError("outside the register-operand MLA experiment's scope (see supports)")
    t, h, r = q_latent.shape
    nh = 8 if h <= 8 else 16
    head_blocks = -(-h // nh)
    out = torch.empty((t, h, r), dtype=q_latent.dtype, device=q_latent.device)
    scale = scale.to(torch.float32).reshape(-1)[:1]
    if num_splits is None:
        fill = programs_per_sm * _num_sms(q_latent.device) // max(1, meta.num_seqs * head_blocks)
        num_splits = max(1, min(fill, meta.max_seq_len // 256, 256))
    # Always through the partials and the merge: the unsplit epilogue (dividing four accumulators in place)
    # spilled 136 bytes at 16 heads when compiled offline.
    part_acc = torch.empty((t, h, num_splits, r), dtype=torch.float32, device=q_latent.device)
    part_ml = torch.empty((t, h, num_splits, 2), dtype=torch.float32, device=q_latent.device)
    _regs_mla_decode_kernel[(meta.num_seqs, head_blocks, num_splits)](
        q_latent, q_rope, cache, out, part_acc, part_ml, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale, float(softmax_scale) * _LOG2E, num_splits,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), meta.block_tables.stride(0),
        NUM_HEADS=h, NH=nh, BLOCK_SIZE=cache.shape[1], USE_SPLIT=True, FROM_RING=bool(from_ring),
        NUM_STAGES=int(stages), num_warps=4,
    )  # fmt: skip
    merge_split_partials(part_acc, part_ml, out, meta.query_start_loc, meta.num_seqs)
    return out


#: What ``main`` checks against the tl.dot kernel and times beside the engine's kernel.
VARIANTS = {
    "regs": mla_decode_regs,
    "regs_ring2": functools.partial(mla_decode_regs, from_ring=True, stages=2),
    "regs_ring3": functools.partial(mla_decode_regs, from_ring=True, stages=3, programs_per_sm=1),
}


def compare_fp8_variants(variants: dict, shapes: str, out_dir: str | None, json_name: str) -> list:
    """Check each fp8 decode ``variants[label](ql, qr, cache, meta, scale, softmax_scale)`` against the tl.dot
    kernel (bound 2^-6 of max|ref|; e5m2 too up to 4k tokens), then time the correct ones beside the wgmma
    kernel's own fp8 path, each ``HEADSxBATCHxCTX`` of ``shapes``; prints a line per shape and writes
    ``json_name`` under ``out_dir``. A variant that raises ``ValueError`` (outside its scope) is skipped."""
    from bench_mla_decode import SOFTMAX_SCALE, bench, bytes_read, copy_bandwidth, make_case

    from kvforge.kernels.gluon_mla_decode import mla_decode_wgmma
    from kvforge.kernels.triton_mla_decode import mla_decode

    cbw = copy_bandwidth()
    print(f"copy bandwidth {cbw / 1e12:.2f} TB/s", flush=True)
    scale = torch.tensor([0.75], device="cuda")
    rows = []
    for shape in shapes.split(","):
        heads, batch, ctx = (int(v) for v in shape.split("x"))
        row = dict(heads=heads, batch=batch, ctx=ctx)
        for name, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
            if name == "e5m2" and ctx > 4096:
                continue  # one long e5m2 case would only repeat the e4m3 timing
            cache, meta, ql, qr = make_case(batch, ctx, heads, dt)
            want = mla_decode(ql, qr, cache, meta, scale, SOFTMAX_SCALE, _config={"wgmma": False}).float()
            ok = {}
            for label, fn in variants.items():
                try:
                    got = fn(ql, qr, cache, meta, scale, SOFTMAX_SCALE).float()
                except ValueError:  # outside that variant's scope (regs_ring2: at most 16 heads)
                    continue
                rel = ((got - want).abs().max() / want.abs().max()).item()
                ok[label] = bool(torch.isfinite(got).all()) and rel <= (2.0 ** -4 if "fp8_query" in label else 2.0 ** -6)
                row[f"{name}_{label}_max_rel"] = rel
            nbytes = bytes_read(batch, ctx, heads, 1)
            if name == "e4m3":
                timed = {k: v for k, v in variants.items() if ok.get(k)}
                # the wgmma kernel's own fp8 path (any cfg keeps it off the warp-specialized kernel)
                wgmma = functools.partial(mla_decode_wgmma, cfg={"fp8_path": 1})
                for label, fn in dict(timed, wgmma=wgmma).items():
                    med, lo, hi = bench(functools.partial(fn, ql, qr, cache, meta, scale, SOFTMAX_SCALE))
                    row[label] = dict(us=med, min=lo, max=hi, pct_copy=100 * nbytes / (med * 1e-6) / cbw)
            del cache
        rows.append(row)
        cells = [f"{k} {v:.1e}" for k, v in row.items() if k.endswith("max_rel")]
        cells += [f"{k} {v['us']:.1f} us ({v['pct_copy']:.0f}%)" for k, v in row.items() if isinstance(v, dict)]
        print(f"H{heads} {batch}x{ctx}: " + " | ".join(cells), flush=True)
    if out_dir:
        with open(os.path.join(out_dir, json_name), "w") as f:
            json.dump(dict(copy_tbps=cbw / 1e12, gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="16x1x65536,16x8x65536,16x32x65536,16x128x65536,8x32x65536,8x128x65536,"
                                        "16x32x4096,16x3x1000")
    a = ap.parse_args()
    compare_fp8_variants(VARIANTS, a.shapes, a.out, "exp_regs_mla_decode.json")


if __name__ == "__main__":
    main()

"""Experiment: warp-specialized fp8 MLA decode (a producer warp and two consumer warpgroups per SM).

    PYTHONUNBUFFERED=1 python3 benchmarks/exp_ws_mla_decode.py [--out DIR]

Status: an experiment, outside the ``kvforge`` package; nothing routes here. ``main`` checks it against the
tl.dot kernel and times it beside the engine's wgmma kernel and ``regs_ring2``.

Why (docs/MLA.md, "The register-operand experiment"): ``regs_ring2`` reads each fp8 tile from a cp.async
ring straight into the ``wgmma`` register-operand layouts, so its shared-memory traffic is about 106 KB per
64-token tile instead of the engine path's 212 KB. ``ncu`` put its limit in one warpgroup's instruction
stream: 1,183 instructions per tile, 221 of them integer arithmetic for the cp.async addresses, issued by
the same warps that convert and multiply, with two programs per SM.

Here one CTA per SM splits the roles (``gl.warp_specialize``):
- a producer warp walks the block table and issues the cp.async copies of every tile of the split into
  an ``NUM_STAGES``-deep ring of raw fp8 tiles; each thread's ``cp.async.mbarrier.arrive.noinc`` marks a
  stage ready when its copies land (``ready`` barriers, count 32);
- two consumer warpgroups take alternate tiles (even and odd), each with its own online softmax and
  accumulators, and read their operands from the ring exactly as ``regs_ring2`` does; each one releases
  a stage (``empty`` barrier) at the top of its next iteration, after a partition barrier proves that all
  its warps finished the previous products;
- each consumer writes its own split partial (split ``2 s + parity``), so the paged merge kernel combines
  the two halves with the other splits.

Consumers do no address arithmetic and never wait for a copy they issued; the producer's loads run up to
``NUM_STAGES - 2`` tiles ahead of the slower consumer. Lazy rescaling (``RESCALE_LOG2``) as in the engine.

Invariants: ring stage of tile i is ``i % NUM_STAGES``, its fill number ``i // NUM_STAGES`` (barrier phase
parity). A consumer releases tile ``i - 2``'s stage before waiting for tile i, so any ``NUM_STAGES >= 2``
is deadlock-free. Rows at or past the split end are zero-filled by the copies and masked to ``-inf``.
Scope: fp8 (e4m3/e5m2) cache, bf16/fp16 query, R = 512, P = 64, at most 16 heads per program.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from exp_regs_mla_decode import (  # noqa: E402
    _chunk_column_of,
    _latent_column_of,
    _pv_operand,
    _score_operand,
)

from kvforge.kernels.gluon_support import HAS_GLUON, async_copy, gl, gluon, gluon_runs_on  # noqa: E402
from kvforge.kernels.triton_paged_attention import _LOG2E, _num_sms, merge_split_partials  # noqa: E402

if HAS_GLUON:
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

R, P = 512, 64
if HAS_GLUON:
    _R = gl.constexpr(R)
    _P = gl.constexpr(P)
    _RESCALE_LOG2 = gl.constexpr(8.0)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


if HAS_GLUON:

    @gluon.jit
    def _produce(ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                 stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts,
                 NH: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr, LAZY: gl.constexpr):  # fmt: skip
        """The producer (the default partition, 4 warps): every tile's rows into the ring, one stage per tile,
        as stages free up. The latent part goes in four 16-row slices so that a thread holds the offsets of 4
        rows at a time (the partition runs on 24 registers)."""
        LAT_COPY: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [gl.num_warps(), 1], [1, 0])
        ROPE_COPY: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [gl.num_warps(), 1], [1, 0])
        c = gl.arange(0, _R, layout=gl.SliceLayout(0, LAT_COPY))
        cr = gl.arange(0, _P, layout=gl.SliceLayout(0, ROPE_COPY))
        n = gl.arange(0, 16, layout=gl.SliceLayout(1, LAT_COPY))
        nr = gl.arange(0, 64, layout=gl.SliceLayout(1, ROPE_COPY))
        for i in range(num_tiles):
            stage = i % NUM_STAGES
            mbarrier.wait(empty.index(stage), ((i // NUM_STAGES) & 1) ^ 1)  # first fill: passes at once
            start = lo + i * 64
            for q in gl.static_range(4):
                pos = start + 16 * q + n
                ok = pos < hi
                blk = gl.load(bt_row + pos // BLOCK_SIZE, mask=ok, other=0).to(gl.int64)
                row = blk * stride_cb + (pos % BLOCK_SIZE).to(gl.int64) * stride_cs
                async_copy.async_copy_global_to_shared(
                    lat_ring.index(stage).slice(16 * q, 16, dim=0), cache_ptr + row[:, None] + c[None, :],
                    mask=ok[:, None] & (c >= 0)[None, :],
                )  # fmt: skip
            pos_r = start + nr
            ok_r = pos_r < hi
            blk_r = gl.load(bt_row + pos_r // BLOCK_SIZE, mask=ok_r, other=0).to(gl.int64)
            row_r = blk_r * stride_cb + (pos_r % BLOCK_SIZE).to(gl.int64) * stride_cs
            async_copy.async_copy_global_to_shared(
                rope_ring.index(stage), cache_ptr + _R + row_r[:, None] + cr[None, :],
                mask=ok_r[:, None] & (cr >= 0)[None, :],
            )  # fmt: skip
            async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)

    @gluon.jit
    def _consume(ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                 stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts,
                 NH: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr,
                 LAZY: gl.constexpr, PARITY: gl.constexpr):  # fmt: skip
        """One consumer warpgroup: tiles PARITY, PARITY + 2, ... of the split; writes partial 2 s + PARITY."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 16])
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        LX: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]], lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64])  # fmt: skip
        LY: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0], [16, 0], [32, 0]],
            lane_bases=[[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]], warp_bases=[[0, 128], [0, 256]], block_bases=[],
            shape=[64, 512])  # fmt: skip
        p_buf = p_smem.index(PARITY)
        m_i = gl.full([NH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
        l_tile = gl.zeros([64, NH], gl.float32, layout=MMA)
        acc0 = gl.zeros([128, NH], gl.float32, layout=MMA)
        acc1 = gl.zeros([128, NH], gl.float32, layout=MMA)
        acc2 = gl.zeros([128, NH], gl.float32, layout=MMA)
        acc3 = gl.zeros([128, NH], gl.float32, layout=MMA)
        n_off = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
        s_zero = gl.zeros([64, NH], gl.float32, layout=MMA)
        mine = (num_tiles + 1 - PARITY) // 2
        for j in range(mine):
            i = PARITY + 2 * j
            stage = i % NUM_STAGES
            gl.thread_barrier()  # all four warps finished tile i-2's products: its operands and p_buf are free
            if j > 0:
                mbarrier.arrive(empty.index((i - 2) % NUM_STAGES), count=1)
            mbarrier.wait(ready.index(stage), (i // NUM_STAGES) & 1)
            lat = lat_ring.index(stage)
            # Each 64-column chunk is read from the ring just before its conversion (all nine at once would
            # hold 72 registers of fp8 beside the accumulators); one chunk's wgmma runs while the next converts.
            a0 = _score_operand(lat.slice(0, 64, dim=1).load(LX), DOT_A)
            s = warpgroup_mma(a0, ql_smem.slice(0, 64, dim=1).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            a1 = _score_operand(lat.slice(64, 64, dim=1).load(LX), DOT_A)
            s = warpgroup_mma(a1, ql_smem.slice(64, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a0 = warpgroup_mma_wait(1, deps=(s, a0))
            a2 = _score_operand(lat.slice(128, 64, dim=1).load(LX), DOT_A)
            s = warpgroup_mma(a2, ql_smem.slice(128, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a1 = warpgroup_mma_wait(1, deps=(s, a1))
            a3 = _score_operand(lat.slice(192, 64, dim=1).load(LX), DOT_A)
            s = warpgroup_mma(a3, ql_smem.slice(192, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a2 = warpgroup_mma_wait(1, deps=(s, a2))
            a4 = _score_operand(lat.slice(256, 64, dim=1).load(LX), DOT_A)
            s = warpgroup_mma(a4, ql_smem.slice(256, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a3 = warpgroup_mma_wait(1, deps=(s, a3))
            a5 = _score_operand(lat.slice(320, 64, dim=1).load(LX), DOT_A)
            s = warpgroup_mma(a5, ql_smem.slice(320, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a4 = warpgroup_mma_wait(1, deps=(s, a4))
            a6 = _score_operand(lat.slice(384, 64, dim=1).load(LX), DOT_A)
            s = warpgroup_mma(a6, ql_smem.slice(384, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a5 = warpgroup_mma_wait(1, deps=(s, a5))
            a7 = _score_operand(lat.slice(448, 64, dim=1).load(LX), DOT_A)
            s = warpgroup_mma(a7, ql_smem.slice(448, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a6 = warpgroup_mma_wait(1, deps=(s, a6))
            a8 = _score_operand(rope_ring.index(stage).load(LX), DOT_A)
            s = warpgroup_mma(a8, qr_smem.permute((1, 0)), s, is_async=True)
            s, a7 = warpgroup_mma_wait(1, deps=(s, a7))
            s, a8 = warpgroup_mma_wait(0, deps=(s, a8))

            s = s * qk_scale
            s = gl.where((lo + i * 64 + n_off < hi)[:, None], s, float("-inf"))
            if LAZY:
                m_cand = gl.maximum(m_i, gl.max(s, 0))
                if gl.max((m_cand - m_i > _RESCALE_LOG2).to(gl.int32), 0) > 0:  # also true on the first tile
                    alpha = gl.exp2(m_i - gl.where(m_cand == float("-inf"), 0.0, m_cand))
                    acc0 = acc0 * alpha[None, :]
                    acc1 = acc1 * alpha[None, :]
                    acc2 = acc2 * alpha[None, :]
                    acc3 = acc3 * alpha[None, :]
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
                acc0 = acc0 * alpha[None, :]
                acc1 = acc1 * alpha[None, :]
                acc2 = acc2 * alpha[None, :]
                acc3 = acc3 * alpha[None, :]
                m_i = m_new
            p_buf.store(p.to(gl.float16))
            fence_async_shared()
            gl.thread_barrier()
            y = lat.load(LY)
            y = gl.reshape(y, [64, 32, 2, 2, 4])
            y = gl.permute(y, (0, 1, 3, 4, 2))
            y_c3lo, y_c3hi = gl.split(y)
            y0, y1 = gl.split(gl.permute(y_c3lo, (0, 1, 3, 2)))
            y2, y3 = gl.split(gl.permute(y_c3hi, (0, 1, 3, 2)))
            b0 = _pv_operand(y0, DOT_A)
            acc0 = warpgroup_mma(b0, p_buf, acc0, is_async=True)
            b1 = _pv_operand(y1, DOT_A)
            acc1 = warpgroup_mma(b1, p_buf, acc1, is_async=True)
            acc0, b0 = warpgroup_mma_wait(1, deps=(acc0, b0))
            b2 = _pv_operand(y2, DOT_A)
            acc2 = warpgroup_mma(b2, p_buf, acc2, is_async=True)
            acc1, b1 = warpgroup_mma_wait(1, deps=(acc1, b1))
            b3 = _pv_operand(y3, DOT_A)
            acc3 = warpgroup_mma(b3, p_buf, acc3, is_async=True)
            acc2, b2 = warpgroup_mma_wait(1, deps=(acc2, b2))
            acc3, b3 = warpgroup_mma_wait(0, deps=(acc3, b3))

        l_i = gl.sum(l_tile, 0)
        ho = gl.arange(0, NH, layout=gl.SliceLayout(0, MMA))
        h_ok = (pidx0 // num_parts) % NUM_HEADS + ho < NUM_HEADS  # heads past the last one (padded block)
        pidx = pidx0 + ho.to(gl.int64) * num_parts + PARITY  # paged merge-kernel layout
        mrow = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
        mask = (mrow >= 0)[:, None] & h_ok[None, :]
        if mine > 0:
            base = part_acc_ptr + (pidx * _R)[None, :]
            gl.store(base + _latent_column_of(mrow)[:, None], acc0 * scale, mask=mask)
            gl.store(base + _latent_column_of(mrow + 128)[:, None], acc1 * scale, mask=mask)
            gl.store(base + _latent_column_of(mrow + 256)[:, None], acc2 * scale, mask=mask)
            gl.store(base + _latent_column_of(mrow + 384)[:, None], acc3 * scale, mask=mask)
        gl.store(part_ml_ptr + pidx * 2, m_i, mask=h_ok)
        gl.store(part_ml_ptr + pidx * 2 + 1, l_i, mask=h_ok)

    @gluon.jit
    def _consume_odd(ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi,
                     num_tiles, stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts,
                     NH: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                     NUM_STAGES: gl.constexpr, LAZY: gl.constexpr):  # fmt: skip
        _consume(ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                 stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts, NH, NUM_HEADS,
                 BLOCK_SIZE, NUM_STAGES, LAZY, 1)  # fmt: skip

    @gluon.jit
    def _consume_even(ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi,
                     num_tiles, stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts,
                     NH: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                     NUM_STAGES: gl.constexpr, LAZY: gl.constexpr):  # fmt: skip
        _consume(ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                 stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts, NH, NUM_HEADS,
                 BLOCK_SIZE, NUM_STAGES, LAZY, 0)  # fmt: skip

    @gluon.jit
    def _ws_mla_decode_kernel(
        ql_ptr, qr_ptr, cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, scale_ptr,
        sm_scale_log2, num_splits,
        stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
        NUM_HEADS: gl.constexpr, NH: gl.constexpr, BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, LAZY: gl.constexpr,
        PRODUCER_IS_DEFAULT: gl.constexpr,
    ):  # fmt: skip
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, NH], gl.float16)
        Q_L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        RAW: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])

        # head blocks vary fastest in the launch order, so the CTAs that read the same rows for different heads
        # run at the same time and share them through L2
        hb = gl.program_id(0)
        seq = gl.program_id(1)
        split = gl.program_id(2)
        tok = gl.load(qsl_ptr + seq)
        if gl.load(qsl_ptr + seq + 1) <= tok:
            return
        seq_len = gl.load(seq_lens_ptr + seq)
        scale = gl.load(scale_ptr)
        qk_scale = sm_scale_log2 * scale

        t64 = tok.to(gl.int64)
        hq = hb * NH + gl.arange(0, NH, layout=gl.SliceLayout(1, Q_L))
        kq = gl.arange(0, _R, layout=gl.SliceLayout(0, Q_L))
        cq = (kq // 64) * 64 + _chunk_column_of(kq % 64)
        ql = gl.load(ql_ptr + t64 * stride_qlt + (hq.to(gl.int64) * stride_qlh)[:, None] + cq[None, :],
                     mask=(hq < NUM_HEADS)[:, None] & (cq >= 0)[None, :], other=0.0)  # fmt: skip
        kr = gl.arange(0, _P, layout=gl.SliceLayout(0, Q_L))
        cr = _chunk_column_of(kr)
        qr = gl.load(qr_ptr + t64 * stride_qrt + (hq.to(gl.int64) * stride_qrh)[:, None] + cr[None, :],
                     mask=(hq < NUM_HEADS)[:, None] & (cr >= 0)[None, :], other=0.0)  # fmt: skip
        ql_smem = gl.allocate_shared_memory(gl.float16, [NH, _R], Q_SMEM, ql.to(gl.float16))
        qr_smem = gl.allocate_shared_memory(gl.float16, [NH, _P], Q_SMEM, qr.to(gl.float16))
        p_smem = gl.allocate_shared_memory(gl.float16, [2, 64, NH], P_SMEM)
        lat_ring = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [NUM_STAGES, 64, _R], RAW)
        rope_ring = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [NUM_STAGES, 64, _P], RAW)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for k in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(k), count=32 * gl.num_warps())  # one noinc arrive per producer thread
            mbarrier.init(empty.index(k), count=1)  # one arrive from the consumer that read the stage
        fence_async_shared()

        chunk = gl.cdiv(gl.cdiv(seq_len, num_splits), 64) * 64
        lo = split * chunk
        hi = gl.minimum(lo + chunk, seq_len)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), 64)
        bt_row = bt_ptr + seq.to(gl.int64) * stride_bt
        num_parts = 2 * num_splits
        pidx0 = (t64 * NUM_HEADS + hb * NH) * num_parts + 2 * split
        # The argument tuples are written out: a tuple bound to a name first turns its constexprs into tensors
        # (Triton 3.6).
        if PRODUCER_IS_DEFAULT:
            # the producer runs in the kernel's own 4 warps on what the two consumers leave (24 registers)
            gl.warp_specialize([
                (_produce, (ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                                stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts, NH,
                                NUM_HEADS, BLOCK_SIZE, NUM_STAGES, LAZY)),
                (_consume_even, (ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                                stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts, NH,
                                NUM_HEADS, BLOCK_SIZE, NUM_STAGES, LAZY)),
                (_consume_odd, (ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                                stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts, NH,
                                NUM_HEADS, BLOCK_SIZE, NUM_STAGES, LAZY)),
            ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])  # fmt: skip
        else:
            gl.warp_specialize([
                (_consume_even, (ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                                stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts, NH,
                                NUM_HEADS, BLOCK_SIZE, NUM_STAGES, LAZY)),
                (_consume_odd, (ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                                stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts, NH,
                                NUM_HEADS, BLOCK_SIZE, NUM_STAGES, LAZY)),
                (_produce, (ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                                stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts, NH,
                                NUM_HEADS, BLOCK_SIZE, NUM_STAGES, LAZY)),
            ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


#: Launch defaults: 5 stages (184 KB of ring; one CTA per SM); three warpgroups (12 warps) under maxnreg 168,
#: i.e. a pool of 64,512 registers: the producer's warpgroup gets 40 a thread, the odd consumer 232 and the
#: even one (the kernel's own warps) what is left, 232. ``producer_is_default``: the producer runs in the
#: kernel's own warps instead, on what two 240-register consumers leave (24; measured 11-13% slower).
#: ``nh``: heads per program (0: 8 up to 8 heads, else 16).
DEFAULT_CFG = dict(stages=5, consumer_regs=232, producer_regs=40, maxnreg=168, lazy=1, producer_is_default=0, nh=0)


def supports(q_latent: torch.Tensor, cache: torch.Tensor) -> bool:
    _t, h, r = q_latent.shape
    return (gluon_runs_on(q_latent) and cache.dtype in _FP8 and q_latent.dtype in (torch.bfloat16, torch.float16)
            and r == R and cache.shape[-1] == R + P and h <= 128)  # fmt: skip


def mla_decode_ws(q_latent, q_rope, cache, meta, scale, softmax_scale, *, num_splits=None, cfg=None):
    """``o_latent [T, H, R]`` as ``gluon_mla_decode.mla_decode_wgmma`` computes it (fp8 cache only)."""
    if not supports(q_latent, cache):
        raise ValueError("outside the warp-specialized MLA experiment's scope (see supports)")
    cfg = dict(DEFAULT_CFG, **(cfg or {}))
    t, h, r = q_latent.shape
    nh = cfg.get("nh") or (8 if h <= 8 else 16)
    head_blocks = -(-h // nh)
    out = torch.empty((t, h, r), dtype=q_latent.dtype, device=q_latent.device)
    scale = scale.to(torch.float32).reshape(-1)[:1]
    if num_splits is None:
        fill = _num_sms(q_latent.device) // max(1, meta.num_seqs * head_blocks)
        num_splits = max(1, min(fill, meta.max_seq_len // 512, 128))
    part_acc = torch.empty((t, h, 2 * num_splits, r), dtype=torch.float32, device=q_latent.device)
    part_ml = torch.empty((t, h, 2 * num_splits, 2), dtype=torch.float32, device=q_latent.device)
    _ws_mla_decode_kernel[(head_blocks, meta.num_seqs, num_splits)](
        q_latent, q_rope, cache, out, part_acc, part_ml, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale, float(softmax_scale) * _LOG2E, num_splits,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), meta.block_tables.stride(0),
        NUM_HEADS=h, NH=nh, BLOCK_SIZE=cache.shape[1], NUM_STAGES=cfg["stages"],
        CONSUMER_REGS=cfg["consumer_regs"], PRODUCER_REGS=cfg["producer_regs"], LAZY=bool(cfg["lazy"]),
        PRODUCER_IS_DEFAULT=bool(cfg["producer_is_default"]), num_warps=4,
        maxnreg=cfg["maxnreg"],
    )  # fmt: skip
    merge_split_partials(part_acc, part_ml, out, meta.query_start_loc, meta.num_seqs)
    return out


def main() -> None:
    from bench_mla_decode import SOFTMAX_SCALE, bench, bytes_read, copy_bandwidth, make_case
    from exp_regs_mla_decode import VARIANTS

    from kvforge.kernels.gluon_mla_decode import mla_decode_wgmma
    from kvforge.kernels.triton_mla_decode import mla_decode

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="16x1x65536,16x8x65536,16x32x65536,16x128x65536,8x32x65536,8x128x65536,"
                                        "16x32x4096,16x3x1000")
    ap.add_argument("--cfgs", default="", help="extra ws configs, e.g. 'stages=4;stages=3,consumer_regs=240'")
    ap.add_argument("--profile", default=None, help="HEADSxBATCHxCTX: only run the ws kernel 3 times (for ncu)")
    a = ap.parse_args()
    if a.profile:
        heads, batch, ctx = (int(v) for v in a.profile.split("x"))
        cache, meta, ql, qr = make_case(batch, ctx, heads, torch.float8_e4m3fn)
        cfg = {k: int(v) for k, v in (kv.split("=") for kv in a.cfgs.split(",") if kv)}
        for _ in range(3):
            mla_decode_ws(ql, qr, cache, meta, torch.tensor([0.75], device="cuda"), SOFTMAX_SCALE, cfg=cfg)
        torch.cuda.synchronize()
        return
    cbw = copy_bandwidth()
    print(f"copy bandwidth {cbw / 1e12:.2f} TB/s", flush=True)
    scale = torch.tensor([0.75], device="cuda")
    variants = {"ws": functools.partial(mla_decode_ws)}
    for spec in filter(None, a.cfgs.split(";")):
        cfg = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
        variants["ws_" + spec.replace(",", "_").replace("=", "")] = functools.partial(mla_decode_ws, cfg=cfg)
    variants["regs_ring2"] = VARIANTS["regs_ring2"]
    rows = []
    for shape in a.shapes.split(","):
        heads, batch, ctx = (int(v) for v in shape.split("x"))
        row = dict(heads=heads, batch=batch, ctx=ctx)
        for name, dt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
            if name == "e5m2" and ctx > 4096:
                continue
            cache, meta, ql, qr = make_case(batch, ctx, heads, dt)
            want = mla_decode(ql, qr, cache, meta, scale, SOFTMAX_SCALE, _config={"wgmma": False}).float()
            ok = {}
            for label, fn in variants.items():
                try:
                    got = fn(ql, qr, cache, meta, scale, SOFTMAX_SCALE).float()
                except ValueError:  # outside that variant's scope (regs_ring2: at most 16 heads)
                    continue
                rel = ((got - want).abs().max() / want.abs().max()).item()
                ok[label] = bool(torch.isfinite(got).all()) and rel <= 2.0 ** -6
                row[f"{name}_{label}_max_rel"] = rel
            nbytes = bytes_read(batch, ctx, heads, 1)
            if name == "e4m3":
                timed = {k: v for k, v in variants.items() if ok.get(k)}
                for label, fn in dict(timed, wgmma=mla_decode_wgmma).items():
                    med, lo, hi = bench(functools.partial(fn, ql, qr, cache, meta, scale, SOFTMAX_SCALE))
                    row[label] = dict(us=med, min=lo, max=hi, pct_copy=100 * nbytes / (med * 1e-6) / cbw)
            del cache
        rows.append(row)
        cells = [f"{k} {v:.1e}" for k, v in row.items() if k.endswith("max_rel")]
        cells += [f"{k} {v['us']:.1f} us ({v['pct_copy']:.0f}%)" for k, v in row.items() if isinstance(v, dict)]
        print(f"H{heads} {batch}x{ctx}: " + " | ".join(cells), flush=True)
    if a.out:
        with open(os.path.join(a.out, "exp_ws_mla_decode.json"), "w") as f:
            json.dump(dict(copy_tbps=cbw / 1e12, gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

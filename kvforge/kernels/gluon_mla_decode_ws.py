"""Warp-specialized fp8 MLA decode for up to 16 heads per rank: a producer warpgroup and two consumer
warpgroups per SM.

The fp8 path of :mod:`kvforge.kernels.gluon_mla_decode` stages every tile into an fp16 copy that both
products read, about 212 KB of shared-memory traffic per 64-token tile, and its warps issue their own copies
and address arithmetic between the products. Here (one CTA per SM, ``gl.warp_specialize``):

- a producer warpgroup walks the block table and issues the cp.async copies of every tile of the split into
  a ``NUM_STAGES``-deep ring of raw fp8 tiles; each thread's ``cp.async.mbarrier.arrive.noinc`` marks a stage
  ready when its copies land (``ready`` barriers, one arrive per producer thread);
- two consumer warpgroups take alternate tiles (even and odd), each with its own online softmax (lazy
  rescaling, ``RESCALE_LOG2``) and accumulators. They read the ``wgmma`` A operands straight from the ring
  into registers: 16-byte shared loads, converted to fp16 in registers (each tile passes shared memory once
  written and twice read, as fp8);
- each consumer releases a stage (``empty`` barrier, one arrive) at the top of its next iteration, after a
  partition barrier proves all four of its warps finished the previous products, and writes its own split
  partial (``2 s + parity``), which the paged merge kernel combines with the others.

The register-operand relabelings: the score product's contraction order is free, so logical column ``k``
of a 64-column chunk is read from physical column :func:`chunk_column` ``(k)`` (the query is stored permuted
the same way), which makes a thread's operand 16 contiguous bytes; the ``P x V`` accumulator rows are free,
so accumulator row ``m`` holds latent column :func:`latent_column` ``(m)``. The partials are stored in accumulator-row
order (a warp's store then covers 32 contiguous bytes of each head's row) and the merge writes row ``m`` to its
latent column (:func:`accumulator_columns`).
``tests/test_mla_register_operand_maps.py`` checks both maps on CPU.

At 16 heads per program the ``P x V`` operand is loaded in two 256-column halves (8-byte loads,
:func:`latent_column_halves`): whole, its 64 fp8 registers beside the 64 of the accumulators made the
consumer spill.

With ``fp8_query`` (the plan's e4m3 query) the score product is an fp8 x fp8 ``wgmma`` instead: the query is
rounded to e4m3 per (token, head) (:func:`_fp8_query`, scale amax/448 over ``[q_latent | q_rope]``), the
ring is stored in the 128-byte swizzled layout ``wgmma`` reads, and ``Q C^T`` is five ``wgmma`` straight from
shared memory (four 128-column latent chunks and the rope chunk); ``P x V`` is unchanged. That removes the
score product's conversions and register operands.

A bf16 model-dtype query over an e4m3 cache at 16 heads per program (``routing.mla.ws_two_term_query``)
takes the same fp8 score product as two e4m3 terms: ``q = s (hi + lo / 16)`` per head, ``s`` a power of two,
which holds a bf16 query exactly (:func:`_fp8_query`); the ``wgmma`` N doubles (rows ``h`` and ``NH + h``)
and the two column halves of the product are scaled and added. Its output error stays near the fp16
product's (1.8-2.3e-3 against 1.7e-3 relative L2, 3.5e-3 against 1.6e-3 with peaked scores; the fp8
product's accumulation is coarser than float32), where one e4m3 term is 15x off. ``hi`` is rounded in integer arithmetic (:func:`_e4m3_value`).

The two consumers' pipelines need several tiles each to fill, so the routing table
(:mod:`kvforge.attention.routing.mla`) sends a call here only where every CTA gets at least
``WS_MIN_TOKENS_PER_CTA`` tokens; shorter calls stay on the wgmma kernel.

Invariants: the ring stage of tile i is ``i % NUM_STAGES``, its fill number ``i // NUM_STAGES`` (the barrier
phase parity). A consumer releases tile ``i - 2``'s stage before it waits for tile i, so any ``NUM_STAGES >= 2``
is deadlock-free. Rows at or past the split end are zero-filled by the copies and masked to ``-inf``.
Block-id and row offsets are int64. Scope: the ``gluon_mla_ws`` row of :mod:`kvforge.attention.routing.mla`.
"""

from __future__ import annotations

import torch

from kvforge.attention.fp8 import storage_dtype_name
from kvforge.attention.routing import mla as mla_routing
from kvforge.kernels.gluon_support import HAS_GLUON, async_copy, gl, gluon
from kvforge.kernels.triton_paged_attention import LOG2E, merge_split_partials

if HAS_GLUON:
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

R: int = mla_routing.LATENT_DIM
P: int = mla_routing.ROPE_DIM
#: Ring depth: 5 x 36 KB of fp8 tiles (196 KB of shared memory at 8 heads, one CTA per SM).
NUM_STAGES: int = 5
#: Registers per thread: maxnreg 168 over three warpgroups is a pool of 64,512; the producer's warpgroup
#: shrinks to 40, the odd consumer grows to 232 and the even one (the kernel's own warps) gets the rest, 232.
MAXNREG: int = 168
CONSUMER_REGS: int = 232
PRODUCER_REGS: int = 40
#: Warps of the producer partition (a whole warpgroup: registers are allotted per warpgroup anyway).
PRODUCER_WARPS: int = 4
if HAS_GLUON:  # what the kernels read (a jit function sees only constexpr globals)
    _R = gl.constexpr(R)
    _P = gl.constexpr(P)
    _RESCALE_LOG2 = gl.constexpr(8.0)  # gluon_mla_decode.RESCALE_LOG2
    _PRODUCER_WARPS = gl.constexpr(PRODUCER_WARPS)  # the producer partition's warps = the ready barriers' count / 32
    #: Register layouts of the operands read from the fp8 tiles (4 warps). A score chunk [64 tokens, 64 columns]: 16 contiguous
    #: bytes (registers), then token + 8; lanes: the column sixteens, tokens 0-7; warps: token sixteens (the
    #: wgmma A layout after the chunk_column relabel).
    SCORE_CHUNK_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]], lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64]))  # fmt: skip
    #: The P x V operand [64 tokens, 512 columns]: 16 contiguous bytes, tokens +1 +8 +16 +32 (registers); lanes:
    #: tokens +2 +4, columns +16 +32 +64; warps: columns +128 +256 (latent_column).
    PV_OPERAND_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0], [16, 0], [32, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]], warp_bases=[[0, 128], [0, 256]], block_bases=[],
        shape=[64, 512]))  # fmt: skip
    #: One 256-column half of it (latent_column_halves): 8 contiguous bytes, then tokens +1 +8 +16 +32; lanes:
    #: tokens +2 +4, columns +8 +16 +32; warps: columns +64 +128.
    PV_HALF_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [8, 0], [16, 0], [32, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 8], [0, 16], [0, 32]], warp_bases=[[0, 64], [0, 128]], block_bases=[],
        shape=[64, 256]))  # fmt: skip


def two_term_capable(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the two-term e4m3 score product (:func:`_fp8_query`) can hold this query exactly (to 2^-21 of
    the head's largest magnitude): ``routing.mla.two_term_query_exact`` for these dtypes."""
    return mla_routing.two_term_query_exact(storage_dtype_name(query_dtype), storage_dtype_name(cache_dtype))


def chunk_column(k: int) -> int:
    """Physical column (within a 64-column chunk) that logical score column ``k`` reads: bits
    (k0, k1, k2, k3, k4, k5) -> (c0, c4, c5, c1, c2, c3). A thread of the ``wgmma`` A layout holds logical
    columns {2t, 2t+1, 2t+8, 2t+9} of every 16-column k-step, t = lane % 4; under this map they are
    physical columns 16t .. 16t+15."""
    return (k & 1) | ((k >> 1) & 1) << 4 | ((k >> 2) & 1) << 5 | ((k >> 3) & 1) << 1 | ((k >> 4) & 1) << 2 | ((k >> 5) & 1) << 3


def latent_column(m: int) -> int:
    """Physical latent column that accumulator row ``m`` (0..511, ``P x V``) holds: bits (m0..m8) ->
    (c4, c5, c6, c0, c7, c8, c1, c2, c3). Each thread's 16 rows of the four 128-row accumulators are then
    16 contiguous bytes of a cached row."""
    b = [(m >> i) & 1 for i in range(9)]
    return b[3] | b[6] << 1 | b[7] << 2 | b[8] << 3 | b[0] << 4 | b[1] << 5 | b[2] << 6 | b[4] << 7 | b[5] << 8


def latent_column_halves(m: int) -> int:
    """The map at more than 8 heads per program, where the ``P x V`` operand is loaded in two halves of 256
    columns: bits (m0..m8) -> (c3, c4, c5, c0, c6, c7, c1, c2, c8). Accumulators 2h and 2h+1 hold the columns
    of half h (c8 = m8); a thread's 8 rows of the pair are 8 contiguous bytes."""
    b = [(m >> i) & 1 for i in range(9)]
    return b[3] | b[6] << 1 | b[7] << 2 | b[0] << 3 | b[1] << 4 | b[2] << 5 | b[4] << 6 | b[5] << 7 | b[8] << 8


if HAS_GLUON:

    @gluon.jit
    def _chunk_column_of(k):
        return (k & 1) | ((k >> 1) & 1) << 4 | ((k >> 2) & 1) << 5 | ((k >> 3) & 1) << 1 | ((k >> 4) & 1) << 2 \
            | ((k >> 5) & 1) << 3

    @gluon.jit
    def _score_operand(x, DOT_A: gl.constexpr):
        """fp8 chunk ``x [64 tokens, 64 physical columns]`` (layout LX) -> the fp16 A operand in logical column
        order (:func:`chunk_column`); no data moves."""
        y = gl.reshape(x.to(gl.float16), [64, 2, 2, 2, 2, 2, 2])  # (token, c5, c4, c3, c2, c1, c0)
        y = gl.permute(y, (0, 3, 4, 5, 1, 2, 6))  # (token, k5=c3, k4=c2, k3=c1, k2=c5, k1=c4, k0=c0)
        return gl.convert_layout(gl.reshape(y, [64, 64]), DOT_A, assert_trivial=True)

    @gluon.jit
    def _pv_operand(y3, DOT_A: gl.constexpr):
        """fp8 ``y3 [64 tokens, 32 (c4..c8), 4 (c0 c1)]`` (one of the four column quarters c2 c3) -> the fp16 A
        operand ``[128 rows m, 64 tokens]`` of :func:`latent_column`; no data moves. The same relabeling serves
        :func:`latent_column_halves`, whose 32-index is (c3..c7) of one 256-column half."""
        z = gl.permute(gl.reshape(y3.to(gl.float16), [64, 128]), (1, 0))  # [col' = 4 * hi + lo, token]
        z = gl.reshape(z, [2, 2, 2, 2, 2, 2, 2, 64])  # (c8, c7, c6, c5, c4, c1, c0, token)
        z = gl.permute(z, (5, 0, 1, 6, 2, 3, 4, 7))  # (m6=c1, m5=c8, m4=c7, m3=c0, m2=c6, m1=c5, m0=c4)
        return gl.convert_layout(gl.reshape(z, [128, 64]), DOT_A, assert_trivial=True)

    @gluon.jit
    def _permuted_query(ql_ptr, qr_ptr, t64, hb, stride_qlt, stride_qlh, stride_qrt, stride_qrh, NH: gl.constexpr,
                        NUM_HEADS: gl.constexpr, Q_L: gl.constexpr, Q_SMEM: gl.constexpr):  # fmt: skip
        """The query block of token ``t64`` and heads ``hb * NH ..`` in shared memory as the score product's B
        operand: fp16 ``[NH, R]`` and ``[NH, P]``, columns permuted chunk by chunk (:func:`chunk_column`), zero
        rows for padded heads."""
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
        return ql_smem, qr_smem

    @gluon.jit
    def _e4m3_value(x):
        """``x`` (float32, ``|x| <= 448``) rounded to the nearest e4m3 value (ties to even), as float32, in
        integer arithmetic: 3 mantissa bits where ``|x| >= 2^-6``, multiples of 2^-9 below. (Converting to
        fp8 and back in registers is not used: Triton 3.6 miscompiled that round trip for half the elements.)"""
        b = x.to(gl.int32, bitcast=True)
        normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000).to(gl.float32, bitcast=True)
        subnormal = (x + 24576.0) - 24576.0  # 24576 = 1.5 * 2^14: the sum's last bit is worth 2^-9
        return gl.where(gl.abs(x) >= 0.015625, normal, subnormal)

    @gluon.jit
    def _fp8_query(ql_ptr, qr_ptr, t64, hb, stride_qlt, stride_qlh, stride_qrt, stride_qrh, NH: gl.constexpr,
                   NUM_HEADS: gl.constexpr, Q_L: gl.constexpr, TWO_TERMS: gl.constexpr):  # fmt: skip
        """The query block as e4m3 in natural column order (the fp8 score product's B operand, read from shared
        memory) and the dequant scale of each of its rows (zero rows for padded heads).

        One term (``TWO_TERMS`` false, the plan's e4m3 query): ``[NH, R]`` and ``[NH, P]``, each head scaled so
        that its largest magnitude is 448 (scale amax/448). Two terms (a bf16 model-dtype query): ``[2 NH, R]``
        and ``[2 NH, P]``, rows ``h`` and ``NH + h`` the two terms of head h, ``q = s (hi + lo / 16)`` with ``s``
        the power of two that puts the head's amax in (224, 448], ``hi = e4m3(q / s)`` (:func:`_e4m3_value`)
        and ``lo = e4m3(16 (q / s - hi))``. ``q / s`` is exact; where ``|q / s| >= 2^-6`` its 8 significant bits
        are ``hi``'s top 4 plus a remainder that ``lo`` holds exactly; below, the error is under 2^-14 in units
        of ``q / s``, i.e. under 2^-21 of the head's amax. Each head's row is loaded once per term and the terms
        are computed row by row."""
        ROWS: gl.constexpr = 2 * NH if TWO_TERMS else NH
        row = gl.arange(0, ROWS, layout=gl.SliceLayout(1, Q_L))
        hq = hb * NH + row % NH
        kq = gl.arange(0, _R, layout=gl.SliceLayout(0, Q_L))
        ql = gl.load(ql_ptr + t64 * stride_qlt + (hq.to(gl.int64) * stride_qlh)[:, None] + kq[None, :],
                     mask=(hq < NUM_HEADS)[:, None] & (kq >= 0)[None, :], other=0.0)  # fmt: skip
        kr = gl.arange(0, _P, layout=gl.SliceLayout(0, Q_L))
        qr = gl.load(qr_ptr + t64 * stride_qrt + (hq.to(gl.int64) * stride_qrh)[:, None] + kr[None, :],
                     mask=(hq < NUM_HEADS)[:, None] & (kr >= 0)[None, :], other=0.0)  # fmt: skip
        # the query stays in its own dtype until it is scaled (fewer live registers)
        amax = gl.maximum(gl.max(gl.abs(ql.to(gl.float32)), 1), gl.max(gl.abs(qr.to(gl.float32)), 1))
        L8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        R8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        if TWO_TERMS:
            # the power of two at or above amax / 448 (exponent bits rounded up), doubled where the division
            # rounded below it; division is approximate on the GPU, multiplying by a power of two is exact
            bits = ((amax / 448.0).to(gl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
            bits = gl.where(amax > 448.0 * bits.to(gl.float32, bitcast=True), bits + 0x800000, bits)
            bits = gl.where(amax > 0, bits, 0x3F800000)  # scale 1 for zero rows
            inv_scale = (0x7F000000 - bits).to(gl.float32, bitcast=True)
            is_lo = (row >= NH)[:, None]
            xl = ql.to(gl.float32) * inv_scale[:, None]
            xr = qr.to(gl.float32) * inv_scale[:, None]
            hl = _e4m3_value(xl)
            hr = _e4m3_value(xr)
            tl_ = gl.where(is_lo, (xl - hl) * 16.0, hl).to(gl.float8e4nv)
            tr_ = gl.where(is_lo, (xr - hr) * 16.0, hr).to(gl.float8e4nv)
            row_scale = bits.to(gl.float32, bitcast=True) * gl.where(row >= NH, 0.0625, 1.0)
        else:
            row_scale = gl.where(amax > 0, amax / 448.0, 1.0)
            tl_ = (ql.to(gl.float32) / row_scale[:, None]).to(gl.float8e4nv)
            tr_ = (qr.to(gl.float32) / row_scale[:, None]).to(gl.float8e4nv)
        ql8 = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, _R], L8, tl_)
        qr8 = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, _P], R8, tr_)
        return ql8, qr8, row_scale

    @gluon.jit
    def _produce(ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                 stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts,
                 NH: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr, LAZY: gl.constexpr):  # fmt: skip
        """The producer warpgroup: every tile's rows into the ring, one stage per tile, as stages free up. The
        latent part goes in four 16-row slices, so a thread holds the offsets of 4 rows at a time (the partition
        runs on ``PRODUCER_REGS`` registers; all 64 at once spilled)."""
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
    def _score_from_registers(lat, rope, ql_smem, qr_smem, s_zero, DOT_A: gl.constexpr, LX: gl.constexpr):
        """``Q C^T`` of one tile with the fp16 query: the eight latent chunks and the rope chunk, each read from
        the ring just before its conversion (all nine at once would hold 72 registers of fp8 beside the
        accumulators); one chunk's ``wgmma`` runs while the next converts."""
        a = _score_operand(lat.slice(0, 64, dim=1).load(LX), DOT_A)
        s = warpgroup_mma(a, ql_smem.slice(0, 64, dim=1).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        for k in gl.static_range(1, 8):
            a_next = _score_operand(lat.slice(64 * k, 64, dim=1).load(LX), DOT_A)
            s = warpgroup_mma(a_next, ql_smem.slice(64 * k, 64, dim=1).permute((1, 0)), s, is_async=True)
            s, a = warpgroup_mma_wait(1, deps=(s, a))
            a = a_next
        a_next = _score_operand(rope.load(LX), DOT_A)
        s = warpgroup_mma(a_next, qr_smem.permute((1, 0)), s, is_async=True)
        s, a = warpgroup_mma_wait(1, deps=(s, a))
        s, a_next = warpgroup_mma_wait(0, deps=(s, a_next))
        return s

    @gluon.jit
    def _consume(ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                 stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts,
                 NH: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr,
                 LAZY: gl.constexpr, PARITY: gl.constexpr, FP8_SCORE: gl.constexpr, TWO_TERMS: gl.constexpr,
                 q_scale_smem):  # fmt: skip
        """One consumer warpgroup: tiles PARITY, PARITY + 2, ... of the split; writes partial 2 s + PARITY.
        ``FP8_SCORE``: ``ql_smem``/``qr_smem`` hold the query in e4m3 (:func:`_fp8_query`, one term or
        ``TWO_TERMS``) and the score product is an fp8 ``wgmma`` on the ring tile in shared memory;
        ``q_scale_smem`` the scales of the query's rows. With two terms the product is ``[64, 2 NH]``; its
        column halves are scaled and added (a split along a register dimension: no data moves)."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 16])
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        LX: gl.constexpr = SCORE_CHUNK_LAYOUT
        LY: gl.constexpr = PV_OPERAND_LAYOUT
        LYH: gl.constexpr = PV_HALF_LAYOUT
        p_buf = p_smem.index(PARITY)
        if FP8_SCORE:
            QN: gl.constexpr = 2 * NH if TWO_TERMS else NH
            MMA8: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, QN, 32])  # fmt: skip
            q_scale = q_scale_smem.load(gl.SliceLayout(0, MMA8))
            s8_zero = gl.zeros([64, QN], gl.float32, layout=MMA8)
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
            if FP8_SCORE:
                s = warpgroup_mma(lat.slice(0, 128, dim=1), ql_smem.slice(0, 128, dim=1).permute((1, 0)), s8_zero,
                                  use_acc=False, is_async=True)  # fmt: skip
                s = warpgroup_mma(lat.slice(128, 128, dim=1), ql_smem.slice(128, 128, dim=1).permute((1, 0)), s,
                                  is_async=True)  # fmt: skip
                s = warpgroup_mma(lat.slice(256, 128, dim=1), ql_smem.slice(256, 128, dim=1).permute((1, 0)), s,
                                  is_async=True)  # fmt: skip
                s = warpgroup_mma(lat.slice(384, 128, dim=1), ql_smem.slice(384, 128, dim=1).permute((1, 0)), s,
                                  is_async=True)  # fmt: skip
                s = warpgroup_mma(rope_ring.index(stage), qr_smem.permute((1, 0)), s, is_async=True)
                s = warpgroup_mma_wait(0, deps=[s])
                s = s * q_scale[None, :]
                if TWO_TERMS:
                    s_hi, s_lo = gl.split(gl.permute(gl.reshape(s, [64, 2, NH]), (0, 2, 1)))
                    s = s_hi + s_lo
                s = gl.convert_layout(s, MMA, assert_trivial=True)
            else:
                s = _score_from_registers(lat, rope_ring.index(stage), ql_smem, qr_smem, s_zero, DOT_A, LX)

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
            if NH <= 8:
                y = lat.load(LY)  # the whole P x V operand: 64 fp8 registers
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
            else:
                # more than 8 heads: the operand in two 256-column halves (latent_column_halves), so 32 fp8
                # registers are live beside the 64 of the accumulators instead of 64; 8-byte loads
                yh = gl.permute(gl.reshape(lat.slice(0, 256, dim=1).load(LYH), [64, 32, 2, 4]), (0, 1, 3, 2))
                y0, y1 = gl.split(yh)
                b0 = _pv_operand(y0, DOT_A)
                acc0 = warpgroup_mma(b0, p_buf, acc0, is_async=True)
                b1 = _pv_operand(y1, DOT_A)
                acc1 = warpgroup_mma(b1, p_buf, acc1, is_async=True)
                acc0, b0 = warpgroup_mma_wait(1, deps=(acc0, b0))
                yh = gl.permute(gl.reshape(lat.slice(256, 256, dim=1).load(LYH), [64, 32, 2, 4]), (0, 1, 3, 2))
                y2, y3 = gl.split(yh)
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
            # in accumulator-row order: a warp's store covers 8 consecutive rows (32 bytes) of each of its heads,
            # where latent columns 16 apart took a 32-byte sector per value; the merge puts row m at column
            # latent_column(m) (accumulator_columns)
            base = part_acc_ptr + (pidx * _R)[None, :]
            gl.store(base + mrow[:, None], acc0 * scale, mask=mask)
            gl.store(base + (mrow + 128)[:, None], acc1 * scale, mask=mask)
            gl.store(base + (mrow + 256)[:, None], acc2 * scale, mask=mask)
            gl.store(base + (mrow + 384)[:, None], acc3 * scale, mask=mask)
        gl.store(part_ml_ptr + pidx * 2, m_i, mask=h_ok)
        gl.store(part_ml_ptr + pidx * 2 + 1, l_i, mask=h_ok)

    @gluon.jit
    def _consume_odd(ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi,
                     num_tiles, stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts,
                     NH: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                     NUM_STAGES: gl.constexpr, LAZY: gl.constexpr, FP8_SCORE: gl.constexpr, TWO_TERMS: gl.constexpr,
                     q_scale_smem):  # fmt: skip
        _consume(ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                 stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts, NH, NUM_HEADS,
                 BLOCK_SIZE, NUM_STAGES, LAZY, 1, FP8_SCORE, TWO_TERMS, q_scale_smem)  # fmt: skip

    @gluon.jit
    def _consume_even(ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi,
                     num_tiles, stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts,
                     NH: gl.constexpr, NUM_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                     NUM_STAGES: gl.constexpr, LAZY: gl.constexpr, FP8_SCORE: gl.constexpr, TWO_TERMS: gl.constexpr,
                     q_scale_smem):  # fmt: skip
        _consume(ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                 stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts, NH, NUM_HEADS,
                 BLOCK_SIZE, NUM_STAGES, LAZY, 0, FP8_SCORE, TWO_TERMS, q_scale_smem)  # fmt: skip

    @gluon.jit(do_not_specialize=["num_splits", "stride_bt"])
    def _ws_mla_decode_kernel(
        ql_ptr, qr_ptr, cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, scale_ptr,
        sm_scale_log2, num_splits,
        stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
        NUM_HEADS: gl.constexpr, NH: gl.constexpr, BLOCK_SIZE: gl.constexpr, NUM_STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, LAZY: gl.constexpr, FP8_SCORE: gl.constexpr,
        TWO_TERMS: gl.constexpr,
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
        if FP8_SCORE:
            ql_smem, qr_smem, q_scale = _fp8_query(ql_ptr, qr_ptr, t64, hb, stride_qlt, stride_qlh, stride_qrt,
                                                   stride_qrh, NH, NUM_HEADS, Q_L, TWO_TERMS)  # fmt: skip
            q_scale_smem = gl.allocate_shared_memory(gl.float32, [2 * NH if TWO_TERMS else NH],
                                                     gl.SwizzledSharedLayout(1, 1, 1, order=[0]), q_scale)  # fmt: skip
            LAT_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
            ROPE_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        else:
            ql_smem, qr_smem = _permuted_query(ql_ptr, qr_ptr, t64, hb, stride_qlt, stride_qlh, stride_qrt,
                                               stride_qrh, NH, NUM_HEADS, Q_L, Q_SMEM)  # fmt: skip
            q_scale_smem = ql_smem  # unused
            LAT_L: gl.constexpr = RAW
            ROPE_L: gl.constexpr = RAW
        p_smem = gl.allocate_shared_memory(gl.float16, [2, 64, NH], P_SMEM)
        lat_ring = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [NUM_STAGES, 64, _R], LAT_L)
        rope_ring = gl.allocate_shared_memory(cache_ptr.dtype.element_ty, [NUM_STAGES, 64, _P], ROPE_L)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for k in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(k), count=32 * _PRODUCER_WARPS)  # one noinc arrive per producer thread
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
        gl.warp_specialize([
            (_consume_even, (ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                                stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts, NH,
                                NUM_HEADS, BLOCK_SIZE, NUM_STAGES, LAZY, FP8_SCORE, TWO_TERMS, q_scale_smem)),
            (_consume_odd, (ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                                stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts, NH,
                                NUM_HEADS, BLOCK_SIZE, NUM_STAGES, LAZY, FP8_SCORE, TWO_TERMS, q_scale_smem)),
            (_produce, (ql_smem, qr_smem, lat_ring, rope_ring, p_smem, ready, empty, cache_ptr, bt_row, lo, hi, num_tiles,
                                stride_cb, stride_cs, qk_scale, scale, part_acc_ptr, part_ml_ptr, pidx0, num_parts, NH,
                                NUM_HEADS, BLOCK_SIZE, NUM_STAGES, LAZY)),
        ], [4, _PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


def mla_decode_ws(q_latent, q_rope, cache, meta, scale, softmax_scale, *, num_splits, out, cfg=None,
                  fp8_query=False):  # fmt: skip
    """``out [T, H, R]`` = MLA decode in latent space over an fp8 cache (what ``gluon_mla_decode.mla_decode_wgmma``
    computes); tokens past ``query_start_loc[num_seqs]`` are left untouched. ``num_splits``: CTAs per
    sequence (the routing table's ``ws_splits``). ``fp8_query``: the score product as an fp8 ``wgmma``
    from shared memory, the query rounded to e4m3 per (token, head) (:func:`_fp8_query`). ``cfg``
    (benchmarks): ``stages``, ``lazy``, ``nh`` (heads per program), ``consumer_regs`` and ``producer_regs``
    (the odd consumer's and the producer's registers; the even consumer gets the rest of the pool)."""
    cfg = dict(cfg or {})
    t, h, r = q_latent.shape
    nh = int(cfg.get("nh", mla_routing.ws_heads_per_program(h)))
    splits = max(1, min(int(num_splits), mla_routing.WS.splits.max_splits))
    head_blocks = -(-h // nh)
    by_rule = mla_routing.ws_two_term_query(storage_dtype_name(q_latent.dtype), storage_dtype_name(cache.dtype), nh)
    two_terms = not fp8_query and two_term_capable(q_latent.dtype, cache.dtype) and bool(cfg.get("two_terms", by_rule))
    parts = 2 * splits
    part_acc = torch.empty((t, h, parts, r), dtype=torch.float32, device=q_latent.device)
    part_ml = torch.empty((t, h, parts, 2), dtype=torch.float32, device=q_latent.device)
    _ws_mla_decode_kernel[(head_blocks, meta.num_seqs, splits)](
        q_latent, q_rope, cache, out, part_acc, part_ml, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale.to(torch.float32).reshape(-1)[:1], float(softmax_scale) * LOG2E, splits,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), meta.block_tables.stride(0),
        NUM_HEADS=h, NH=nh, BLOCK_SIZE=cache.shape[1], NUM_STAGES=int(cfg.get("stages", NUM_STAGES)),
        CONSUMER_REGS=int(cfg.get("consumer_regs", CONSUMER_REGS)),
        PRODUCER_REGS=int(cfg.get("producer_regs", PRODUCER_REGS)), LAZY=bool(cfg.get("lazy", True)),
        FP8_SCORE=bool(fp8_query) or two_terms, TWO_TERMS=two_terms,
        num_warps=4,
        maxnreg=MAXNREG,
    )  # fmt: skip
    merge_split_partials(part_acc, part_ml, out, meta.query_start_loc, meta.num_seqs,
                         out_columns=accumulator_columns(nh, q_latent.device))
    return out


_ACCUMULATOR_COLUMNS: dict = {}


def accumulator_columns(heads_per_program: int, device) -> torch.Tensor:
    """int32 ``[R]``: the latent column each partial column holds, the partials being stored in accumulator-row
    order (:func:`latent_column` at up to 8 heads per program, :func:`latent_column_halves` above); one cached
    tensor per (map, device), so a CUDA graph may keep its address."""
    column_of = latent_column if heads_per_program <= 8 else latent_column_halves
    key = (column_of.__name__, str(device))
    if key not in _ACCUMULATOR_COLUMNS:
        _ACCUMULATOR_COLUMNS[key] = torch.tensor([column_of(m) for m in range(R)], dtype=torch.int32, device=device)
    return _ACCUMULATOR_COLUMNS[key]

"""Experiment: MLA decode over the paged latent cache, written in Gluon, for up to 16 heads per rank.

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_mla_decode.py --gluon-sweep --heads 8,16

(``bench_mla_decode.py`` imports :func:`mla_decode_gluon` from here, checks it against the tl.dot
kernel and times both side by side.) Status: not adopted, kept out of the ``kvforge`` package; the
planner and the engine never route here. On the H200 it measured 0.5-1.2x the tl.dot kernel. It is 2x slower at batch 1 x 4k,
where one program's per-tile latency (~6000 cycles, 8 warps per SM) is exposed, and 1.05-1.2x faster
for an fp8 cache at batch >= 8 x 64k. It does not reach the issue's 80% of copy bandwidth either:
bf16 51-64%, fp8 23-31% (docs/MLA.md, "Gluon column-split decode").

Same math and partial layout as :mod:`kvforge.kernels.triton_mla_decode` (model-dtype query,
regime (a)). At 8-16 heads per rank MLA decode is memory-bound, and the tl.dot kernel reached
52-58% of the copy bandwidth with a bf16 cache and 24-27% with fp8. Its warps split the tile's
tokens for ``Q C^T`` and the latent columns for ``P C``, so the row max, the row sum and P crossed
warps through shared memory in every tile, and an fp8 ``P C`` read its operand byte by byte.

This kernel splits the *latent columns* across the ``NUM_WARPS`` warps for both products. Warp
``w`` owns latent columns ``[w*R/NW, (w+1)*R/NW)`` and rope columns ``[w*P/NW, ...)`` of every
cached row; the async copies put exactly those bytes in its shared slice. Per tile:

1. each warp computes a partial score ``q[:, cols_w] . row[cols_w]`` for all 16 head rows (a
   batched rank-3 ``mma_v2``);
2. one cross-warp sum (``gl.sum`` over the warp axis) gives every warp the full scores, and each
   warp runs the same online softmax on them;
3. each warp multiplies P by its own latent columns into its own ``[16, R/NW]`` accumulator.

The only per-tile cross-warp traffic is step 2, a ``[16, TILE_N]`` float32 exchange. Output column
``c`` comes from warp ``c // (R/NW)``.

Scope (``supports`` is the gate; the tl.dot kernel keeps everything else): decode, at most 16
heads, ``R`` = 512 and ``P`` = 64 (DeepSeek-V2/V3 and Kimi-K2), a model-dtype bf16/fp16 query over
a cache of the same dtype or fp8 e4m3/e5m2, sm_90 with Triton 3.6 (``gluon_support``). fp8 rows are
upcast to fp16 in registers; the per-tensor scale joins the softmax scale. Zero-filled copies past the context end keep fp8 NaN
patterns out of ``P C``; block-id and row offsets are int64.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvforge.kernels.gluon_support import HAS_GLUON, async_copy, gl, gluon, gluon_runs_on, mma_v2  # noqa: E402
from kvforge.kernels.triton_paged_attention import _LOG2E, _num_sms, merge_split_partials  # noqa: E402

LATENT_DIM: int = 512
ROPE_DIM: int = 64
MAX_HEADS: int = 16
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def supports(q_latent: torch.Tensor, cache: torch.Tensor, query_dtype: str | None) -> bool:
    """True when this kernel handles the decode call (otherwise the tl.dot kernel does)."""
    t, h, r = q_latent.shape
    return (
        gluon_runs_on(q_latent)
        and query_dtype is None
        and h <= MAX_HEADS
        and r == LATENT_DIM
        and cache.shape[-1] == LATENT_DIM + ROPE_DIM
        and q_latent.dtype in (torch.bfloat16, torch.float16)
        and (cache.dtype in _FP8 or cache.dtype == q_latent.dtype)
    )


def default_tiling(is_fp8: bool) -> dict:
    """Tokens per tile and pipeline depth (H200 sweep, docs/MLA.md)."""
    return dict(tile_n=32, num_stages=2, num_warps=4)


if HAS_GLUON:

    @gluon.jit
    def _copy_columns(
        buf, cache_ptr, bt_row, start, hi, stride_cb, stride_cs, col0,
        BLOCK_SIZE: gl.constexpr, NW: gl.constexpr, TILE_N: gl.constexpr, W: gl.constexpr, L: gl.constexpr,
    ):  # fmt: skip
        """Async copy of columns ``col0 + w*W .. col0 + (w+1)*W`` of rows ``start ..`` into ``buf[w]``."""
        w = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        n = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
        c = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
        pos = start + n
        ok = pos < hi
        blk = gl.load(bt_row + pos // BLOCK_SIZE, mask=ok, other=0).to(gl.int64)
        row = blk * stride_cb + (pos % BLOCK_SIZE).to(gl.int64) * stride_cs
        off = row[None, :, None] + (col0 + w * W)[:, None, None] + c[None, None, :]
        mask = (w >= 0)[:, None, None] & ok[None, :, None] & (c >= 0)[None, None, :]
        async_copy.async_copy_global_to_shared(buf, cache_ptr + off, mask=mask)

    @gluon.jit
    def _issue_latent_tile(
        lat_buf, rope_buf, cache_ptr, bt_row, start, hi, stride_cb, stride_cs,
        BLOCK_SIZE: gl.constexpr, NW: gl.constexpr, TILE_N: gl.constexpr, RW: gl.constexpr, PW: gl.constexpr,
        R: gl.constexpr, LAT_COPY: gl.constexpr, ROPE_COPY: gl.constexpr,
    ):  # fmt: skip
        """One commit group: the latent slices ``[NW, TILE_N, RW]`` and rope slices ``[NW, TILE_N, PW]``
        of rows ``start .. start+TILE_N-1`` (zero-filled at or past ``hi``)."""
        _copy_columns(lat_buf, cache_ptr, bt_row, start, hi, stride_cb, stride_cs, 0, BLOCK_SIZE, NW, TILE_N, RW,
                      LAT_COPY)  # fmt: skip
        _copy_columns(rope_buf, cache_ptr, bt_row, start, hi, stride_cb, stride_cs, R, BLOCK_SIZE, NW, TILE_N, PW,
                      ROPE_COPY)  # fmt: skip
        async_copy.commit_group()

    @gluon.jit
    def _gluon_mla_decode_kernel(
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
        R: gl.constexpr,
        P: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
        TILE_N: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        IS_FP8: gl.constexpr,
        USE_SPLIT: gl.constexpr,
    ):
        M: gl.constexpr = 16
        NW: gl.constexpr = gl.num_warps()
        RW: gl.constexpr = R // NW
        PW: gl.constexpr = P // NW
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8]
        )
        # 16-bit operands (the latent tile: bf16/fp16 rows, or fp8 rows staged as fp16) use k width 2;
        # the fp8 rope columns are read as 8-bit operands and upcast in place (k width 4).
        A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        KW_ROPE: gl.constexpr = 4 if IS_FP8 else 2
        AR_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=KW_ROPE)
        BR_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=KW_ROPE)
        LAT_THREADS: gl.constexpr = (
            RW * cache_ptr.dtype.element_ty.primitive_bitwidth // 128
        )  # 16 B per thread
        ROPE_THREADS: gl.constexpr = PW * cache_ptr.dtype.element_ty.primitive_bitwidth // 128
        LAT_COPY: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, 1, 128 // cache_ptr.dtype.element_ty.primitive_bitwidth],
            threads_per_warp=[1, 32 // LAT_THREADS, LAT_THREADS],
            warps_per_cta=[NW, 1, 1],
            order=[2, 1, 0],
        )
        ROPE_COPY: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, 1, 128 // cache_ptr.dtype.element_ty.primitive_bitwidth],
            threads_per_warp=[1, 32 // ROPE_THREADS, ROPE_THREADS],
            warps_per_cta=[NW, 1, 1],
            order=[2, 1, 0],
        )
        Q_L: gl.constexpr = gl.BlockedLayout(
            size_per_thread=[1, 1, 8], threads_per_warp=[1, 2, 16], warps_per_cta=[NW, 1, 1], order=[2, 1, 0]
        )
        # 16-byte swizzle units, so every cp.async moves 16 bytes (8 fp8 values would halve it).
        RAW_SMEM: gl.constexpr = gl.SwizzledSharedLayout(
            vec=128 // cache_ptr.dtype.element_ty.primitive_bitwidth,
            per_phase=1,
            max_phase=8,
            order=[2, 1, 0],
        )
        SMEM: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0])

        seq = gl.program_id(0)
        hb = gl.program_id(1)
        split = gl.program_id(2)
        tok = gl.load(qsl_ptr + seq)
        if gl.load(qsl_ptr + seq + 1) <= tok:
            return  # no new token for this sequence this step (allowed by the metadata contract)
        seq_len = gl.load(seq_lens_ptr + seq)
        if IS_FP8:
            DOT_T: gl.constexpr = gl.float16
            qk_scale = sm_scale_log2 * gl.load(scale_ptr)
        else:
            DOT_T: gl.constexpr = ql_ptr.dtype.element_ty
            qk_scale = sm_scale_log2

        # Warp w's slices of the query: latent columns [w*RW, (w+1)*RW), rope columns [w*PW, ...).
        wq = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, Q_L)))
        hq = gl.arange(0, M, layout=gl.SliceLayout(0, gl.SliceLayout(2, Q_L)))
        heads = hb * M + hq
        h64 = heads.to(gl.int64)
        t64 = tok.to(gl.int64)
        cq = gl.arange(0, RW, layout=gl.SliceLayout(0, gl.SliceLayout(1, Q_L)))
        ql = gl.load(
            ql_ptr
            + t64 * stride_qlt
            + (h64 * stride_qlh)[None, :, None]
            + (wq * RW)[:, None, None]
            + cq[None, None, :],
            mask=(wq >= 0)[:, None, None] & (heads < NUM_HEADS)[None, :, None] & (cq < RW)[None, None, :],
            other=0.0,
        )
        cr = gl.arange(0, PW, layout=gl.SliceLayout(0, gl.SliceLayout(1, Q_L)))
        qr = gl.load(
            qr_ptr
            + t64 * stride_qrt
            + (h64 * stride_qrh)[None, :, None]
            + (wq * PW)[:, None, None]
            + cr[None, None, :],
            mask=(wq >= 0)[:, None, None] & (heads < NUM_HEADS)[None, :, None] & (cr < PW)[None, None, :],
            other=0.0,
        )
        ql_op = gl.convert_layout(ql.to(DOT_T), A_OP)
        qr_op = gl.convert_layout(qr.to(DOT_T), AR_OP)

        lo = 0
        hi = seq_len
        if USE_SPLIT:
            chunk = gl.cdiv(gl.cdiv(hi, num_splits), TILE_N) * TILE_N
            lo = split * chunk
            hi = gl.minimum(lo + chunk, hi)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), TILE_N)

        lat_ring = gl.allocate_shared_memory(
            cache_ptr.dtype.element_ty, [NUM_STAGES, NW, TILE_N, RW], RAW_SMEM
        )
        rope_ring = gl.allocate_shared_memory(
            cache_ptr.dtype.element_ty, [NUM_STAGES, NW, TILE_N, PW], RAW_SMEM
        )
        if IS_FP8:
            # Each warp converts its fp8 latent slice to fp16 once per tile; both products read the copy
            # (ldmatrix, and ldmatrix.trans for P C). One buffer: tile i-1's readers finish before the
            # loop-top barrier of tile i.
            lat16 = gl.allocate_shared_memory(gl.float16, [NW, TILE_N, RW], SMEM)
        bt_row = bt_ptr + seq.to(gl.int64) * stride_bt
        for j in gl.static_range(NUM_STAGES - 1):
            _issue_latent_tile(
                lat_ring.index(j), rope_ring.index(j), cache_ptr, bt_row, lo + j * TILE_N, hi, stride_cb,
                stride_cs, BLOCK_SIZE, NW, TILE_N, RW, PW, R, LAT_COPY, ROPE_COPY,
            )  # fmt: skip

        S_L: gl.constexpr = gl.SliceLayout(0, MMA)  # [M, TILE_N], the same in every warp
        m_i = gl.full([M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([M], gl.float32, layout=gl.SliceLayout(1, S_L))
        acc = gl.zeros([NW, M, RW], gl.float32, layout=MMA)
        n_off = gl.arange(0, TILE_N, layout=gl.SliceLayout(0, S_L))
        for i in range(num_tiles):
            stage = i % NUM_STAGES
            async_copy.wait_group(NUM_STAGES - 2)
            gl.thread_barrier()  # tile i landed for every thread; tile i-1's buffers are free
            nxt = i + NUM_STAGES - 1
            _issue_latent_tile(
                lat_ring.index(nxt % NUM_STAGES), rope_ring.index(nxt % NUM_STAGES), cache_ptr, bt_row,
                lo + nxt * TILE_N, hi, stride_cb, stride_cs, BLOCK_SIZE, NW, TILE_N, RW, PW, R, LAT_COPY,
                ROPE_COPY,
            )  # fmt: skip
            lat = lat_ring.index(stage)
            if IS_FP8:
                lat16.store(lat.load(LAT_COPY).to(gl.float16))
                gl.thread_barrier()
                lat = lat16
            kl = lat.permute((0, 2, 1)).load(B_OP)  # [NW, RW, TILE_N]
            kr = rope_ring.index(stage).permute((0, 2, 1)).load(BR_OP).to(DOT_T)  # [NW, PW, TILE_N]
            s_part = mma_v2(qr_op, kr, mma_v2(ql_op, kl, gl.zeros([NW, M, TILE_N], gl.float32, layout=MMA)))
            s = gl.sum(s_part, 0) * qk_scale  # [M, TILE_N], every warp holds all of it
            s = gl.where((lo + i * TILE_N + n_off < hi)[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            p = gl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            p3 = gl.convert_layout(
                gl.expand_dims(p.to(DOT_T), 0) + gl.zeros([NW, M, TILE_N], DOT_T, layout=MMA), A_OP
            )
            v = lat.load(B_OP)  # [NW, TILE_N, RW]
            acc = mma_v2(p3, v, acc * gl.expand_dims(gl.expand_dims(alpha, 1), 0))
        async_copy.wait_group(0)

        if IS_FP8:
            acc = acc * gl.load(scale_ptr)
        wo = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))
        ho = gl.arange(0, M, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))
        co = gl.arange(0, RW, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))
        heads_o = hb * M + ho
        h_ok = heads_o < NUM_HEADS
        col = (wo * RW)[:, None, None] + co[None, None, :]
        mask = (wo >= 0)[:, None, None] & h_ok[None, :, None] & (co < RW)[None, None, :]
        if USE_SPLIT:
            pidx = (t64 * NUM_HEADS + heads_o.to(gl.int64)) * num_splits + split  # paged merge-kernel layout
            gl.store(part_acc_ptr + (pidx * R)[None, :, None] + col, acc, mask=mask)
            ML_L: gl.constexpr = gl.SliceLayout(1, S_L)
            pidx_ml = gl.convert_layout(pidx, ML_L)
            ok_ml = gl.convert_layout(h_ok, ML_L)
            gl.store(part_ml_ptr + pidx_ml * 2, m_i, mask=ok_ml)
            gl.store(part_ml_ptr + pidx_ml * 2 + 1, l_i, mask=ok_ml)
        else:
            o = acc / gl.expand_dims(gl.expand_dims(l_i, 1), 0)
            gl.store(
                out_ptr + t64 * stride_ot + (heads_o.to(gl.int64) * stride_oh)[None, :, None] + col,
                o.to(out_ptr.dtype.element_ty),
                mask=mask,
            )


def launch_gluon_mla_decode(
    q_latent, q_rope, cache, out, part_acc, part_ml, meta, scale, sm_scale_log2, splits, cfg
):
    """Grid (num_seqs, 1, splits); the caller prepared ``part_acc [T, H, S, R]`` / ``part_ml`` when
    ``splits > 1`` and merges them (the paged-attention merge kernel)."""
    t, h, r = q_latent.shape
    tiling = default_tiling(cache.dtype in _FP8)
    return _gluon_mla_decode_kernel[(meta.num_seqs, 1, splits)](
        q_latent,
        q_rope,
        cache,
        out,
        part_acc,
        part_ml,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        scale,
        sm_scale_log2,
        splits,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        out.stride(0),
        out.stride(1),
        cache.stride(0),
        cache.stride(1),
        meta.block_tables.stride(0),
        NUM_HEADS=h,
        R=r,
        P=q_rope.shape[-1],
        BLOCK_SIZE=cache.shape[1],
        TILE_N=cfg.get("gluon_tile_n") or tiling["tile_n"],
        NUM_STAGES=cfg.get("gluon_stages") or tiling["num_stages"],
        IS_FP8=cache.dtype in _FP8,
        USE_SPLIT=splits > 1,
        num_warps=cfg.get("gluon_warps") or tiling["num_warps"],
    )


MAX_SPLITS: int = 64


def num_splits_for(num_seqs: int, max_seq_len: int, num_sms: int, programs_per_sm: int = 4) -> int:
    """About ``programs_per_sm`` programs per SM, no split under 512 tokens, at most ``MAX_SPLITS``."""
    return max(
        1,
        min(math.ceil(programs_per_sm * num_sms / max(1, num_seqs)), max(1, max_seq_len // 512), MAX_SPLITS),
    )


def mla_decode_gluon(q_latent, q_rope, cache, meta, scale, softmax_scale, *, num_splits=None, cfg=None):
    """``o_latent [T, H, R]`` like ``triton_mla_decode.mla_decode`` (model-dtype query), through this
    kernel; split partials merged by the paged-attention merge kernel."""
    if not supports(q_latent, cache, None):
        raise ValueError("outside the experiment's scope (see the module docstring)")
    cfg = dict(cfg or {})
    t, h, r = q_latent.shape
    out = torch.empty((t, h, r), dtype=q_latent.dtype, device=q_latent.device)
    num_seqs = meta.num_seqs
    if cache.dtype in _FP8:
        scale = scale.to(torch.float32).reshape(-1)[:1]
    else:
        scale = meta.seq_lens  # unused placeholder
    splits = num_splits or num_splits_for(num_seqs, meta.max_seq_len, _num_sms(q_latent.device),
                                          cfg.get("programs_per_sm", 4))
    splits = max(1, min(int(splits), MAX_SPLITS))
    if splits > 1:
        part_acc = torch.empty((t, h, splits, r), dtype=torch.float32, device=q_latent.device)
        part_ml = torch.empty((t, h, splits, 2), dtype=torch.float32, device=q_latent.device)
    else:
        part_acc = part_ml = out
    launch_gluon_mla_decode(q_latent, q_rope, cache, out, part_acc, part_ml, meta, scale,
                            float(softmax_scale) * _LOG2E, splits, cfg)
    if splits > 1:
        merge_split_partials(part_acc, part_ml, out, meta.query_start_loc, num_seqs)
    return out

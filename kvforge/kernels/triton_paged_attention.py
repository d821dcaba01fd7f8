"""Triton paged attention over the kvforge KV cache (bf16/fp16/fp32 or fp8).

Layout, step metadata and fp8 conventions: :mod:`kvforge.attention.metadata`.

One kernel serves decode, prefill and mixed batches. A program owns one KV
head and a *query tile*: ``BLOCK_Q`` consecutive query tokens of one sequence
times the ``G = Hq // Hkv`` query heads that share the KV head, packed into
``BLOCK_M = BLOCK_Q * G_PAD`` rows (row = token * G_PAD + head-in-group). So
every K/V tile is read once for all query heads of its KV head, and the
QK^T / PV products are real ``tl.dot`` s with M >= 16. The program walks the
causal context ``[lo, hi)`` of its tile ``TILE_N`` tokens at a time; a tile
spans ``TILE_N / block_size`` pages whose ids are gathered from the block
table, so enough bytes are in flight per iteration.

* fp8 K/V are upcast to the query dtype in registers; ``k_scale`` is folded
  into the softmax scale (``exp2`` domain) and ``v_scale`` multiplies the
  accumulator once at the end.
* Attention sinks (one logit per query head, ``sinks_log2`` in the exp2
  domain) join the softmax denominator only. The sink enters each query row
  exactly once, where the row's last (max, sum) is known: in the kernel's
  epilogue without split-K, in the merge kernel with it (the partials of the
  splits never hold it). Both take the running max over the sink too, so a
  sink far above every score cannot overflow.
* Decode-like batches (every sequence's query fits in one tile, e.g. pure
  decode) use split-K: ``num_splits`` programs per (sequence, KV head) each
  cover a slice of the context and write (acc, max, sum) partials that a second
  kernel merges. Long single-sequence decode then fills the GPU.
* Prefill / mixed batches map program ids to (sequence, query tile) with a
  binary search over ``query_start_loc`` (no host sync): sequence ``i`` owns
  tiles ``qsl[i] // BLOCK_Q + i ...``.

All row/slot/byte offsets are int64; block ids are the contract's int32.
"""

from __future__ import annotations

import dataclasses

import torch

from kvforge.attention.fp8 import FP8_DTYPES, storage_dtype_name
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.routing import paged as paged_routing
from kvforge.kernels import gluon_fp8_decode
from kvforge.kernels.gluon_support import routing_device
from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

# --------------------------------------------------------------------------
# What these kernels accept (plain data for the planner's backend declaration)
# --------------------------------------------------------------------------

#: Head sizes (K and V head dim must be equal). Non powers of two are padded to
#: the next power of two inside the kernel (masked), so they cost the padded
#: size in registers/compute but not in memory traffic.
SUPPORTED_HEAD_SIZES: tuple[int, ...] = (32, 48, 64, 80, 96, 112, 128, 160, 192, 256)
#: Block (page) size must be a multiple of this (any multiple works).
BLOCK_SIZE_MULTIPLE: int = 16
#: KV storage dtypes. fp32 caches work but are not tuned (dot in IEEE fp32).
SUPPORTED_KV_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2")
#: Query dtypes: the model dtype (bf16/fp16/fp32); fp8 queries are NOT accepted
#: (the kernel dequantizes K/V and folds k_scale into the softmax scale).
SUPPORTED_QUERY_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
ACCEPTS_QUANTIZED_QUERY: bool = False
#: GQA: any Hq divisible by Hkv; Hq // Hkv up to this value is supported.
MAX_GQA_RATIO: int = 128
#: Block ids come from the int32 block table; every product with a stride is
#: done in int64. The largest block id is therefore 2**31 - 1 and the largest
#: slot ``block * B + offset`` is ``2**31 * B - 1``; at the smallest block size
#: (16) that is 2**35 - 1 = 34,359,738,367 slots. Positions inside a sequence
#: are int32 (max context 2**31 - 1 tokens).
MAX_ADDRESSABLE_BLOCK: int = 2**31 - 1
MAX_ADDRESSABLE_SLOT: int = 2**31 * BLOCK_SIZE_MULTIPLE - 1
MAX_CONTEXT_LEN: int = 2**31 - 1

#: log2(e): every decode kernel works in the exp2 domain (softmax scale x LOG2E; split partials keep
#: log2-domain maxima).
LOG2E = 1.4426950408889634
#: Decode grids (the tl.dot kernel's one-tile decode, the Gluon "warp" kernel) put the KV head on the
#: fastest grid axis, so the programs of one sequence go out together, and hand out the sequences in
#: ``meta.decode_order`` (longest first) when the metadata has one. False: sequence-major grids in batch
#: order (benchmarks compare the two).
ORDERED_DECODE_GRID: bool = True
_LAST_LAUNCH: dict = {}  # diagnostics: the last compiled attention kernel (n_regs, n_spills)


if HAS_TRITON:

    @triton.jit
    def _load_kv_tile(
        kv_base,
        bt_row,
        start,
        hi,
        n_off,
        d,
        d_ok,
        stride_cb,
        stride_ckv,
        stride_cs,
        BLOCK_SIZE,
        HEAD_D,
        D_PAD,
    ):
        """Raw (storage dtype) K and V of tokens start..start+TILE_N-1 (masked at hi)."""
        pos = start + n_off
        p_ok = pos < hi
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=p_ok, other=0).to(tl.int64)
        row_off = blk * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs
        kv_off = row_off[:, None] + d[None, :]
        if HEAD_D == D_PAD:
            kv_mask = p_ok[:, None]
        else:
            kv_mask = p_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_base + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(kv_base + stride_ckv + kv_off, mask=kv_mask, other=0.0)
        return k, v

    @triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_bt"])
    def _paged_attn_kernel(
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
        qk_scale_log2,  # softmax_scale * log2(e)
        num_seqs,
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
        sinks_ptr,  # float32 [Hq] sink logits x log2(e) (read where USE_SINKS)
        order_ptr,  # int32 [num_seqs]: program slot -> sequence (read where USE_ORDER)
        NUM_Q_HEADS: tl.constexpr,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr,
        HEAD_D: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        IS_FP8: tl.constexpr,
        ONE_TILE_PER_SEQ: tl.constexpr,
        USE_SPLIT: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        USE_SINKS: tl.constexpr,
        IEEE_DOT: tl.constexpr,
        F16_DOT: tl.constexpr,
        HEADS_FIRST: tl.constexpr,
        USE_ORDER: tl.constexpr,
    ):
        if HEADS_FIRST:
            kvh = tl.program_id(0)
            pid_q = tl.program_id(1)
        else:
            pid_q = tl.program_id(0)
            kvh = tl.program_id(1)
        split = tl.program_id(2)

        if ONE_TILE_PER_SEQ:
            if USE_ORDER:
                seq = tl.load(order_ptr + pid_q)
            else:
                seq = pid_q
            qblk = 0
        else:
            # Largest seq with qsl[seq] // BLOCK_Q + seq <= pid_q (strictly increasing in seq).
            left = 0
            right = num_seqs
            while left < right:
                mid = (left + right) // 2
                v_mid = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
                if v_mid <= pid_q:
                    left = mid + 1
                else:
                    right = mid
            seq = left - 1
            qblk = pid_q - (tl.load(qsl_ptr + seq) // BLOCK_Q + seq)

        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx0 = seq_len - q_len  # position of the sequence's first new token
        tok0 = qblk * BLOCK_Q
        if tok0 >= q_len:
            return

        rows = tl.arange(0, BLOCK_M)
        tok = tok0 + rows // G_PAD
        g = rows % G_PAD
        row_ok = (tok < q_len) & (g < G)
        q_pos = ctx0 + tok
        qh = kvh * G + g
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_D
        tok64 = (q_start + tok).to(tl.int64)
        qh64 = qh.to(tl.int64)

        q = tl.load(
            q_ptr + tok64[:, None] * stride_qt + qh64[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )

        if F16_DOT:
            # fp8 -> fp16 is one hardware cvt per 2 values and exact; fp8 -> bf16 needs
            # more. So fp8 caches compute the dots in fp16 (|q| < 65504 assumed).
            q = q.to(tl.float16)
        qk_scale = qk_scale_log2
        if IS_FP8:
            qk_scale = qk_scale * tl.load(k_scale_ptr + kvh)

        # Context range of this query tile: [lo, hi).
        last_tok = tl.minimum(tok0 + BLOCK_Q, q_len) - 1
        hi = ctx0 + last_tok + 1
        lo = 0
        if USE_WINDOW:
            lo = tl.maximum(ctx0 + tok0 - window + 1, 0)
            lo = (lo // BLOCK_SIZE) * BLOCK_SIZE
        if USE_SPLIT:
            span = hi - lo
            chunk = tl.cdiv(tl.cdiv(span, num_splits), TILE_N) * TILE_N
            lo = lo + split * chunk
            hi = tl.minimum(lo + chunk, hi)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

        kv_base = kv_ptr + kvh.to(tl.int64) * stride_ch
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        n_off = tl.arange(0, TILE_N)
        for start in range(lo, hi, TILE_N):
            pos = start + n_off
            p_ok = pos < hi
            k, v = _load_kv_tile(
                kv_base,
                bt_row,
                start,
                hi,
                n_off,
                d,
                d_ok,
                stride_cb,
                stride_ckv,
                stride_cs,
                BLOCK_SIZE,
                HEAD_D,
                D_PAD,
            )
            kt = tl.trans(k.to(q.dtype))
            if IEEE_DOT:
                s = tl.dot(q, kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = s * qk_scale
            causal = (pos[None, :] <= q_pos[:, None]) & p_ok[None, :]
            if USE_WINDOW:
                causal = causal & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = v.to(q.dtype)
            if IEEE_DOT:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
            m_i = m_new

        if IS_FP8:
            acc = acc * tl.load(v_scale_ptr + kvh)

        if USE_SPLIT:
            # partials: acc [T, Hq, S, D_PAD] fp32, ml [T, Hq, S, 2] fp32
            pidx = (tok64 * NUM_Q_HEADS + qh64) * num_splits + split
            tl.store(
                part_acc_ptr + pidx[:, None] * D_PAD + d[None, :],
                acc,
                mask=row_ok[:, None],
            )
            tl.store(part_ml_ptr + pidx * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + pidx * 2 + 1, l_i, mask=row_ok)
        else:
            if USE_SINKS:
                sink = tl.load(sinks_ptr + qh, mask=row_ok, other=0.0)
                m_fin = tl.maximum(m_i, sink)
                alpha = tl.exp2(m_i - m_fin)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha + tl.exp2(sink - m_fin)
            o = acc / l_i[:, None]
            tl.store(
                out_ptr + tok64[:, None] * stride_ot + qh64[:, None] * stride_oh + d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )

    @triton.jit(do_not_specialize=["num_seqs", "num_splits"])
    def _merge_splits_kernel(
        part_acc_ptr,
        part_ml_ptr,
        out_ptr,
        qsl_ptr,
        num_seqs,
        num_splits,
        stride_ot,
        stride_oh,
        sinks_ptr,  # float32 [H] sink logits x log2(e) (read where USE_SINKS)
        out_cols_ptr,  # int32 [D]: the output column of partial column d (read where PERMUTED)
        NUM_Q_HEADS: tl.constexpr,
        HEAD_D: tl.constexpr,
        D_PAD: tl.constexpr,
        S_PAD: tl.constexpr,
        D_BLOCK: tl.constexpr,
        USE_SINKS: tl.constexpr,
        PERMUTED: tl.constexpr,
    ):
        # one program per (token, head, D_BLOCK columns): S_PAD x D_BLOCK partials in registers at once
        t = tl.program_id(0)
        h = tl.program_id(1)
        if t >= tl.load(qsl_ptr + num_seqs):
            return  # padding token that belongs to no sequence
        s = tl.arange(0, S_PAD)
        s_ok = s < num_splits
        d = tl.program_id(2) * D_BLOCK + tl.arange(0, D_BLOCK)
        base = (t.to(tl.int64) * NUM_Q_HEADS + h) * num_splits
        m = tl.load(part_ml_ptr + (base + s) * 2, mask=s_ok, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=s_ok, other=0.0)
        m_max = tl.max(m, 0)
        if USE_SINKS:
            sink = tl.load(sinks_ptr + h)
            m_max = tl.maximum(m_max, sink)
        w = tl.where(s_ok, tl.exp2(m - m_max), 0.0)
        # a split with no token (m = -inf) weighs 0 and need not have written its accumulator: not read
        has = s_ok & (m > float("-inf"))
        acc = tl.load(part_acc_ptr + (base + s)[:, None] * D_PAD + d[None, :], mask=has[:, None], other=0.0)
        denom = tl.sum(l_s * w, 0)
        if USE_SINKS:
            denom += tl.exp2(sink - m_max)  # once per (token, head): the splits' partials hold no sink
        o = tl.sum(acc * w[:, None], 0) / denom
        col = d
        if PERMUTED:
            col = tl.load(out_cols_ptr + d, mask=d < HEAD_D, other=0)
        tl.store(
            out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + col,
            o.to(out_ptr.dtype.element_ty),
            mask=d < HEAD_D,
        )


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    softmax_scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    kernel: str | None = None,
    gluon_tiling: dict | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of ``q`` ([T, Hq, D]) over ``kv_cache``; output dtype = ``q.dtype``.

    ``sinks`` (``[Hq]``, any float dtype; None: no sinks): head ``h``'s weights become
    ``exp(s_j) / (sum_i exp(s_i) + exp(sinks[h]))`` (the sink logit is not scaled by ``softmax_scale``).

    See the module docstring. The kernel and its split count come from the backend's routing table
    (:func:`kvforge.attention.routing.paged.route`); ``num_splits`` pins the count (CUDA graphs).
    ``kernel`` (tests): ``"tl_dot"`` keeps the Gluon kernels out; ``"gluon_fp8_warp1"``,
    ``"gluon_fp8_warp"`` or ``"gluon_fp8_cta"`` pick that Gluon row wherever the table routes the call to a
    Gluon kernel and the row's scope takes the shape (elsewhere the table's choice runs; the split count is
    the routed row's). ``gluon_tiling`` (tests): tiling overrides for the Gluon kernels
    (:func:`kvforge.kernels.gluon_fp8_decode.launch_gluon_fp8_decode`).
    """
    if not HAS_TRITON:
        raise RuntimeError("paged_attention needs triton")
    if kernel is not None and kernel not in paged_routing.KERNEL_NAMES:
        raise ValueError(f"kernel {kernel!r}: choose one of {', '.join(paged_routing.KERNEL_NAMES)}")
    T, hq, d = q.shape
    nb, two, hkv, bs, c_d = kv_cache.shape
    if two != 2 or c_d != d:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not match q {tuple(q.shape)}")
    if bs != meta.block_size or bs % BLOCK_SIZE_MULTIPLE:
        raise ValueError(
            f"block size {bs} (meta {meta.block_size}) must be a multiple of {BLOCK_SIZE_MULTIPLE}"
        )
    if hq % hkv:
        raise ValueError(f"Hq={hq} not divisible by Hkv={hkv}")
    if q.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("q and kv_cache need a contiguous head_dim axis")
    if out is None:
        out = torch.empty((T, hq, d), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError("out must have q's shape and a contiguous last axis")
    num_seqs = meta.num_seqs
    if T == 0 or num_seqs == 0:
        return out
    is_fp8 = kv_cache.dtype in FP8_DTYPES
    if is_fp8:
        if k_scale is None or v_scale is None:
            raise ValueError("fp8 kv cache needs k_scale and v_scale")
        k_scale = k_scale.to(torch.float32).reshape(-1).expand(hkv).contiguous()
        v_scale = v_scale.to(torch.float32).reshape(-1).expand(hkv).contiguous()
    else:
        k_scale = v_scale = meta.seq_lens  # unused placeholders
    if sinks is not None:
        if tuple(sinks.shape) != (hq,):
            raise ValueError(f"sinks must be [num_heads] = [{hq}], got {tuple(sinks.shape)}")
        sinks_log2 = sinks.to(device=q.device, dtype=torch.float32) * LOG2E
    else:
        sinks_log2 = meta.seq_lens  # unused placeholder

    window = int(sliding_window) if sliding_window else 0
    shape = paged_routing.PagedShape(num_seqs, hq, hkv, d, meta.max_query_len, meta.max_seq_len,
                                     storage_dtype_name(q.dtype), storage_dtype_name(kv_cache.dtype), window,
                                     sinks is not None)
    device = routing_device(q)
    if kernel == paged_routing.TL_DOT.name:
        device = dataclasses.replace(device, gluon=False)
    route = paged_routing.route(shape, device, num_splits)
    use_gluon = route.kernel != paged_routing.TL_DOT.name
    if use_gluon and kernel is not None and paged_routing.applies(paged_routing.KERNELS[kernel], shape, device):
        route = dataclasses.replace(route, kernel=kernel, tiling=paged_routing.KERNELS[kernel].tiling)
    splits = route.splits
    use_split = splits > 1
    d_pad = max(16, triton.next_power_of_2(d))
    if use_split:
        part_acc = torch.empty((T, hq, splits, d_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((T, hq, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out

    if use_gluon:
        _LAST_LAUNCH["attn"] = gluon_fp8_decode.launch_gluon_fp8_decode(
            q, kv_cache, out, part_acc, part_ml, meta, k_scale, v_scale,
            float(softmax_scale) * LOG2E, window if shape.uses_window else 0, splits,
            route.kernel != paged_routing.GLUON_FP8_CTA.name, {**dict(route.tiling), **(gluon_tiling or {})},
            ORDERED_DECODE_GRID,
        )  # fmt: skip
    else:
        tiles = route.tiles
        g = hq // hkv
        f16_dot = is_fp8 and q.dtype != torch.float32
        grid0 = num_seqs if tiles.one_tile else T // tiles.block_q + num_seqs
        heads_first = tiles.one_tile and ORDERED_DECODE_GRID
        order = meta.decode_order if heads_first else None
        grid = (hkv, grid0, splits) if heads_first else (grid0, hkv, splits)
        _LAST_LAUNCH["attn"] = _paged_attn_kernel[grid](
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
            float(softmax_scale) * LOG2E,
            num_seqs,
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
            NUM_Q_HEADS=hq,
            G=g,
            G_PAD=triton.next_power_of_2(g),
            BLOCK_Q=tiles.block_q,
            BLOCK_M=tiles.block_m,
            HEAD_D=d,
            D_PAD=d_pad,
            BLOCK_SIZE=bs,
            TILE_N=tiles.tile_n,
            IS_FP8=is_fp8,
            ONE_TILE_PER_SEQ=tiles.one_tile,
            USE_SPLIT=use_split,
            USE_WINDOW=shape.uses_window,
            IEEE_DOT=q.dtype == torch.float32,
            F16_DOT=f16_dot,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
            sinks_ptr=sinks_log2,
            USE_SINKS=sinks is not None,
            order_ptr=order if order is not None else meta.seq_lens,
            HEADS_FIRST=heads_first,
            USE_ORDER=order is not None,
        )
    if use_split:
        merge_split_partials(part_acc, part_ml, out, meta.query_start_loc, num_seqs,
                             sinks_log2 if sinks is not None else None)
    return out


#: Partials one merge program holds at once (splits x columns): 64 float32 per thread at 4 warps. Past it
#: the columns are split across programs (the MLA decode's 512 columns at 64-256 splits).
MERGE_TILE_ELEMENTS: int = 8192


def merge_split_partials(
    part_acc: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor, num_seqs: int,
    sinks_log2: torch.Tensor | None = None, *, out_columns: torch.Tensor | None = None,
) -> None:
    """``out[t, h, :D]`` = the softmax-weighted merge of split-K partials ``part_acc [T, H, S, D_PAD]``
    (unnormalized fp32 accumulators) and ``part_ml [T, H, S, 2]`` (log2-domain max, sum); ``D`` is
    ``out``'s last axis. Tokens at or past ``query_start_loc[num_seqs]`` are left untouched. Every
    split-K decode kernel (tl.dot, Gluon, MLA) writes this layout; a split whose max is -inf (no token)
    contributes nothing, and its accumulator row is not read (it may be left unwritten). ``sinks_log2``
    (float32 ``[H]``, sink logits x log2(e); None: no sinks) joins each row's denominator here, once: the
    partials must not hold it. ``out_columns`` (int32 ``[D]``, a permutation; None: the identity): partial column
    ``d`` is output column ``out_columns[d]``, for kernels that store their accumulators in register order."""
    t, h, splits, d_pad = part_acc.shape
    s_pad = max(2, triton.next_power_of_2(splits))
    d_block = min(d_pad, max(16, MERGE_TILE_ELEMENTS // s_pad))
    _merge_splits_kernel[(t, h, d_pad // d_block)](
        part_acc,
        part_ml,
        out,
        query_start_loc,
        num_seqs,
        splits,
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=h,
        HEAD_D=out.shape[-1],
        D_PAD=d_pad,
        S_PAD=s_pad,
        D_BLOCK=d_block,
        num_warps=4,
        sinks_ptr=query_start_loc if sinks_log2 is None else sinks_log2,
        USE_SINKS=sinks_log2 is not None,
        out_cols_ptr=query_start_loc if out_columns is None else out_columns,
        PERMUTED=out_columns is not None,
    )

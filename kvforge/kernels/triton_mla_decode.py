"""Triton MLA decode: absorbed multi-head latent attention over the paged latent cache.

Cache layout and math: :mod:`kvforge.attention.mla_reference` (rows
``[latent c (R) | k_rope (P)]``, one per token, shared by every head). Decode
steps only (one query token per sequence): for head ``h`` of token ``t``

    s(t, h, n) = softmax_scale * (q_latent[t,h] . c_n + q_rope[t,h] . kr_n)
    o_latent[t, h] = sum_n softmax(s)[n] * c_n          ([T, H, R], q dtype)

A program owns one sequence, ``BLOCK_H`` of its heads and (split-K) one slice
of its context; it walks the slice ``TILE_N`` tokens at a time, loading each
latent tile once for all its heads and using it twice: as K (``Q C^T``) and
as V (``P C``). Partials of split programs are merged by the paged-attention
merge kernel (same partial layout).

Two query regimes, chosen by the plan (``query_dtype``):

* **model dtype** (``query_dtype=None``): the query stays bf16/fp16/fp32; an
  fp8 tile is upcast in registers (to fp16, exact, with a 16-bit query:
  |q| < 65504 assumed) and the per-tensor scale is folded into the softmax
  scale and applied once to the output. Any head count, any KV dtype.
* **fp8 query** (``query_dtype="fp8_e4m3"``, e4m3 caches only): each (token,
  head) query row ``[q_latent | q_rope]`` is quantized with its own scale
  ``amax / 448``, ``Q C^T`` is an fp8 x fp8 tensor-core dot, and the row scale
  joins the softmax scale. ``P C`` stays a 16-bit dot. Used only where the
  routing table sends a declared e4m3 query to this kernel (above 16 heads).

Any block size (rows are gathered per token through the block table); any
``R``/``P`` (padded to powers of two in registers, masked in memory). All
offsets are int64.

:func:`mla_decode` is the backend's decode entry: it launches the candidates the routing table
(:func:`kvforge.attention.routing.mla.decode_candidates`) gives, in order: the warp-specialized and wgmma
Gluon kernels where they apply, this module's tl.dot kernel otherwise. A Gluon candidate whose launch runs
out of shared memory or registers (known at the first call, before any CUDA-graph capture) is skipped from
then on. ``tl_dot_only=True`` (tests and benchmarks) keeps the Gluon kernels out.
"""

from __future__ import annotations

import torch

from kvforge.attention.fp8 import FP8_DTYPES, storage_dtype_name
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.routing import mla as mla_routing
from kvforge.kernels import gluon_mla_decode, gluon_mla_decode_ws
from kvforge.kernels.gluon_support import num_sms, routing_device
from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton
from kvforge.kernels.triton_paged_attention import LOG2E

if HAS_TRITON:
    from triton.runtime.errors import OutOfResources

    from kvforge.kernels.triton_paged_attention import merge_split_partials

#: Query dtypes the kernel implements besides the model dtype.
QUANTIZED_QUERY_DTYPES: tuple[str, ...] = ("fp8_e4m3",)
#: KV dtypes an fp8 query can be paired with (the fp8 dot needs e4m3 x e4m3).
QUANTIZED_QUERY_KV_DTYPES: tuple[str, ...] = ("fp8_e4m3",)
#: Process-wide memo (why global: a compile-time fact about this GPU and Triton, the same for every engine):
#: (heads, q dtype, cache dtype, R, P, block size, fp8 query) -> tile_n / block_h that fit in shared memory
#: after the default ran out (see the OutOfResources fallback in mla_decode).
_SHRUNK_CONFIGS: dict[tuple, dict] = {}
#: Process-wide memo (same reason): (heads, q dtype, cache dtype, block size) whose wgmma launch ran out of
#: shared memory or registers on this GPU; those calls go to the tl.dot kernel.
_WGMMA_OUT_OF_RESOURCES: set[tuple] = set()


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_splits", "stride_bt"])
    def _mla_decode_kernel(
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
        sm_scale_log2,  # softmax_scale * log2(e)
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
        NUM_HEADS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        R: tl.constexpr,
        R_PAD: tl.constexpr,
        P: tl.constexpr,
        P_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        IS_FP8: tl.constexpr,
        FP8_QUERY: tl.constexpr,
        F16_DOT: tl.constexpr,
        IEEE_DOT: tl.constexpr,  # dots in float32 (IEEE): q and the tile are upcast
        USE_SPLIT: tl.constexpr,
    ):
        seq = tl.program_id(0)
        hb = tl.program_id(1)
        split = tl.program_id(2)
        q_start = tl.load(qsl_ptr + seq)
        if tl.load(qsl_ptr + seq + 1) - q_start <= 0:
            return
        seq_len = tl.load(seq_lens_ptr + seq)

        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = heads < NUM_HEADS
        r = tl.arange(0, R_PAD)
        p = tl.arange(0, P_PAD)
        t64 = q_start.to(tl.int64)
        h64 = heads.to(tl.int64)
        ql = tl.load(ql_ptr + t64 * stride_qlt + h64[:, None] * stride_qlh + r[None, :],
                     mask=h_ok[:, None] & (r[None, :] < R), other=0.0)
        qr = tl.load(qr_ptr + t64 * stride_qrt + h64[:, None] * stride_qrh + p[None, :],
                     mask=h_ok[:, None] & (p[None, :] < P), other=0.0)

        kv_scale = 1.0
        if IS_FP8:
            kv_scale = tl.load(scale_ptr)
        if FP8_QUERY:
            qlf = ql.to(tl.float32)
            qrf = qr.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(qlf), 1), tl.max(tl.abs(qrf), 1))
            q_scale = tl.maximum(amax / 448.0, 1e-30)
            ql = (qlf / q_scale[:, None]).to(tl.float8e4nv)
            qr = (qrf / q_scale[:, None]).to(tl.float8e4nv)
            row_scale = q_scale * (sm_scale_log2 * kv_scale)
        else:
            if F16_DOT:
                ql = ql.to(tl.float16)
                qr = qr.to(tl.float16)
            if IEEE_DOT:
                ql = ql.to(tl.float32)
                qr = qr.to(tl.float32)
            row_scale = tl.zeros([BLOCK_H], dtype=tl.float32) + sm_scale_log2 * kv_scale

        lo = 0
        hi = seq_len
        if USE_SPLIT:
            chunk = tl.cdiv(tl.cdiv(hi, num_splits), TILE_N) * TILE_N
            lo = split * chunk
            hi = tl.minimum(lo + chunk, hi)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, R_PAD], dtype=tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        n_off = tl.arange(0, TILE_N)
        for start in range(lo, hi, TILE_N):
            pos = start + n_off
            p_ok = pos < hi
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=p_ok, other=0).to(tl.int64)
            row = blk * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs
            c = tl.load(cache_ptr + row[:, None] + r[None, :], mask=p_ok[:, None] & (r[None, :] < R), other=0.0)
            kr = tl.load(cache_ptr + row[:, None] + R + p[None, :], mask=p_ok[:, None] & (p[None, :] < P),
                         other=0.0)
            if FP8_QUERY:
                s = tl.dot(ql, tl.trans(c)) + tl.dot(qr, tl.trans(kr))
                cv = c.to(tl.float16)
            else:
                cv = c.to(ql.dtype)
                if IEEE_DOT:
                    s = tl.dot(ql, tl.trans(cv), input_precision="ieee")
                    s += tl.dot(qr, tl.trans(kr.to(qr.dtype)), input_precision="ieee")
                else:
                    s = tl.dot(ql, tl.trans(cv)) + tl.dot(qr, tl.trans(kr.to(qr.dtype)))
            s = s * row_scale[:, None]
            s = tl.where(p_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            pr = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            if IEEE_DOT:
                acc = acc * alpha[:, None] + tl.dot(pr.to(cv.dtype), cv, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(pr.to(cv.dtype), cv)
            m_i = m_new

        if IS_FP8:
            acc = acc * kv_scale
        if USE_SPLIT:
            pidx = (t64 * NUM_HEADS + h64) * num_splits + split  # same layout as the paged merge kernel
            tl.store(part_acc_ptr + pidx[:, None] * R_PAD + r[None, :], acc, mask=h_ok[:, None])
            tl.store(part_ml_ptr + pidx * 2, m_i, mask=h_ok)
            tl.store(part_ml_ptr + pidx * 2 + 1, l_i, mask=h_ok)
        else:
            o = acc / l_i[:, None]
            tl.store(out_ptr + t64 * stride_ot + h64[:, None] * stride_oh + r[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & (r[None, :] < R))


def choose_config(num_heads: int, dot_bytes: int, row_pad: int) -> dict:
    """Tile sizes and launch parameters: 64-token tiles, 8 warps, 2 stages, heads per program and programs per
    SM from :func:`kvforge.attention.routing.mla.tl_dot_head_blocking`. Tiles shrink so that 2 stages of cache
    rows *in the dot's element size* (``dot_bytes``: 4 for float32 IEEE dots, whatever the cache stores) fit
    in 160 KB of shared memory (float32 dots: 32 tokens)."""
    block_h, programs_per_sm = mla_routing.tl_dot_head_blocking(num_heads)
    tile_n = 64
    while tile_n > 16 and 2 * tile_n * row_pad * dot_bytes > 160 * 1024:
        tile_n //= 2
    return dict(block_h=block_h, tile_n=tile_n, num_warps=8, num_stages=2, programs_per_sm=programs_per_sm)


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               scale: torch.Tensor | None, softmax_scale: float, *, query_dtype: str | None = None,
               num_splits: int | None = None, out: torch.Tensor | None = None,
               tl_dot_only: bool = False) -> torch.Tensor:
    """Latent-space decode attention (see the module docstring): ``o_latent [T, H, R]`` in q's dtype.

    ``q_latent [T, H, R]``, ``q_rope [T, H, P]`` (last axes contiguous); one
    query token per sequence (``meta.max_query_len <= 1``); tokens past
    ``query_start_loc[-1]`` are left untouched. ``scale``: the cache's float32
    per-tensor scale (fp8 caches). ``query_dtype``: None (model dtype) or
    "fp8_e4m3" (e4m3 caches only). ``num_splits`` pins split-K (CUDA graphs).
    """
    if cache.dim() != 3:
        raise ValueError(f"MLA cache must be [num_blocks, block_size, R + P], got {tuple(cache.shape)}")
    t, h, r = q_latent.shape
    _, bs, width = cache.shape
    p = q_rope.shape[-1]
    if r + p != width or tuple(q_rope.shape[:2]) != (t, h):
        raise ValueError(f"q_latent {tuple(q_latent.shape)} / q_rope {tuple(q_rope.shape)} do not match rows of "
                         f"{width}")
    if bs != meta.block_size:
        raise ValueError(f"cache block size {bs} != metadata block size {meta.block_size}")
    if meta.max_query_len > 1:
        raise ValueError(f"the Triton MLA decode takes one query token per sequence, got max_query_len "
                         f"{meta.max_query_len} (prefill goes through the expanded path)")
    if q_latent.stride(-1) != 1 or q_rope.stride(-1) != 1 or cache.stride(2) != 1:
        raise ValueError("q_latent, q_rope and the cache need a contiguous last axis")
    is_fp8 = cache.dtype in FP8_DTYPES
    fp8_query = query_dtype is not None
    if fp8_query:
        if query_dtype not in QUANTIZED_QUERY_DTYPES:
            raise ValueError(f"query dtype {query_dtype!r} not implemented (choose from "
                             f"{', '.join(QUANTIZED_QUERY_DTYPES)} or the model dtype)")
        if cache.dtype != torch.float8_e4m3fn:
            raise ValueError(f"an fp8 query needs an fp8_e4m3 cache (got {cache.dtype}); the plan must keep "
                             "the model-dtype query for this KV dtype")
        if q_latent.dtype == torch.float32:
            raise ValueError("an fp8 query is for 16-bit models; float32 models keep the float32 query")
    if not HAS_TRITON:  # after the argument checks, so bad calls are named the same everywhere
        raise RuntimeError("the Triton MLA decode needs triton (pip install triton; CUDA only)")
    if out is None:
        out = torch.empty((t, h, r), dtype=q_latent.dtype, device=q_latent.device)
    elif tuple(out.shape) != (t, h, r) or out.stride(-1) != 1:
        raise ValueError("out must be [T, H, R] with a contiguous last axis")
    num_seqs = meta.num_seqs
    if t == 0 or num_seqs == 0:
        return out
    if is_fp8 and scale is None:
        raise ValueError("an fp8 MLA cache needs its per-tensor scale")
    shape = mla_routing.MLAShape(num_seqs, h, r, p, meta.max_seq_len, storage_dtype_name(q_latent.dtype),
                                 storage_dtype_name(cache.dtype), query_dtype)
    for route in mla_routing.decode_candidates(shape, routing_device(q_latent), num_splits, tl_dot_only):
        if route.kernel == mla_routing.TL_DOT.name:
            return _launch_tl_dot(q_latent, q_rope, cache, meta, scale, softmax_scale, route.query_dtype,
                                  num_splits, out)
        gluon_key = (h, q_latent.dtype, cache.dtype, bs, route.query_dtype)
        if gluon_key in _WGMMA_OUT_OF_RESOURCES:
            continue
        try:
            if route.kernel == mla_routing.WS.name:
                return gluon_mla_decode_ws.mla_decode_ws(q_latent, q_rope, cache, meta, scale, softmax_scale,
                                                         num_splits=route.splits, out=out,
                                                         fp8_query=route.query_dtype is not None)  # fmt: skip
            return gluon_mla_decode.mla_decode_wgmma(q_latent, q_rope, cache, meta, scale, softmax_scale,
                                                     num_splits=route.splits, out=out,
                                                     query_dtype=route.query_dtype)  # fmt: skip
        except OutOfResources:  # at the first call (before any graph capture); the next candidate serves
            _WGMMA_OUT_OF_RESOURCES.add(gluon_key)
    raise AssertionError("the routing table's last candidate is the tl.dot kernel")  # pragma: no cover


def _launch_tl_dot(q_latent, q_rope, cache, meta, scale, softmax_scale, query_dtype, num_splits, out):
    """The tl.dot kernel (``query_dtype``: None or "fp8_e4m3"); the split count from the routing table's rule
    for the heads per program that fit (see the OutOfResources fallback)."""
    t, h, r = q_latent.shape
    bs, p = cache.shape[1], q_rope.shape[-1]
    num_seqs = meta.num_seqs
    is_fp8 = cache.dtype in FP8_DTYPES
    fp8_query = query_dtype is not None
    if is_fp8:
        scale = scale.to(torch.float32).reshape(-1)[:1]
    else:
        scale = meta.seq_lens  # unused placeholder

    # Dot dtype (model-dtype query): fp8 tiles -> fp16 dots with a 16-bit query (fp8 -> fp16 is exact);
    # a cache of the query's own 16-bit dtype -> that dtype; anything involving float32 or a bf16/fp16
    # mix -> float32 IEEE dots, so a wider cache is never rounded down to the query's precision.
    f16_dot = is_fp8 and not fp8_query and q_latent.dtype != torch.float32
    ieee_dot = not fp8_query and not f16_dot and (q_latent.dtype == torch.float32 or cache.dtype != q_latent.dtype)
    r_pad = max(16, triton.next_power_of_2(r))
    p_pad = max(16, triton.next_power_of_2(p))
    shape_key = (h, q_latent.dtype, cache.dtype, r, p, bs, fp8_query)
    cfg = choose_config(h, 4 if ieee_dot else cache.element_size(), r_pad + p_pad)
    cfg.update(_SHRUNK_CONFIGS.get(shape_key, {}))
    while True:
        block_h = cfg["block_h"]
        head_blocks = -(-h // block_h)
        splits = mla_routing.tl_dot_splits(num_seqs, h, meta.max_seq_len, num_sms(q_latent.device), block_h,
                                           cfg["programs_per_sm"], forced=num_splits)  # fmt: skip
        use_split = splits > 1
        if use_split:
            part_acc = torch.empty((t, h, splits, r_pad), dtype=torch.float32, device=q_latent.device)
            part_ml = torch.empty((t, h, splits, 2), dtype=torch.float32, device=q_latent.device)
        else:
            part_acc = part_ml = out
        try:
            _mla_decode_kernel[(num_seqs, head_blocks, splits)](
                q_latent, q_rope, cache, out, part_acc, part_ml,
                meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                float(softmax_scale) * LOG2E, splits,
                q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
                out.stride(0), out.stride(1), cache.stride(0), cache.stride(1), meta.block_tables.stride(0),
                NUM_HEADS=h, BLOCK_H=block_h, R=r, R_PAD=r_pad, P=p, P_PAD=p_pad, BLOCK_SIZE=bs,
                TILE_N=cfg["tile_n"], IS_FP8=is_fp8, FP8_QUERY=fp8_query, F16_DOT=f16_dot,
                IEEE_DOT=ieee_dot, USE_SPLIT=use_split,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            )
            break
        except OutOfResources:
            # Shared memory is known only after compiling (e.g. a float32 dot over a 16-bit query
            # stages converted operands): halve the token tile, then the heads per program, and
            # remember the shape's working config. Happens at the first call (before any graph capture).
            if cfg["tile_n"] > 16:
                cfg["tile_n"] //= 2
            elif cfg["block_h"] > 16:
                cfg["block_h"] //= 2
            else:
                raise
            _SHRUNK_CONFIGS[shape_key] = {"tile_n": cfg["tile_n"], "block_h": cfg["block_h"]}
    if use_split:
        merge_split_partials(part_acc, part_ml, out, meta.query_start_loc, num_seqs)
    return out

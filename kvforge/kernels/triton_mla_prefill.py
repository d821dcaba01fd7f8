"""Triton MLA prefill in latent space: a tile of query tokens of one sequence per program.

The math is the decode kernel's (:mod:`kvforge.kernels.triton_mla_decode`): for head ``h`` of query token
``t`` over the cached rows ``[c | k_rope]``

    s(t, h, n) = softmax_scale * (q_latent[t,h] . c_n + q_rope[t,h] . kr_n)
    o_latent[t, h] = sum_n softmax(s)[n] * c_n          ([T, H, R], q dtype)

with causal prefixes: query token ``j`` of a chunk of ``q`` tokens of a sequence of ``L`` tokens (prefix
included) sees keys ``0 .. L - q + j``. The per-token decode path reads a prompt's prefix once per query
token, each read feeding a dot of ``heads`` rows; here a program owns ``QUERY_TOKENS`` consecutive query
tokens and ``BLOCK_H`` of their heads, so ``QUERY_TOKENS x BLOCK_H`` rows (64) share each latent tile,
read once for all of them, and the score and value dots have 64 rows. Rows past a token's causal end are
masked inside the tile; the program walks the keys up to its last token's end.

Work comes as a tile table, ``int32 [num_tiles, 4]``: first query row, number of query tokens (1 to
``QUERY_TOKENS``), block-table row, causal length of the first token. :func:`query_tiles` builds it on the
host, longest first (the causal walks differ in length; the longest start first so that the shorter fill
in behind them). No split-K: a prefill chunk gives many programs. The query is the model dtype's (dots as
in the decode kernel's model-dtype regime: an fp8 tile upcast to fp16 with a 16-bit query, IEEE float32
dots for float32 or mixed 16-bit dtypes; the per-tensor scale applied once to the output). Any block size,
any ``R``/``P`` (padded to powers of two in registers, masked in memory); int64 offsets. No host sync.
"""

from __future__ import annotations

import numpy as np
import torch

from kvforge.attention.fp8 import FP8_DTYPES
from kvforge.attention.routing import mla as mla_routing
from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton
from kvforge.kernels.triton_paged_attention import LOG2E

if HAS_TRITON:
    from triton.runtime.errors import OutOfResources

#: Process-wide memo (why global: a compile-time fact about this GPU and Triton, the same for every engine):
#: (heads, q dtype, cache dtype, R, P, block size) -> the token tile that fit in shared memory after the
#: default ran out.
_SHRUNK_TILE_N: dict[tuple, int] = {}


if HAS_TRITON:

    @triton.jit(do_not_specialize=["stride_bt"])
    def _mla_prefill_kernel(
        ql_ptr,
        qr_ptr,
        cache_ptr,
        out_ptr,
        tiles_ptr,
        bt_ptr,
        scale_ptr,
        sm_scale_log2,  # softmax_scale * log2(e)
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
        QUERY_TOKENS: tl.constexpr,
        R: tl.constexpr,
        R_PAD: tl.constexpr,
        P: tl.constexpr,
        P_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        IS_FP8: tl.constexpr,
        F16_DOT: tl.constexpr,
        IEEE_DOT: tl.constexpr,  # dots in float32 (IEEE): q and the tile are upcast
    ):
        tile = tl.program_id(0)
        hb = tl.program_id(1)
        info = tiles_ptr + tile * 4
        row0 = tl.load(info)
        count = tl.load(info + 1)
        seq = tl.load(info + 2)
        len0 = tl.load(info + 3)

        m = tl.arange(0, QUERY_TOKENS * BLOCK_H)
        tok = m // BLOCK_H
        heads = hb * BLOCK_H + m % BLOCK_H
        row_ok = (tok < count) & (heads < NUM_HEADS)
        causal_end = tl.where(row_ok, len0 + tok, 0)  # keys [0, causal_end) for each row
        r = tl.arange(0, R_PAD)
        p = tl.arange(0, P_PAD)
        t64 = (row0 + tok).to(tl.int64)
        h64 = heads.to(tl.int64)
        ql = tl.load(ql_ptr + t64[:, None] * stride_qlt + h64[:, None] * stride_qlh + r[None, :],
                     mask=row_ok[:, None] & (r[None, :] < R), other=0.0)
        qr = tl.load(qr_ptr + t64[:, None] * stride_qrt + h64[:, None] * stride_qrh + p[None, :],
                     mask=row_ok[:, None] & (p[None, :] < P), other=0.0)
        if F16_DOT:
            ql = ql.to(tl.float16)
            qr = qr.to(tl.float16)
        if IEEE_DOT:
            ql = ql.to(tl.float32)
            qr = qr.to(tl.float32)
        kv_scale = 1.0
        if IS_FP8:
            kv_scale = tl.load(scale_ptr)
        row_scale = sm_scale_log2 * kv_scale

        hi = len0 + count - 1  # the last token's causal end
        m_i = tl.full([QUERY_TOKENS * BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([QUERY_TOKENS * BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([QUERY_TOKENS * BLOCK_H, R_PAD], dtype=tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        n_off = tl.arange(0, TILE_N)
        for start in range(0, hi, TILE_N):
            pos = start + n_off
            p_ok = pos < hi
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=p_ok, other=0).to(tl.int64)
            crow = blk * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs
            c = tl.load(cache_ptr + crow[:, None] + r[None, :], mask=p_ok[:, None] & (r[None, :] < R), other=0.0)
            kr = tl.load(cache_ptr + crow[:, None] + R + p[None, :], mask=p_ok[:, None] & (p[None, :] < P),
                         other=0.0)
            cv = c.to(ql.dtype)
            if IEEE_DOT:
                s = tl.dot(ql, tl.trans(cv), input_precision="ieee")
                s += tl.dot(qr, tl.trans(kr.to(qr.dtype)), input_precision="ieee")
            else:
                s = tl.dot(ql, tl.trans(cv)) + tl.dot(qr, tl.trans(kr.to(qr.dtype)))
            s = tl.where(pos[None, :] < causal_end[:, None], s * row_scale, float("-inf"))
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

        o = acc * (kv_scale / tl.where(row_ok, l_i, 1.0))[:, None]
        tl.store(out_ptr + t64[:, None] * stride_ot + h64[:, None] * stride_oh + r[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (r[None, :] < R))


def query_tiles(first_rows: list[int], query_lens: list[int], seq_lens: list[int], table_rows: list[int],
                tokens_per_tile: int) -> np.ndarray:
    """The tile table (int32 ``[num_tiles, 4]``, see the module docstring) for sequences whose ``query_lens[i]``
    query tokens sit at rows ``first_rows[i]..`` of the query, ``seq_lens[i]`` tokens long with their prefix,
    block-table row ``table_rows[i]``; tiles of ``tokens_per_tile`` tokens, longest causal walk first."""
    rows: list[tuple[int, int, int, int]] = []
    for first, q, n, table_row in zip(first_rows, query_lens, seq_lens, table_rows):
        if q > n:
            raise ValueError(f"{q} query tokens in a sequence of {n}")
        prefix = n - q
        for j in range(0, q, tokens_per_tile):
            rows.append((first + j, min(tokens_per_tile, q - j), table_row, prefix + j + 1))
    table = np.asarray(rows, dtype=np.int32).reshape(-1, 4)
    order = np.argsort(-(table[:, 3] + table[:, 1]), kind="stable")  # the walk ends at len0 + count - 1
    return np.ascontiguousarray(table[order])


def mla_prefill_tiled(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, tiles: torch.Tensor,
                block_tables: torch.Tensor, scale: torch.Tensor | None, softmax_scale: float,
                out: torch.Tensor) -> torch.Tensor:
    """Latent-space attention of the query rows named by ``tiles`` (from :func:`query_tiles` with the tokens
    per tile of :func:`kvforge.attention.routing.mla.prefill_query_tiling` for these heads), written into
    ``out [T, H, R]``; other rows of ``out`` are left untouched. ``q_latent [T, H, R]``, ``q_rope [T, H, P]``
    (last axes contiguous); ``cache [num_blocks, block_size, R + P]``; ``scale``: the cache's float32
    per-tensor scale (fp8 caches)."""
    t, h, r = q_latent.shape
    _, bs, width = cache.shape
    p = q_rope.shape[-1]
    if r + p != width or tuple(q_rope.shape[:2]) != (t, h) or tuple(out.shape) != (t, h, r):
        raise ValueError(f"q_latent {tuple(q_latent.shape)} / q_rope {tuple(q_rope.shape)} / out "
                         f"{tuple(out.shape)} do not match rows of {width}")
    if q_latent.stride(-1) != 1 or q_rope.stride(-1) != 1 or out.stride(-1) != 1 or cache.stride(2) != 1:
        raise ValueError("q_latent, q_rope, out and the cache need a contiguous last axis")
    if tiles.dim() != 2 or tiles.shape[1] != 4 or tiles.dtype != torch.int32:
        raise ValueError(f"tiles must be int32 [num_tiles, 4], got {tiles.dtype} {tuple(tiles.shape)}")
    is_fp8 = cache.dtype in FP8_DTYPES
    if is_fp8 and scale is None:
        raise ValueError("an fp8 MLA cache needs its per-tensor scale")
    if not HAS_TRITON:
        raise RuntimeError("the Triton MLA prefill needs triton (pip install triton; CUDA only)")
    if tiles.shape[0] == 0:
        return out
    scale = scale.to(torch.float32).reshape(-1)[:1] if is_fp8 else tiles  # tiles: an unused placeholder
    block_h, tokens = mla_routing.prefill_query_tiling(h)
    f16_dot = is_fp8 and q_latent.dtype != torch.float32
    ieee_dot = not f16_dot and (q_latent.dtype == torch.float32 or cache.dtype != q_latent.dtype)
    r_pad = max(16, triton.next_power_of_2(r))
    p_pad = max(16, triton.next_power_of_2(p))
    key = (h, q_latent.dtype, cache.dtype, r, p, bs)
    dot_bytes = 4 if ieee_dot else 2
    tile_n = _SHRUNK_TILE_N.get(key, 64)
    while tile_n > 16 and 2 * tile_n * (r_pad + p_pad) * dot_bytes > 160 * 1024:
        tile_n //= 2
    while True:
        try:
            _mla_prefill_kernel[(tiles.shape[0], -(-h // block_h))](
                q_latent, q_rope, cache, out, tiles, block_tables, scale, float(softmax_scale) * LOG2E,
                q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
                out.stride(0), out.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0),
                NUM_HEADS=h, BLOCK_H=block_h, QUERY_TOKENS=tokens, R=r, R_PAD=r_pad, P=p, P_PAD=p_pad,
                BLOCK_SIZE=bs, TILE_N=tile_n, IS_FP8=is_fp8, F16_DOT=f16_dot, IEEE_DOT=ieee_dot,
                num_warps=8, num_stages=2,
            )
            return out
        except OutOfResources:  # known at the first call of a shape (prefill steps run eagerly)
            if tile_n <= 16:
                raise
            tile_n //= 2
            _SHRUNK_TILE_N[key] = tile_n

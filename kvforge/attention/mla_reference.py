"""Reference multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, in PyTorch.

Cache layout of one MLA layer (a view into the KV pool):

    cache: Tensor[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
           in the storage dtype (model dtype, torch.float8_e4m3fn or torch.float8_e5m2)

Row ``[block, offset]`` holds one token: its latent ``c`` (the
``kv_lora_rank`` features after ``kv_a_layernorm``) followed by its shared rope
key ``k_rope`` (``qk_rope_head_dim`` features, after rope). There is no head
axis: the latent is shared by all query heads and replicated on every TP rank.
Slots, block tables and ``slot_mapping`` follow :mod:`kvforge.attention.metadata`
(slot = block * block_size + offset, -1 = skip).

FP8: one float32 per-tensor ``scale`` per layer covers the whole row (latent
and rope part): stored = saturate(x / scale) (NaN -> 0, never NaN/inf),
dequantized = stored * scale. Model-dtype caches ignore ``scale``.

Attention for one head ``h`` with the up-projection ``kv_b_proj`` split as
``w_uk[h] [Dn, R]`` (key, no-rope part) and ``w_uv[h] [V, R]`` (value):

    score(t, s) = softmax_scale * (q_nope[t,h] . (w_uk[h] c_s) + q_rope[t,h] . k_rope_s)
    out[t, h]   = sum_s p(t, s) w_uv[h] c_s

Two evaluation orders, mathematically equal:

* prefill (:func:`mla_prefill`): expand the cached latents of the sequence to
  per-head K/V through ``w_uk``/``w_uv`` and attend in the head dims;
* decode (:func:`mla_decode`): absorb ``w_uk`` into the query
  (``q_latent = w_uk[h]^T q_nope``) and attend in latent space against the
  cache rows directly; the output ``o_latent [T, H, R]`` is projected by
  ``w_uv`` afterwards (:func:`mla_attention` does both steps).

Numerics: float32 whatever the storage dtype; the query stays in the model
dtype (never quantized: the declaration is ``QuantizedQuery.never()``) and the
fp8 dequant scale is folded into the softmax scale (scores) and applied once
to the latent output. Masked (future / unused) cache rows never contribute,
even when they hold garbage.
"""

from __future__ import annotations

import torch

from kvforge.attention.fp8 import fp8_max, is_fp8
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.reference import _storage_view, _widen_bits

__all__ = ["mla_attention", "mla_decode", "mla_prefill", "write_mla_cache"]

#: Most float32 score elements (heads x query rows x context) one prefill chunk materializes (256 MiB);
#: longer query chunks are split by rows, which leaves every row's arithmetic unchanged.
PREFILL_SCORE_ELEMENTS = 1 << 26


def _check_cache(cache: torch.Tensor) -> tuple[int, int, int]:
    if cache.dim() != 3:
        raise ValueError(f"MLA cache must be [num_blocks, block_size, kv_lora_rank + rope], got {tuple(cache.shape)}")
    return int(cache.shape[0]), int(cache.shape[1]), int(cache.shape[2])


def _scale_value(scale: float | torch.Tensor | None, device) -> torch.Tensor:
    """Per-tensor scale as a float32 0-d tensor (None -> 1.0)."""
    if scale is None:
        return torch.ones((), dtype=torch.float32, device=device)
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"MLA caches use one per-tensor scale, got shape {tuple(scale.shape)}")
        return scale.to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(scale), dtype=torch.float32, device=device)


def write_mla_cache(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                    scale: float | torch.Tensor | None = None) -> None:
    """Store ``[latent | k_rope]`` rows of one step at ``slot_mapping`` (in place).

    ``latent [T, R]``, ``k_rope [T, P]`` with ``R + P`` = the cache's last dim;
    ``slot_mapping`` int64 ``[n]``, ``n <= T``; ``-1`` skips a token, tokens
    ``>= n`` are ignored. fp8 caches store ``saturate(x / scale)``.
    """
    num_blocks, block_size, width = _check_cache(cache)
    n = int(slot_mapping.shape[0])
    if latent.shape[0] < n or k_rope.shape[0] < n:
        raise ValueError(f"slot_mapping has {n} entries but latent/k_rope have {latent.shape[0]}/{k_rope.shape[0]}")
    if latent.shape[1] + k_rope.shape[1] != width:
        raise ValueError(f"latent {tuple(latent.shape)} + k_rope {tuple(k_rope.shape)} do not fill rows of {width}")
    if n == 0:
        return
    slots = slot_mapping.to(device=cache.device, dtype=torch.int64)
    idx = torch.nonzero(slots >= 0, as_tuple=True)[0]
    if idx.numel() == 0:
        return
    slots = slots[idx]
    if int(slots.max()) >= num_blocks * block_size:
        raise IndexError(f"slot {int(slots.max())} out of range for {num_blocks} blocks of {block_size}")
    rows = torch.cat([latent[:n], k_rope[:n].to(latent.dtype)], dim=-1).to(cache.device)[idx]
    if is_fp8(cache.dtype):
        fmax = fp8_max(cache.dtype)
        y = rows.to(torch.float32) / _scale_value(scale, cache.device)
        rows = torch.nan_to_num(y, nan=0.0, posinf=fmax, neginf=-fmax).clamp_(-fmax, fmax).to(cache.dtype)
    else:
        rows = rows.to(cache.dtype)
    _storage_view(cache).view(num_blocks * block_size, width)[slots] = _storage_view(rows)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Blocks ``[B, nb]`` -> raw float32 rows ``[B, nb * block_size, R + P]`` and the widening factor.

    The dequantized value of a raw element is ``raw * factor * scale``.
    """
    bsz, nb = blocks.shape
    _, bs, width = cache.shape
    g = _storage_view(cache).index_select(0, blocks.reshape(-1))
    g, factor = _widen_bits(g, cache.dtype)
    return g.to(torch.float32).view(bsz, nb * bs, width), factor


def _check_prefill(cache: torch.Tensor, meta: AttentionMetadata, q_rope: torch.Tensor,
                   w_uk: torch.Tensor) -> tuple[int, int, int]:
    """A prefill's cache against its metadata and projections: ``(block_size, row width, kv_lora_rank)``."""
    _, bs, width = _check_cache(cache)
    if bs != meta.block_size:
        raise ValueError(f"cache block size {bs} != metadata block size {meta.block_size}")
    r = w_uk.shape[-1]
    if r + q_rope.shape[-1] != width:
        raise ValueError(f"kv_lora_rank {r} + rope {q_rope.shape[-1]} != cache row width {width}")
    return bs, width, r


def _sequences(meta: AttentionMetadata, num_tokens: int) -> tuple[list[int], list[int], list[int]]:
    qsl, seq_lens = meta.host_lists()
    if seq_lens and qsl[-1] > num_tokens:
        raise ValueError(f"query_start_loc[-1] = {qsl[-1]} > num_tokens = {num_tokens}")
    qlens = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens))]
    for i, (ql, sl) in enumerate(zip(qlens, seq_lens)):
        if ql < 0 or sl < ql:
            raise ValueError(f"sequence {i}: query_len {ql} invalid for seq_len {sl}")
    return qsl, qlens, seq_lens


def _dequant_factor(cache: torch.Tensor, scale, factor: float) -> torch.Tensor:
    if is_fp8(cache.dtype):
        return _scale_value(scale, cache.device) * factor
    return torch.full((), factor, dtype=torch.float32, device=cache.device)


def round_query_e4m3(q_latent: torch.Tensor, q_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounding of the declared e4m3 query, in PyTorch (what the warp-specialized kernel's fp8 score
    product applies, ``gluon_mla_decode_ws._fp8_query``): each (token, head) row ``[q_latent | q_rope]``
    scaled so its largest magnitude is 448, rounded to e4m3, scaled back; returned in the inputs' dtypes.
    The reference itself never rounds (it declares no quantized query); tests use this to tell the rounding
    apart from kernel error."""
    amax = torch.maximum(q_latent.float().abs().amax(-1), q_rope.float().abs().amax(-1))[..., None]
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    ql = (q_latent.float() / s).to(torch.float8_e4m3fn).float() * s
    qr = (q_rope.float() / s).to(torch.float8_e4m3fn).float() * s
    return ql.to(q_latent.dtype), qr.to(q_rope.dtype)


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
               scale: float | torch.Tensor | None, softmax_scale: float, *, query_dtype: str | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention in latent space (the absorbed form), for any query lengths.

    ``q_latent [T, H, R]`` (= ``w_uk^T q_nope`` per head), ``q_rope [T, H, P]``,
    in the model dtype; the cache must already hold this step's rows. Query
    token ``j`` of sequence ``i`` (position ``seq_lens[i] - query_len_i + j``)
    attends causally to positions ``0 .. p``. Scores are
    ``(q_latent . c_raw + q_rope . kr_raw) * softmax_scale * scale``; the output
    ``o_latent = softmax . c_raw * scale`` is ``[T, H, R]`` in ``q_latent.dtype``
    (rows of padding tokens past ``query_start_loc[-1]`` are zero). All
    sequences run as one padded batch. ``query_dtype`` must be None (no
    quantized query is declared); ``out`` (optional) receives the result.
    """
    if query_dtype is not None:
        raise ValueError(f"torch_mla_reference keeps the model-dtype query; a {query_dtype} query is not declared")
    if out is not None:
        out.copy_(mla_decode(q_latent, q_rope, cache, meta, scale, softmax_scale))
        return out
    num_blocks, bs, width = _check_cache(cache)
    if bs != meta.block_size:
        raise ValueError(f"cache block size {bs} != metadata block size {meta.block_size}")
    t, h, r = q_latent.shape
    if r + q_rope.shape[-1] != width or tuple(q_rope.shape[:2]) != (t, h):
        raise ValueError(f"q_latent {tuple(q_latent.shape)} / q_rope {tuple(q_rope.shape)} do not match rows of "
                         f"{width}")
    device = cache.device
    out = torch.zeros(t, h, r, dtype=q_latent.dtype, device=q_latent.device)
    qsl, qlens, seq_lens = _sequences(meta, t)
    seqs = [i for i in range(len(seq_lens)) if qlens[i] > 0]
    if not seqs:
        return out
    max_q = max(qlens[i] for i in seqs)
    max_len = max(seq_lens[i] for i in seqs)
    nb = -(-max_len // bs)
    sel = torch.tensor(seqs, dtype=torch.int64, device=device)
    lens = torch.tensor([seq_lens[i] for i in seqs], dtype=torch.int64, device=device)
    ql = torch.tensor([qlens[i] for i in seqs], dtype=torch.int64, device=device)
    starts = torch.tensor([qsl[i] for i in seqs], dtype=torch.int64, device=device)
    tables = meta.block_tables.to(device=device, dtype=torch.int64)[sel][:, :nb]
    used_blocks = torch.arange(nb, device=device)[None, :] < ((lens + bs - 1) // bs)[:, None]
    tables = torch.where(used_blocks, tables, torch.zeros_like(tables))  # unused entries are arbitrary
    raw, factor = _gather(cache, tables)  # [B, L, R + P]
    deq = _dequant_factor(cache, scale, factor)

    j = torch.arange(max_q, device=device)
    jj = torch.minimum(j[None, :], ql[:, None] - 1)  # padded rows repeat the last real row, dropped below
    tok = starts[:, None] + jj
    qpos = lens[:, None] - ql[:, None] + jj  # [B, max_q]
    kpos = torch.arange(nb * bs, device=device)
    allowed = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < lens[:, None, None])
    key_used = allowed.any(dim=1)  # [B, L]
    raw = torch.where(key_used[:, :, None], raw, torch.zeros((), dtype=raw.dtype, device=device))
    c, kr = raw[..., :r], raw[..., r:]

    ql_f = q_latent.to(device=device, dtype=torch.float32)[tok]  # [B, max_q, H, R]
    qr_f = q_rope.to(device=device, dtype=torch.float32)[tok]
    scores = torch.einsum("bqhr,bkr->bhqk", ql_f, c) + torch.einsum("bqhp,bkp->bhqk", qr_f, kr)
    scores *= deq * float(softmax_scale)
    scores.masked_fill_(~allowed[:, None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    o = torch.einsum("bhqk,bkr->bqhr", p, c) * deq  # [B, max_q, H, R]
    real = j[None, :] < ql[:, None]
    out[tok[real].to(out.device)] = o[real].to(device=out.device, dtype=out.dtype)
    return out


def mla_prefill(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                scale: float | torch.Tensor | None, softmax_scale: float, w_uk: torch.Tensor,
                w_uv: torch.Tensor) -> torch.Tensor:
    """Attention by expansion: each sequence's cached latents become per-head K/V.

    ``q_nope [T, H, Dn]``, ``q_rope [T, H, P]``, ``w_uk [H, Dn, R]``,
    ``w_uv [H, V, R]`` (``kv_b_proj.weight.view(H, Dn + V, R)`` split).
    K = ``[w_uk c_s | k_rope_s]``, V = ``w_uv c_s`` from the dequantized cache.
    Returns ``[T, H, V]`` in ``q_nope.dtype`` (padding rows zero). Query rows
    are processed in chunks so that at most ``PREFILL_SCORE_ELEMENTS`` scores
    exist at once (an 8192-token chunk over 32k of context at 16 heads would
    otherwise materialize 17 GB of float32 scores, twice).
    """
    bs, width, r = _check_prefill(cache, meta, q_rope, w_uk)
    t, h, _ = q_nope.shape
    device = cache.device
    out = torch.zeros(t, h, w_uv.shape[1], dtype=q_nope.dtype, device=q_nope.device)
    qsl, qlens, seq_lens = _sequences(meta, t)
    tables = meta.block_tables.to(device=device, dtype=torch.int64)
    wk = w_uk.to(device=device, dtype=torch.float32)
    wv = w_uv.to(device=device, dtype=torch.float32)
    deq = None
    for i, (ql, sl) in enumerate(zip(qlens, seq_lens)):
        if ql == 0:
            continue
        nb = -(-sl // bs)
        raw, factor = _gather(cache, tables[i, :nb][None])
        deq = _dequant_factor(cache, scale, factor) if deq is None else deq
        rows = raw[0, :sl] * deq  # dequantized [L, R + P]
        c, kr = rows[:, :r], rows[:, r:]
        k_nope = torch.einsum("lr,hdr->hld", c, wk)  # [H, L, Dn]
        v = torch.einsum("lr,hvr->hlv", c, wv)  # [H, L, V]
        kpos = torch.arange(sl, device=device)
        rows_per_chunk = max(1, PREFILL_SCORE_ELEMENTS // (h * sl))
        for c0 in range(0, ql, rows_per_chunk):
            n = min(rows_per_chunk, ql - c0)
            s0 = qsl[i] + c0
            qn = q_nope[s0:s0 + n].to(device=device, dtype=torch.float32)
            qr = q_rope[s0:s0 + n].to(device=device, dtype=torch.float32)
            scores = torch.einsum("qhd,hld->hql", qn, k_nope) + torch.einsum("qhp,lp->hql", qr, kr)
            scores *= float(softmax_scale)
            qpos = torch.arange(sl - ql + c0, sl - ql + c0 + n, device=device)
            scores.masked_fill_((kpos[None, :] > qpos[:, None])[None], float("-inf"))
            p = torch.softmax(scores, dim=-1)
            del scores
            o = torch.einsum("hql,hlv->qhv", p, v)
            out[s0:s0 + n] = o.to(device=out.device, dtype=out.dtype)
    return out


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float | torch.Tensor | None, softmax_scale: float, w_uk: torch.Tensor,
                  w_uv: torch.Tensor, *, query_dtype: str | None = None, num_splits: int | None = None) -> torch.Tensor:
    """One MLA layer's attention for a step: ``[T, H, V]`` in ``q_nope.dtype``.

    Decode-only steps (every sequence brings one token) take the absorbed
    latent-space path (:func:`mla_decode`); steps with a prefill chunk expand
    the latents (:func:`mla_prefill`). The cache must already hold the step's rows.
    ``query_dtype`` must be None (this backend declares no quantized query);
    ``num_splits`` is accepted for interface parity and ignored.
    """
    if query_dtype is not None:
        raise ValueError(f"torch_mla_reference keeps the model-dtype query; a {query_dtype} query is not declared")
    if meta.max_query_len <= 1:
        q_latent = torch.einsum("thd,hdr->thr", q_nope.float(), w_uk.float()).to(q_nope.dtype)
        o_latent = mla_decode(q_latent, q_rope, cache, meta, scale, softmax_scale)
        return torch.einsum("thr,hvr->thv", o_latent.float(), w_uv.float()).to(q_nope.dtype)
    return mla_prefill(q_nope, q_rope, cache, meta, scale, softmax_scale, w_uk, w_uv)

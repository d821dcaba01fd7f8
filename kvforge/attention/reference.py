"""Reference paged attention in plain PyTorch (any device; CI and GPU oracle).

Implements exactly the contract of :mod:`kvforge.attention.metadata`:

* :func:`write_kv_cache` stores one step's new K/V into the paged cache at
  ``slot_mapping`` (``-1`` = skip), quantizing with saturation for fp8 caches.
* :func:`paged_attention` reads K/V straight from the block tables and computes
  causal (optionally sliding-window) GQA attention for every new query token,
  optionally with attention sinks: one learned logit per query head that joins
  the softmax denominator only (it has no value row), so a head may give part
  of its attention mass to "nothing".

Numerics: everything is computed in float32 whatever the storage dtype; the
result has ``q.dtype`` (or ``out.dtype`` when ``out`` is given). For fp8
caches ``k_scale`` is folded into the softmax scale and ``v_scale`` is applied
to the output, so the raw fp8 values are only widened to float32, never
materialised scaled. Scales are ignored for model-dtype (bf16/fp16/fp32)
caches, which store unscaled values.

Shapes: ``q [num_tokens, Hq, D]``, ``k``/``v [num_tokens, Hkv, D]``,
``kv_cache [num_blocks, 2, Hkv, block_size, D]``; query head ``h`` uses KV
head ``h // (Hq // Hkv)``. Tokens past ``query_start_loc[-1]`` (padding) get a
zero output row, so ``out`` is always fully written.

Speed: a decode step (one new token in every sequence) runs as one batched product with no padded
query rows, and without any mask where every sequence sees the same key range (one sequence, or equal
lengths). Otherwise sequences with short queries (decode beside prefills, speculative verification; query
length <= :data:`BATCHED_QUERY_LEN`) run as one batched computation over all of
them, with their blocks gathered and padded to the longest context and masked.
Longer queries (prefill chunks) run per sequence, in query-row chunks sized so
the score matrix stays under :data:`SCORE_BUDGET_ELEMS` elements, and only the
key range that the chunk can see (causal / sliding window) is gathered.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvforge.attention.fp8 import as_head_scales, fp8_max, is_fp8
from kvforge.attention.metadata import AttentionMetadata

__all__ = ["BATCHED_QUERY_LEN", "SCORE_BUDGET_ELEMS", "DecodeKeys", "SlotTargets", "decode_keys",
           "paged_attention", "slot_targets", "write_kv_cache"]

BATCHED_QUERY_LEN = 8
"""Sequences with at most this many new tokens are batched together."""

SCORE_BUDGET_ELEMS = 1 << 24
"""Upper bound on float32 elements of one score matrix (64 MiB)."""


def _check_cache(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be [num_blocks, 2, num_kv_heads, block_size, head_dim], got {tuple(kv_cache.shape)}"
        )
    num_blocks, _, hkv, block_size, head_dim = kv_cache.shape
    return num_blocks, hkv, block_size, head_dim


def _storage_view(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 (indexing/index_put support for fp8 varies by device and version)."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def _to_storage(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, Hkv, D] -> storage dtype; fp8: saturate(x / scale[h]), NaN -> 0 (see kvforge.attention.fp8)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    fmax = fp8_max(dtype)
    y = x.to(torch.float32) / scale.view(1, -1, 1)
    y = torch.nan_to_num(y, nan=0.0, posinf=fmax, neginf=-fmax).clamp_(-fmax, fmax)
    return y.to(dtype)


class SlotTargets(NamedTuple):
    """Where a slot mapping's tokens go: ``rows`` (int64 indices of the written tokens, None when none is
    skipped) and, per written token, its ``blocks`` and ``offsets`` (int64). ``cache_rows`` (None, or two
    int64 ``[written tokens * Hkv]``): the rows of the written tokens' K heads and of their V heads in the
    cache seen as ``[num_blocks * 2 * Hkv * block_size, D]``, token-major then head."""

    rows: torch.Tensor | None
    blocks: torch.Tensor
    offsets: torch.Tensor
    cache_rows: tuple[torch.Tensor, torch.Tensor] | None = None


def slot_targets(slot_mapping: torch.Tensor, num_blocks: int, block_size: int,
                 device: torch.device, num_kv_heads: int | None = None) -> SlotTargets | None:
    """The targets of ``slot_mapping`` in a cache of ``num_blocks`` blocks of ``block_size`` on ``device``
    (None when every slot is -1); IndexError for a slot past the cache. It reads the slots' range on the host.
    With ``num_kv_heads`` the targets also hold ``cache_rows`` for a cache of that many KV heads.
    """
    slots = slot_mapping.to(device=device, dtype=torch.int64)
    if slots.numel() == 0:
        return None
    lo, hi = (int(x) for x in torch.aminmax(slots))
    rows = None
    if lo < 0:  # skipped tokens (padding): keep the others
        rows = torch.nonzero(slots >= 0, as_tuple=True)[0]
        if rows.numel() == 0:
            return None
        slots = slots[rows]
        hi = int(slots.max())
    if hi >= num_blocks * block_size:
        raise IndexError(f"slot {hi} out of range for {num_blocks} blocks of {block_size}")
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    cache_rows = None
    if num_kv_heads is not None:
        # Row of (block, K or V = kv, head h, offset) = ((block * 2 + kv) * Hkv + h) * block_size + offset.
        heads = torch.arange(2 * num_kv_heads, dtype=torch.int64, device=device).view(2, 1, num_kv_heads)
        first = (blocks * (2 * num_kv_heads * block_size) + offsets).view(1, -1, 1)
        cache_rows = tuple((first + heads * block_size).view(2, -1).unbind(0))
    return SlotTargets(rows, blocks, offsets, cache_rows)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    targets: SlotTargets | None = None,
) -> None:
    """Write new K/V rows into the paged cache, in place.

    ``k``, ``v``: ``[num_tokens, Hkv, D]`` (any float dtype). ``slot_mapping``:
    int64 ``[n]`` with ``n <= num_tokens``; token ``t < n`` goes to block
    ``slot // block_size``, offset ``slot % block_size``; ``-1`` skips the
    token (the cache is untouched for it); tokens ``>= n`` are ignored.
    fp8 caches store ``saturate(x / scale[h])`` (NaN -> 0, never NaN/inf);
    other caches store ``x`` cast to the cache dtype and ignore the scales.
    Scales: per-tensor or ``[Hkv]`` float32 (None = 1.0). Duplicate slots in
    one call are a caller error (which write wins is unspecified).
    ``targets``: ``slot_targets`` of this ``slot_mapping`` and cache shape, computed once by a caller that
    writes many layers' caches from one slot mapping (computed here when None).
    """
    num_blocks, hkv, block_size, head_dim = _check_cache(kv_cache)
    n = int(slot_mapping.shape[0])
    if k.shape[0] < n or v.shape[0] < n:
        raise ValueError(f"slot_mapping has {n} entries but k/v have {k.shape[0]}/{v.shape[0]} tokens")
    if tuple(k.shape[1:]) != (hkv, head_dim) or tuple(v.shape[1:]) != (hkv, head_dim):
        raise ValueError(f"k/v must be [num_tokens, {hkv}, {head_dim}], got {tuple(k.shape)}/{tuple(v.shape)}")
    if targets is None:
        targets = slot_targets(slot_mapping, num_blocks, block_size, kv_cache.device, hkv)
    if targets is None:
        return
    dtype = kv_cache.dtype
    if k.shape[0] != n or v.shape[0] != n:
        k, v = k[:n], v[:n]
    if k.device != kv_cache.device:
        k, v = k.to(kv_cache.device), v.to(kv_cache.device)
    if targets.rows is not None:
        k, v = k[targets.rows], v[targets.rows]
    rows_of = targets.cache_rows
    if (rows_of is not None and rows_of[0].shape[0] == targets.blocks.shape[0] * hkv and not is_fp8(dtype)
            and kv_cache.is_contiguous()):
        # Model-dtype cache: one indexed row copy for K and one for V, at rows computed once per slot mapping.
        rows = kv_cache.view(-1, head_dim)
        for kv_rows, x in ((rows_of[0], k), (rows_of[1], v)):
            x = x.reshape(-1, head_dim)
            rows.index_copy_(0, kv_rows, x if x.dtype == dtype else x.to(dtype))
        return
    if is_fp8(dtype):
        k = _to_storage(k, as_head_scales(k_scale, hkv, kv_cache.device), dtype)
        v = _to_storage(v, as_head_scales(v_scale, hkv, kv_cache.device), dtype)
    cache = _storage_view(kv_cache)
    # Advanced indices on dims 0 and 3, separated by slices: the indexed view is [n, Hkv, D].
    cache[targets.blocks, 0, :, targets.offsets] = _storage_view(k.to(dtype))
    cache[targets.blocks, 1, :, targets.offsets] = _storage_view(v.to(dtype))


def _widen_bits(raw: torch.Tensor, dtype: torch.dtype, native: bool | None = None) -> tuple[torch.Tensor, float]:
    """Gathered storage -> a tensor that widens exactly to float32, and a power-of-two factor.

    ``native`` (default: CUDA tensors) returns the fp8 tensor itself for torch's own cast: exact, and
    it never reads a value back to the host (the CPU path's NaN check below is a device sync, once per
    sequence and layer in an MLA prefill). CPU casts from fp8 are slow (scalar path), so on CPU fp8 goes
    through fp16 bit patterns (exact, NaN included): an e5m2 byte is the high byte of the fp16
    with the same value; an e4m3fn byte ``s eeee mmm`` placed as fp16
    ``s 0eeee mmm0000000`` is its value times 2^-8 (normal and subnormal
    alike), so the returned factor is 256 (the caller folds it into the scales).
    """
    if not is_fp8(dtype):
        return raw, 1.0
    if raw.is_cuda if native is None else native:
        return raw.view(torch.uint8).view(dtype), 1.0
    if dtype == torch.float8_e5m2:
        bits = raw.view(torch.uint8).to(torch.int16)
        bits.bitwise_left_shift_(8)
        return bits.view(torch.float16), 1.0
    u = raw.view(torch.uint8)
    bits = u.view(torch.int8).to(torch.int16)  # sign-extended: bits 15..7 all equal the sign
    bits.bitwise_left_shift_(7)
    bits.bitwise_and_(-0x4001)  # clear bit 14 (a copy of the sign); keep sign in bit 15
    mag = u & 0x7F
    # e4m3fn NaN (exponent and mantissa all ones; never written by write_kv_cache): rare slow path
    if mag.numel() and int(mag.max()) == 0x7F:
        bits.masked_fill_(mag == 0x7F, 0x7E00)
    return bits.view(torch.float16), 256.0


def _gather_kv(kv_cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Blocks ``[B, nb]`` -> raw K, V float32 ``[B, Hkv, nb * block_size, D]`` and their factor.

    The dequantized value of a raw element is ``raw * factor * scale[h]``.
    """
    bsz, nb = blocks.shape
    _, _, hkv, bs, d = kv_cache.shape
    g = _storage_view(kv_cache).index_select(0, blocks.reshape(-1))  # [B*nb, 2, Hkv, bs, D], K and V at once
    g, factor = _widen_bits(g, kv_cache.dtype)
    x = torch.empty(2, bsz, hkv, nb, bs, d, dtype=torch.float32, device=kv_cache.device)
    x.copy_(g.view(bsz, nb, 2, hkv, bs, d).permute(2, 0, 3, 1, 4, 5))  # widen + reorder in one pass
    x = x.view(2, bsz, hkv, nb * bs, d)
    return x[0], x[1], factor


def _gather_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``[2, Hkv, len(blocks), block_size, D]``: the blocks' K and V, KV head first, in one ``index_select``
    over the cache's block axis seen KV head first (a new contiguous tensor)."""
    return kv_cache.permute(1, 2, 0, 3, 4).index_select(2, blocks)


def _gather_kv_by_head(kv_cache: torch.Tensor, blocks: torch.Tensor,
                       bsz: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Blocks (int64 ``[bsz * nb]``, each sequence's ``nb`` in a row) -> raw K, V float32
    ``[Hkv, bsz, nb * block_size, D]`` and their factor (as :func:`_gather_kv`, KV head first): one
    ``index_select`` over the cache's block axis seen KV head first lands every head's blocks in order, so no
    reordering copy follows (float32 caches: no copy at all)."""
    _, _, hkv, bs, d = kv_cache.shape
    g, factor = _widen_bits(_gather_blocks(_storage_view(kv_cache), blocks), kv_cache.dtype)
    if g.dtype != torch.float32:
        g = g.to(torch.float32)
    x = g.view(2, hkv, bsz, -1, d)
    return x[0], x[1], factor


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    qk_scale: torch.Tensor | float,
    v_scale: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked softmax attention in float32.

    ``q [B, Hkv, G, Lq, D]``, ``k``/``v [B, Hkv, Lk, D]`` (raw, unscaled, float32; ``v``
    is modified in place), ``allowed [B, Lq, Lk]`` bool (every query row must allow at
    least one key), ``qk_scale [Hkv]`` or one float, ``v_scale [Hkv]`` or None (1), ``sinks`` None or float32 ``[Hkv, G]``
    (one extra logit per query head in the denominator). Returns ``[B, Hkv, G, Lq, D]``.
    Masked keys never contribute, even if the cache holds NaN/inf there.
    """
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k)
    scores *= _per_head(qk_scale, 5)
    scores.masked_fill_(~allowed[:, None, None], float("-inf"))
    if sinks is None:
        p = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.view(1, *sinks.shape, 1, 1).expand(*scores.shape[:-1], 1)
        p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    # Zero V rows that no query may see (bitwise, so stale NaN/inf there cannot leak in as 0 * NaN).
    key_used = allowed.any(dim=1)  # [B, Lk]
    keep = torch.where(key_used, -1, 0).to(torch.int32)[:, None, :, None]
    v.view(torch.int32).bitwise_and_(keep)  # in place: v is our own gathered copy
    o = torch.einsum("bhgqk,bhkd->bhgqd", p, v)
    return o if v_scale is None else o * _per_head(v_scale, 5)


def _per_head(scale: torch.Tensor | float, ndim: int) -> torch.Tensor | float:
    """A ``[Hkv]`` scale shaped to broadcast over dim 1 of an ``ndim``-dim tensor; a float as is."""
    return scale if isinstance(scale, float) else scale.view(1, -1, *([1] * (ndim - 2)))


def _times(scale: torch.Tensor | float | None, factor: float) -> torch.Tensor | float | None:
    return None if scale is None else scale * factor


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    softmax_scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    decode: DecodeKeys | None = None,
) -> torch.Tensor:
    """Causal paged attention of one step's new tokens over the cache.

    ``q``: ``[num_tokens, Hq, D]`` with ``Hq`` a multiple of the cache's
    ``Hkv``. The cache must already hold this step's K/V (call
    :func:`write_kv_cache` first). Query token ``j`` of sequence ``i`` sits at
    position ``p = seq_lens[i] - query_len_i + j`` and attends to keys at
    positions ``max(0, p - sliding_window + 1) .. p`` (all of ``0 .. p`` when
    ``sliding_window`` is None; otherwise it must be >= 1). Block-table entries
    beyond a sequence's ``ceil(seq_lens[i] / block_size)`` blocks are never
    read. Scores are ``q . k_raw * (softmax_scale * k_scale[h])``; the output
    is ``softmax . v_raw * v_scale[h]`` (fp8 caches; scales ignored otherwise).
    ``sinks`` (``[Hq]``, any float dtype) adds ``exp(sinks[h])`` to head
    ``h``'s softmax denominator: the weights become
    ``exp(s_j) / (sum_i exp(s_i) + exp(sinks[h]))`` and sum to less than one.
    Computed in float32; returns ``out`` (filled in place, any float dtype) or
    a new ``[num_tokens, Hq, D]`` tensor of ``q.dtype``. Rows of tokens past
    ``query_start_loc[-1]`` are zero. ``decode``: ``decode_keys(meta, sliding_window, kv_cache.device)``,
    computed once by a caller that attends many layers with one metadata (computed here when None).
    """
    num_blocks, hkv, block_size, head_dim = _check_cache(kv_cache)
    if block_size != meta.block_size:
        raise ValueError(f"cache block size {block_size} != metadata block size {meta.block_size}")
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % hkv != 0:
        raise ValueError(f"q must be [num_tokens, k*{hkv}, {head_dim}], got {tuple(q.shape)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    num_tokens, hq, _ = q.shape
    group = hq // hkv
    device = kv_cache.device
    if out is not None and tuple(out.shape) != (num_tokens, hq, head_dim):
        raise ValueError(f"out must be {(num_tokens, hq, head_dim)}, got {tuple(out.shape)}")

    if is_fp8(kv_cache.dtype):
        vs = as_head_scales(v_scale, hkv, device)
        qk_scale = as_head_scales(k_scale, hkv, device) * float(softmax_scale)
    else:  # model-dtype caches store unscaled values
        vs, qk_scale = None, float(softmax_scale)
    sink_logits = None
    if sinks is not None:
        if tuple(sinks.shape) != (hq,):
            raise ValueError(f"sinks must be [num_heads] = [{hq}], got {tuple(sinks.shape)}")
        sink_logits = sinks.to(device=device, dtype=torch.float32).view(hkv, group)

    if decode is None:
        decode = decode_keys(meta, sliding_window, device)
    if decode is not None:
        total = decode.num_seqs
        if total > num_tokens:
            raise ValueError(f"query_start_loc[-1] = {total} > num_tokens = {num_tokens}")
        qf = q if q.dtype == torch.float32 and q.device == device else q.to(device, torch.float32)
        o = _decode(qf, kv_cache, decode, qk_scale, vs, group, sink_logits)
        if out is None and total == num_tokens:
            # Row i is sequence i's one query token and there is no padding row: the result is the output.
            return o if o.dtype == q.dtype and o.device == q.device else o.to(device=q.device, dtype=q.dtype)
        if out is None:
            out = torch.empty(num_tokens, hq, head_dim, dtype=q.dtype, device=q.device)
        out[total:].zero_()
        out[:total] = o
        return out

    qsl, seq_lens = meta.host_lists()
    num_seqs = len(seq_lens)
    total = qsl[-1] if num_seqs else 0
    if total > num_tokens:
        raise ValueError(f"query_start_loc[-1] = {total} > num_tokens = {num_tokens}")
    qlens = _query_lens(qsl, seq_lens)
    qf = q.to(device=device, dtype=torch.float32)
    if out is None:
        out = torch.empty(num_tokens, hq, head_dim, dtype=q.dtype, device=q.device)
    if total < num_tokens:
        out[total:].zero_()
    block_tables = meta.block_tables.to(device=device, dtype=torch.int64)

    short = [i for i in range(num_seqs) if 0 < qlens[i] <= BATCHED_QUERY_LEN]
    if short:
        _batched(qf, kv_cache, block_tables, short, qsl, qlens, seq_lens, qk_scale, vs, group,
                 sliding_window, out, sink_logits)
    for i in range(num_seqs):
        if qlens[i] > BATCHED_QUERY_LEN:
            _one_sequence(qf, kv_cache, block_tables[i], qsl[i], qlens[i], seq_lens[i], qk_scale, vs,
                          group, sliding_window, out, sink_logits)
    return out


def _window_mask(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """``qpos [..., Lq, 1]``, ``kpos [..., 1, Lk]`` -> allowed ``[..., Lq, Lk]``."""
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    return allowed


def _query_lens(qsl: list[int], seq_lens: list[int]) -> list[int]:
    """Each sequence's number of query tokens; ValueError where it is negative or above its length."""
    qlens = [qsl[i + 1] - qsl[i] for i in range(len(seq_lens))]
    for i, (n, length) in enumerate(zip(qlens, seq_lens)):
        if n < 0 or length < n:
            raise ValueError(f"sequence {i}: query_len {n} invalid for seq_len {length}")
    return qlens


class DecodeKeys(NamedTuple):
    """The keys of a decode step (one query token per sequence, row i being sequence i's) under one sliding
    window; the same for every layer that shares the step's metadata and window.

    Sequence i reads ``num_blocks`` blocks, ``blocks[i * num_blocks:(i + 1) * num_blocks]`` (int64; block
    0 in place of entries past its last block), whose first key is at position ``first_block * block_size``.
    When every sequence sees the same keys, ``keys`` is their range within those ``num_blocks * block_size``
    keys and ``visible`` is None; otherwise ``keys`` is None and ``visible`` (bool ``[num_seqs, num_blocks *
    block_size]``) marks each sequence's visible keys.
    """

    num_seqs: int
    blocks: torch.Tensor
    num_blocks: int
    first_block: int
    keys: slice | None
    visible: torch.Tensor | None


def decode_keys(meta: AttentionMetadata, sliding_window: int | None,
                device: torch.device) -> DecodeKeys | None:
    """``meta``'s :class:`DecodeKeys` on ``device``, or None when it is not a decode step (a sequence brings
    more or fewer than one query token, or there is no sequence); ValueError for a query length that does not
    fit its sequence."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    qsl, seq_lens = meta.host_lists()
    b = len(seq_lens)
    if not b or BATCHED_QUERY_LEN < 1 or qsl[-1] != b:
        return None
    if min(_query_lens(qsl, seq_lens)) != 1:
        return None
    bs = meta.block_size
    window = sliding_window
    firsts = [max(0, n - window) if window is not None else 0 for n in seq_lens]  # first visible key
    lo, hi = min(firsts), max(seq_lens)
    first_block = lo // bs
    nb = (hi + bs - 1) // bs - first_block
    blocks = meta.block_tables.to(device=device)[:b, first_block:first_block + nb]
    if min(seq_lens) == hi and max(firsts) == lo:  # every sequence sees the same keys
        keys = slice(lo - first_block * bs, hi - first_block * bs)
        return DecodeKeys(b, blocks.reshape(-1).to(torch.int64), nb, first_block, keys, None)
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    bidx = torch.arange(first_block, first_block + nb, device=device)
    # Entries past a sequence's last block are arbitrary: read block 0 there (masked).
    blocks = torch.where(bidx[None, :] < (lens[:, None] + bs - 1) // bs, blocks, 0)
    kpos = first_block * bs + torch.arange(nb * bs, device=device)
    visible = kpos[None, :] < lens[:, None]
    if window is not None:
        visible &= kpos[None, :] >= lens[:, None] - window
    return DecodeKeys(b, blocks.reshape(-1).to(torch.int64), nb, first_block, None, visible)


def _decode(qf, kv_cache, dk: DecodeKeys, qk_scale, vs, group, sinks) -> torch.Tensor:
    """Every sequence brings one query token, row i of ``qf`` being sequence i's (``dk``: the step's
    :func:`decode_keys`); returns float32 ``[num_seqs, Hq, D]``. One batched product over the blocks holding
    any of their visible keys. Where all sequences see the same key range (one sequence, or equal lengths)
    that range is sliced out exactly and nothing is masked; otherwise keys outside a sequence's range are
    masked (scores to -inf, V rows zeroed bitwise as in :func:`_attend`)."""
    _, _, hkv, bs, d = kv_cache.shape
    b = dk.num_seqs
    if dk.keys is not None and sinks is None and vs is None and kv_cache.device.type == "cpu":
        # No mask, no sink, no scale but the softmax's: torch's fused attention, query head h reading KV head
        # h // group, over K and V seen as [B, Hkv, Lk, D] straight from the gathered
        # [2, Hkv, B, nb * bs, D] (few tensor calls: at one token per step each costs about as much as a
        # small product).
        g = _gather_blocks(kv_cache, dk.blocks)
        if g.dtype != torch.float32:
            g = g.to(torch.float32)
        lk, span = dk.keys.stop - dk.keys.start, dk.num_blocks * bs * d
        shape, strides = (b, hkv, lk, d), (span, b * span, d, 1)
        k = g.as_strided(shape, strides, g.storage_offset() + dk.keys.start * d)
        v = g.as_strided(shape, strides, g.storage_offset() + hkv * b * span + dk.keys.start * d)
        q4 = (qf if qf.shape[0] == b else qf[:b]).view(b, hkv * group, 1, d)
        o = F.scaled_dot_product_attention(q4, k, v, scale=qk_scale, enable_gqa=True)
        return o.view(b, hkv * group, d)
    k, v, factor = _gather_kv_by_head(kv_cache, dk.blocks, b)  # [Hkv, B, nb * bs, D]
    if dk.keys is not None:
        k, v = k[:, :, dk.keys], v[:, :, dk.keys]
    lk = k.shape[2]
    # KV head and batch merge in views of the gathered K and V; the score scale goes on the (small) query.
    q_scaled = (qf[:b].view(b, hkv, group, d) * _per_head(qk_scale * factor, 4)).transpose(0, 1)
    scores = torch.bmm(q_scaled.reshape(hkv * b, group, d), k.reshape(hkv * b, lk, d).transpose(1, 2))
    scores4 = scores.view(hkv, b, group, lk)  # [Hkv, B, G, Lk]
    if dk.visible is not None:
        scores4.masked_fill_(~dk.visible[None, :, None, :], float("-inf"))
        v.view(torch.int32).bitwise_and_(torch.where(dk.visible, -1, 0).to(torch.int32)[None, :, :, None])
    if sinks is None:
        p = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.view(hkv, 1, group, 1).expand(hkv, b, group, 1)
        p = torch.softmax(torch.cat([scores4, sink], dim=-1), dim=-1)[..., :-1].reshape(hkv * b, group, lk)
    o = torch.bmm(p, v.reshape(hkv * b, lk, d)).view(hkv, b, group, d)
    if vs is not None:
        o *= (vs * factor).view(-1, 1, 1, 1)
    return o.transpose(0, 1).reshape(b, hkv * group, d)


def _batched(qf, kv_cache, block_tables, seqs, qsl, qlens, seq_lens, qk_scale, vs, group, window, out, sinks):
    """All short-query sequences at once, padded to the longest query and context."""
    device = kv_cache.device
    bs = kv_cache.shape[3]
    hkv, d = kv_cache.shape[2], kv_cache.shape[4]
    b = len(seqs)
    max_q = max(qlens[i] for i in seqs)
    max_len = max(seq_lens[i] for i in seqs)
    # Earliest key any of these queries may see (sliding window lets us skip whole blocks).
    first_key = 0
    if window is not None:
        first_key = max(0, min(seq_lens[i] - qlens[i] for i in seqs) - window + 1)
    first_block = first_key // bs
    nb = (max_len + bs - 1) // bs - first_block

    sel = torch.tensor(seqs, dtype=torch.int64, device=device)
    lens = torch.tensor([seq_lens[i] for i in seqs], dtype=torch.int64, device=device)
    ql = torch.tensor([qlens[i] for i in seqs], dtype=torch.int64, device=device)
    starts = torch.tensor([qsl[i] for i in seqs], dtype=torch.int64, device=device)

    # Blocks: entries past a sequence's last block are arbitrary -> replace with block 0 (masked).
    bidx = torch.arange(first_block, first_block + nb, device=device)
    blocks = block_tables[sel][:, first_block:first_block + nb]
    used = bidx[None, :] < ((lens + bs - 1) // bs)[:, None]
    blocks = torch.where(used, blocks, torch.zeros_like(blocks))
    k, v, factor = _gather_kv(kv_cache, blocks)  # [B, Hkv, nb*bs, D]

    # Queries padded to max_q; padded rows reuse the last real row (never fully masked) and are dropped.
    j = torch.arange(max_q, device=device)
    jj = torch.minimum(j[None, :], ql[:, None] - 1)  # [B, max_q]
    tok = starts[:, None] + jj
    qpos = lens[:, None] - ql[:, None] + jj  # [B, max_q]
    qb = qf[tok]  # [B, max_q, Hq, D]
    qb = qb.view(b, max_q, hkv, group, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, max_q, D]

    kpos = first_block * bs + torch.arange(nb * bs, device=device)
    allowed = _window_mask(qpos[:, :, None], kpos[None, None, :], window)
    allowed &= kpos[None, None, :] < lens[:, None, None]
    o = _attend(qb, k, v, allowed, qk_scale * factor, _times(vs, factor), sinks)  # [B, Hkv, G, max_q, D]
    o = o.permute(0, 3, 1, 2, 4).reshape(b, max_q, hkv * group, d)
    real = j[None, :] < ql[:, None]
    out[tok[real].to(out.device)] = o[real].to(device=out.device, dtype=out.dtype)


def _one_sequence(qf, kv_cache, table, start, qlen, seq_len, qk_scale, vs, group, window, out, sinks):
    """One long-query sequence, in query-row chunks bounded by SCORE_BUDGET_ELEMS."""
    device = kv_cache.device
    bs = kv_cache.shape[3]
    hkv, d = kv_cache.shape[2], kv_cache.shape[4]
    hq = hkv * group
    span = seq_len if window is None else min(seq_len, window + qlen)
    rows = max(1, SCORE_BUDGET_ELEMS // max(1, hq * span))
    for r0 in range(0, qlen, rows):
        r1 = min(qlen, r0 + rows)
        p0 = seq_len - qlen + r0  # position of first query row in this chunk
        p1 = seq_len - qlen + r1  # one past the last
        k_lo = 0 if window is None else max(0, p0 - window + 1)
        b0, b1 = k_lo // bs, (p1 + bs - 1) // bs
        k, v, factor = _gather_kv(kv_cache, table[b0:b1][None])  # [1, Hkv, (b1-b0)*bs, D]
        kpos = b0 * bs + torch.arange((b1 - b0) * bs, device=device)
        qpos = torch.arange(p0, p1, device=device)
        allowed = _window_mask(qpos[:, None], kpos[None, :], window)[None]  # [1, n, Lk]
        n = r1 - r0
        qc = qf[start + r0:start + r1].view(n, hkv, group, d).permute(1, 2, 0, 3)[None]
        o = _attend(qc, k, v, allowed, qk_scale * factor, _times(vs, factor), sinks)  # [1, Hkv, G, n, D]
        o = o[0].permute(2, 0, 1, 3).reshape(n, hq, d)
        out[start + r0:start + r1] = o.to(device=out.device, dtype=out.dtype)

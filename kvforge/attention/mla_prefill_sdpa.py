"""Expanded MLA prefill in the model dtype through torch's fused attention (``scaled_dot_product_attention``).

The reference (:func:`kvforge.attention.mla_reference.mla_prefill`) expands each sequence's latents to
per-head K/V and attends with float32 einsums. It is exact, but slow on a GPU at long prompts. This
module computes the same attention with the expansion as two batched matmuls in the model dtype. The
attention itself is one fused ``scaled_dot_product_attention`` call per sequence, end-aligned: the chunk's
queries are the last ``query_len`` of ``seq_len`` positions (:func:`kvforge.attention.end_aligned_sdpa.end_aligned_sdpa`,
which keeps cuDNN's per-shape plans out of it). V is zero-padded
to the query/key head dim (192 for DeepSeek, against 128), because torch's flash kernel takes only equal
head dims; the padding columns are dropped. On CUDA, torch picks flash or a memory-efficient kernel; on
CPU, its math path. Heads go in groups, so that the expanded K and V of one call hold at most
``SDPA_KV_BYTES``; query rows go in chunks, so that a fallback to the math path (which materializes the
scores) holds at most ``SDPA_SCORE_ELEMENTS`` of them. Each chunk attends to the keys up to its last
position, which keeps the alignment. For long prompts the expanded form
costs ``2 x (qk_head_dim + v_head_dim)`` FLOPs per query, key and head (640 for DeepSeek-V2/V3). The
absorbed form through the decode kernels costs ``2 x (R + P + R)`` (2176). The expansion is
``2 x R x (Dn + V)`` per key and head, paid once per chunk.

Invariant: the result equals the reference's within the model dtype's rounding of K, V, P and the
output (bf16: 2^-8 relative per element). The fp8 cache is dequantized exactly as the reference
dequantizes it. Used by ``triton_mla`` for the prefilling sequences longer than
``ABSORBED_PREFILL_MAX_SEQ_LEN`` (``mla_prefill_mode="auto"``) and for every prefilling sequence with
``mla_prefill_mode="sdpa"`` (:func:`kvforge.attention.routing.mla.sequence_paths`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.attention.end_aligned_sdpa import end_aligned_sdpa
from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.mla_reference import _check_prefill, _dequant_factor, _gather, _sequences

__all__ = ["SDPA_KV_BYTES", "SDPA_SCORE_ELEMENTS", "mla_prefill_sdpa"]

#: Scores per query-row chunk at most (heads x rows x keys): 1 GiB of float32 should torch fall back to its
#: math path; a fused kernel never materializes them, and sees the chunks as separate calls.
SDPA_SCORE_ELEMENTS: int = 1 << 28
#: Bytes of expanded K and V per call at most (heads are split into groups to stay under it; one head is
#: always allowed): 1 GiB, against 13 GB for all 128 heads of a 128k-token sequence in bf16. The plan's
#: activation reserve counts one call's expansion (kvforge/planner/activations.py).
SDPA_KV_BYTES: int = 1 << 30


def mla_prefill_sdpa(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float | torch.Tensor | None, softmax_scale: float, w_uk: torch.Tensor,
                     w_uv: torch.Tensor, sequences: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[T, H, V]`` in ``q_nope.dtype`` with the reference's contract (padding rows zero). ``sequences``
    (None: all) picks the sequences attended; the rows of the others are zero too.

    ``q_nope [T, H, Dn]``, ``q_rope [T, H, P]``, ``w_uk [H, Dn, R]``, ``w_uv [H, V, R]``. Per sequence with
    query tokens: the dequantized latents ``c [L, R]`` and rope keys ``kr [L, P]`` become ``K = [c w_uk^T |
    kr]`` and ``V = c w_uv^T`` per head (model dtype), and the sequence's ``query_len`` queries attend to
    them causally, aligned to the end.
    """
    bs, width, r = _check_prefill(cache, meta, q_rope, w_uk)
    t, h, _ = q_nope.shape
    dtype, device = q_nope.dtype, q_nope.device
    out = torch.zeros(t, h, w_uv.shape[1], dtype=dtype, device=device)
    qsl, qlens, seq_lens = _sequences(meta, t)
    tables = meta.block_tables.to(device=cache.device, dtype=torch.int64)
    wk = w_uk.to(device=device, dtype=dtype).transpose(1, 2)  # [H, R, Dn]
    wv = w_uv.to(device=device, dtype=dtype).transpose(1, 2)  # [H, R, V]
    dv = w_uv.shape[1]
    qk_dim = q_nope.shape[-1] + width - r  # Dn + P; V is padded to it
    deq = None
    for i in range(len(seq_lens)) if sequences is None else sequences:
        ql, sl = qlens[i], seq_lens[i]
        if ql == 0:
            continue
        raw, factor = _gather(cache, tables[i, : -(-sl // bs)][None])
        deq = _dequant_factor(cache, scale, factor) if deq is None else deq
        rows = (raw[0, :sl] * deq).to(device=device, dtype=dtype)  # dequantized [L, R + P]
        q_all = torch.cat([q_nope[qsl[i]:qsl[i] + ql], q_rope[qsl[i]:qsl[i] + ql].to(dtype)], dim=-1)
        # Heads attend independently: expand K and V for at most heads_per_call heads at a time, so the
        # expansion holds at most SDPA_KV_BYTES whatever the head count and context.
        heads_per_call = max(1, min(h, SDPA_KV_BYTES // (2 * sl * qk_dim * rows.element_size())))
        for h0 in range(0, h, heads_per_call):
            hs = slice(h0, min(h, h0 + heads_per_call))
            hc = hs.stop - h0
            c = rows[:, :r].expand(hc, sl, r)
            k = torch.cat([torch.bmm(c, wk[hs]), rows[None, :, r:].expand(hc, sl, width - r)], dim=-1)
            v = torch.bmm(c, wv[hs])  # [hc, L, V]
            if dv < qk_dim:
                v = F.pad(v, (0, qk_dim - dv))
            rows_per_chunk = max(1, SDPA_SCORE_ELEMENTS // (hc * sl))
            for c0 in range(0, ql, rows_per_chunk):
                n = min(rows_per_chunk, ql - c0)
                end = sl - ql + c0 + n  # keys this chunk's last query sees
                q = q_all[c0:c0 + n, hs].transpose(0, 1)  # [hc, n, Dn + P]
                o = end_aligned_sdpa(q[None], k[None, :, :end], v[None, :, :end], float(softmax_scale))
                out[qsl[i] + c0:qsl[i] + c0 + n, hs] = o[0, ..., :dv].transpose(0, 1)
    return out

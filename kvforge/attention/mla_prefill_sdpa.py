"""Expanded MLA prefill in the model dtype through torch's fused attention (``scaled_dot_product_attention``).

The reference (:func:`kvforge.attention.mla_reference.mla_prefill`) expands each sequence's latents to
per-head K/V and attends with float32 einsums. It is exact, but slow on a GPU at long prompts. This
module computes the same attention with the expansion as two batched matmuls in the model dtype. The
attention itself is one fused ``scaled_dot_product_attention`` call per sequence, with a lower-right
causal mask: the chunk's queries are the last ``query_len`` of ``seq_len`` positions. On CUDA, torch
picks a flash or memory-efficient kernel; on CPU, its math path. For long prompts the expanded form
costs ``2 x (qk_head_dim + v_head_dim)`` FLOPs per query, key and head (640 for DeepSeek-V2/V3). The
absorbed form through the decode kernels costs ``2 x (R + P + R)`` (2176). The expansion is
``2 x R x (Dn + V)`` per key and head, paid once per chunk.

Invariant: the result equals the reference's within the model dtype's rounding of K, V, P and the
output (bf16: 2^-8 relative per element). The fp8 cache is dequantized exactly as the reference
dequantizes it. Used by ``triton_mla`` when ``KVFORGE_MLA_PREFILL=sdpa`` (see ``PREFILL_MODE`` there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.mla_reference import _check_cache, _dequant_factor, _gather, _sequences


def mla_prefill_sdpa(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float | torch.Tensor | None, softmax_scale: float, w_uk: torch.Tensor,
                     w_uv: torch.Tensor) -> torch.Tensor:
    """``[T, H, V]`` in ``q_nope.dtype`` with the reference's contract (padding rows zero).

    ``q_nope [T, H, Dn]``, ``q_rope [T, H, P]``, ``w_uk [H, Dn, R]``, ``w_uv [H, V, R]``. Per sequence with
    query tokens: the dequantized latents ``c [L, R]`` and rope keys ``kr [L, P]`` become ``K = [c w_uk^T |
    kr]`` and ``V = c w_uv^T`` per head (model dtype), and the sequence's ``query_len`` queries attend to
    them causally, aligned to the end.
    """
    num_blocks, bs, width = _check_cache(cache)
    if bs != meta.block_size:
        raise ValueError(f"cache block size {bs} != metadata block size {meta.block_size}")
    t, h, dn = q_nope.shape
    r = w_uk.shape[-1]
    if r + q_rope.shape[-1] != width:
        raise ValueError(f"kv_lora_rank {r} + rope {q_rope.shape[-1]} != cache row width {width}")
    dtype, device = q_nope.dtype, q_nope.device
    out = torch.zeros(t, h, w_uv.shape[1], dtype=dtype, device=device)
    qsl, qlens, seq_lens = _sequences(meta, t)
    tables = meta.block_tables.to(device=cache.device, dtype=torch.int64)
    wk = w_uk.to(device=device, dtype=dtype).transpose(1, 2)  # [H, R, Dn]
    wv = w_uv.to(device=device, dtype=dtype).transpose(1, 2)  # [H, R, V]
    deq = None
    for i, (ql, sl) in enumerate(zip(qlens, seq_lens)):
        if ql == 0:
            continue
        raw, factor = _gather(cache, tables[i, : -(-sl // bs)][None])
        deq = _dequant_factor(cache, scale, factor) if deq is None else deq
        rows = (raw[0, :sl] * deq).to(device=device, dtype=dtype)  # dequantized [L, R + P]
        c = rows[:, :r].expand(h, sl, r)
        k = torch.cat([torch.bmm(c, wk), rows[None, :, r:].expand(h, sl, width - r)], dim=-1)  # [H, L, Dn + P]
        v = torch.bmm(c, wv)  # [H, L, V]
        s0 = qsl[i]
        q = torch.cat([q_nope[s0:s0 + ql], q_rope[s0:s0 + ql]], dim=-1).transpose(0, 1)  # [H, ql, Dn + P]
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=causal_lower_right(ql, sl),
                                           scale=float(softmax_scale))  # fmt: skip
        out[s0:s0 + ql] = o[0].transpose(0, 1)
    return out

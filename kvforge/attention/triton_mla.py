"""The Triton MLA backend's implementation (CUDA): latent cache write + attention.

Decode-only steps run the absorbed form in latent space with the Triton
kernel (:mod:`kvforge.kernels.triton_mla_decode`); steps with a prefill chunk
expand the cached latents to per-head K/V with the PyTorch reference
(:func:`kvforge.attention.mla_reference.mla_prefill`, eager only). The cache
write is a Triton kernel (no host sync, so decode steps can be CUDA graphs).
``query_dtype`` is the plan's per-layer decision: None / the model dtype, or
"fp8_e4m3" where the declaration (triton_mla_backend.py) allows it; it applies
to decode steps (prefill chunks always use the model-dtype query).
"""

from __future__ import annotations

import torch

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.mla_reference import mla_prefill
from kvforge.kernels.triton_mla_cache_write import write_mla_cache
from kvforge.kernels.triton_mla_decode import mla_decode

__all__ = ["mla_attention", "mla_decode", "write_mla_cache"]


def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                  scale: torch.Tensor | None, softmax_scale: float, w_uk: torch.Tensor, w_uv: torch.Tensor, *,
                  query_dtype: str | None = None, num_splits: int | None = None) -> torch.Tensor:
    """One MLA layer's attention for a step: ``[T, H, V]`` in ``q_nope.dtype`` (same contract as the reference).

    ``w_uk [H, Dn, R]`` is absorbed into the query (``q_latent = w_uk^T q_nope``)
    and ``w_uv [H, V, R]`` projects the latent output, both as batched matmuls in
    the model dtype.
    """
    if meta.max_query_len <= 1:
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)  # [T, H, R]
        o_latent = mla_decode(q_latent.contiguous(), q_rope, cache, meta, scale, softmax_scale,
                              query_dtype=query_dtype, num_splits=num_splits)
        return torch.bmm(o_latent.transpose(0, 1), w_uv.to(q_nope.dtype).transpose(1, 2)).transpose(0, 1)
    return mla_prefill(q_nope, q_rope, cache, meta, scale, softmax_scale, w_uk, w_uv)

"""Torch's fused attention for a chunk of query rows at the end of a sequence, on the backends kvforge allows.

:func:`end_aligned_sdpa` attends ``m`` query rows to ``n >= m`` keys, query ``j`` seeing keys ``0 .. n - m +
j`` (the chunk's rows are the sequence's last ``m`` positions): ``is_causal=True`` when ``m == n`` (no cached
prefix), else the lower-right mask ``torch.nn.attention.bias.causal_lower_right``. Both prefill paths that
leave the Triton kernels call it: the paged one (kvforge/attention/paged_prefill_sdpa.py) and MLA's expanded
one (kvforge/attention/mla_prefill_sdpa.py).

Torch may pick only the backends of :data:`SDPA_BACKENDS`, first usable first. cuDNN's fused attention is
left out unless ``KVFORGE_SDPA_PREFILL_CUDNN`` is set: it finalizes an execution plan for every new shape
(tens to hundreds of milliseconds, once per prompt length the process has not seen), which the step would
wait for; flash takes any length at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from kvforge.env import ENV

__all__ = ["SDPA_BACKENDS", "end_aligned_sdpa"]

#: The fused-attention backends torch may pick, in order of priority.
SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    ((SDPBackend.CUDNN_ATTENTION,) if ENV.sdpa_prefill_cudnn else ())
    + (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
)


def end_aligned_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                     gqa: bool = False) -> torch.Tensor:
    """``q [1, H, m, D]`` over ``k, v [1, Hk, n, D]`` (``m <= n``), query ``j`` seeing keys ``0 .. n - m + j``;
    ``gqa``: ``Hk`` divides ``H`` and each KV head serves ``H / Hk`` query heads."""
    m, n = q.shape[2], k.shape[2]
    with sdpa_kernel(list(SDPA_BACKENDS), set_priority=True):
        if m == n:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=softmax_scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(m, n), scale=softmax_scale,
                                              enable_gqa=gqa)

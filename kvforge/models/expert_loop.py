"""The per-expert loop of routed MoE layers (the path without ``torch._grouped_mm``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def sum_over_experts(x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                     num_experts: int, expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``out[t] = sum of weights[s] * expert_mlp(experts[s], x[t])`` over the slots ``s`` with ``tokens[s] == t``.

    ``tokens``, ``experts`` (in ``[0, num_experts)``) and ``weights`` are flat, one entry per routed slot.
    Slots are sorted by expert and each expert with tokens runs once on its rows; the per-expert counts are
    read on the host, so this path cannot be captured in a CUDA graph. Each product ``y * weight`` is
    formed in the promoted dtype (float32 for float32 router weights) and cast to ``x``'s dtype.
    """
    out = torch.zeros_like(x)
    if experts.numel() == 0:
        return out
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    tokens, weights = tokens[order], weights[order]
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        tok = tokens[start:start + n]
        y = expert_mlp(expert, x[tok])
        out.index_add_(0, tok, (y * weights[start:start + n, None]).to(out.dtype))
        start += n
    return out

"""A gated delta-rule layer's decay ``g`` and write strength ``beta`` from its projections: Qwen3-Next's
Gated DeltaNet (one decay a value head) and Kimi-Linear's KDA (one a head's feature).

``g = -exp(A_log[head]) * softplus(f + dt_bias)`` in float32 over ``NC`` channels of ``head_dim`` a head,
``beta = sigmoid(b)`` in b's dtype. :func:`delta_gates` is the one entry: where the fused kernels serve
(kvforge/models/layers.py, ``fused_kernels``) one Triton kernel computes both
(kvforge/kernels/triton_delta_gates.py); elsewhere :func:`delta_gates_reference`, the PyTorch formulas the
kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.models.layers import fused_kernels


def delta_gates_reference(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor,
                          head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g float32 [T, NC], beta [T, NB])`` in PyTorch (``f``, ``b``: ``[T, ...]`` of ``NC`` / ``NB`` values a
    token; ``dt_bias``: ``NC`` values; ``a_log``: ``NC / head_dim``)."""
    t = f.shape[0]
    x = f.reshape(t, -1).float() + dt_bias.reshape(-1).float()
    decay = a_log.reshape(-1).float().exp()
    if head_dim > 1:
        decay = decay.repeat_interleave(head_dim)
    return -decay * F.softplus(x, threshold=20.0), b.reshape(t, -1).sigmoid()


def delta_gates(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g float32 [T, NC], beta [T, NB])``: the module docstring's gates, by the kernel where it serves."""
    if (fused_kernels(f) is not None and f.shape[0] and f.dim() in (2, 3) and b.dim() in (2, 3)
            and f.stride(-1) == 1 and b.stride(-1) == 1):
        from kvforge.kernels.triton_delta_gates import delta_gates as kernel

        return kernel(f, dt_bias, a_log, b, head_dim)
    return delta_gates_reference(f, dt_bias, a_log, b, head_dim)

"""The gates a gated delta-rule step receives: computed (:class:`GateValues`) or still as the layer's
projections (:class:`DeltaGates`), which a one-token CUDA step hands to the recurrent kernel to compute
inside it (kvforge/kernels/triton_gated_delta_rule.py, ``decode`` with ``dt_bias`` and ``a_log``); every
other step computes them first (kvforge/models/delta_gates.py). Either way the values are the same
formulas (kvforge/kernels/triton_delta_gates.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GateValues:
    """``g`` (float32 ``[T, Hv]``, or ``[T, Hv, K]`` per key channel) and ``beta`` ``[T, Hv]``, computed."""

    g: torch.Tensor
    beta: torch.Tensor

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.g, self.beta


@dataclass(frozen=True)
class DeltaGates:
    """``g = -exp(a_log) * softplus(f + dt_bias)`` and ``beta = sigmoid(b)`` not yet computed: ``f`` ``[T, NC]``
    (``NC`` = value heads, or value heads x ``head_dim`` key channels), ``b`` ``[T, Hv]``, ``dt_bias`` ``NC``
    values, ``a_log`` one a value head (any shape)."""

    f: torch.Tensor
    dt_bias: torch.Tensor
    a_log: torch.Tensor
    b: torch.Tensor
    head_dim: int

    def _per_head(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.head_dim == 1 else x.reshape(x.shape[0], -1, self.head_dim)

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, beta)`` shaped as :class:`GateValues` holds them."""
        from kvforge.models.delta_gates import delta_gates

        g, beta = delta_gates(self.f, self.dt_bias, self.a_log, self.b, self.head_dim)
        return self._per_head(g), beta

    def projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(f, b)`` shaped as ``(g, beta)``, for the kernel that computes the gates itself."""
        return self._per_head(self.f), self.b

"""Random weights for module-level tests: every parameter drawn in float32 and cast to its dtype."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def fill_normal(module: nn.Module, std: float) -> nn.Module:
    """Every parameter of ``module`` ~ normal(0, ``std``), drawn from torch's global generator in float32 (so
    float16 and float32 copies of one seed hold the same values up to the cast); returns ``module``."""
    for p in module.parameters():
        p.copy_(torch.randn_like(p, dtype=torch.float32).mul_(std).to(p.dtype))
    return module

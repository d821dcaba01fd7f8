"""YaRN rope: blended inverse frequencies and the cos/sin attention factor, in transformers' arithmetic order.

Frequencies that turn more than ``beta_fast`` times over the original context
(``original_max_position_embeddings``) keep their value, those turning fewer
than ``beta_slow`` times are divided by ``factor``, with a linear ramp between
(ramp bounds rounded outward when ``truncate``, the default). The attention
factor is ``attention_factor`` when given, else
``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set,
else ``mscale(factor)``.
"""

from __future__ import annotations

import math

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 * mscale * ln(scale) + 1`` for ``scale > 1``, else 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(yarn: dict, factor: float) -> float:
    """The factor cos and sin are multiplied by (see the module docstring)."""
    given = yarn.get("attention_factor")
    if given is not None:
        return float(given)
    mscale, mscale_all = yarn.get("mscale"), yarn.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
    return yarn_mscale(factor)


def yarn_inv_freq(dim: int, theta: float, yarn: dict, factor: float) -> torch.Tensor:
    """float32 ``[dim / 2]`` inverse frequencies of a ``dim``-feature rope with base ``theta``."""
    orig = float(yarn["original_max_position_embeddings"])
    beta_fast = float(yarn.get("beta_fast") or 32)
    beta_slow = float(yarn.get("beta_slow") or 1)

    def dim_for(rotations: float) -> float:  # rotary feature index that turns `rotations` times over orig
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_for(beta_fast), dim_for(beta_slow)
    if yarn.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # weight of the original (extrapolated) frequency
    return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep

"""The short causal depthwise convolution of linear-attention layers, with its carried state, in PyTorch.

Channel ``d`` of token ``t`` is ``act(bias[d] + sum_i weight[d, i] * xx[t + i, d])`` where
``xx = cat(state, x)``: the ``W - 1`` inputs before this call (oldest first) followed by the new
tokens ``x [T, D]``, ``W`` the kernel width (``weight [D, W]``, an HF ``conv1d.weight [D, 1, W]``
squeezed). A fresh sequence starts from a zero state (the zero padding of a causal convolution).
The new state is the last ``W - 1`` rows of ``xx``, so splitting a sequence into calls that carry
the state gives the outputs of one call. ``act`` is SiLU or None. Arithmetic in float32 (float64
for float64 inputs); the output has ``x``'s dtype, the state the caller's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", None)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor | None,
                  activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, D], new_state [W - 1, D])`` for one sequence (see the module docstring)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal conv1d activation {activation!r} is not supported; supported: {ACTIVATIONS}")
    d, width = weight.shape
    if x.dim() != 2 or x.shape[1] != d:
        raise ValueError(f"causal conv1d wants x [T, {d}], got {tuple(x.shape)}")
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    if state is None:
        state = torch.zeros(width - 1, d, dtype=cdt, device=x.device)
    elif state.shape != (width - 1, d):
        raise ValueError(f"conv state must be [W - 1, D] = {(width - 1, d)}, got {tuple(state.shape)}")
    xx = torch.cat([state.to(cdt), x.to(cdt)])  # [W - 1 + T, D]
    windows = xx.unfold(0, width, 1)  # [T, D, W]: window t holds xx[t : t + W]
    out = (windows * weight.to(cdt)).sum(-1)
    if bias is not None:
        out = out + bias.to(cdt)
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype), xx[xx.shape[0] - (width - 1):]


def state_after(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The conv state ``[W - 1, D]`` after the inputs ``x [T, D]`` that follow ``state``: the last ``W - 1``
    rows of ``cat(state, x)``, in ``state``'s dtype (the inputs are copied, never computed on)."""
    xx = torch.cat([state, x.to(state.dtype)])
    return xx[xx.shape[0] - state.shape[0]:]

"""Triton kernel: a gated delta-rule layer's decay and write strength from its projections, in one launch
(PyTorch takes eight: the casts, the bias add, the exponential of ``A_log``, softplus, the product, the
sigmoid).

For token ``t`` and channel ``c`` (the ``NC`` decay channels: one a value head for Qwen3-Next, one a head's
feature for Kimi-Linear, ``HEAD_DIM`` channels a head):

* ``g[t, c] = -exp(A_log[c // HEAD_DIM]) * softplus(f[t, c] + dt_bias[c])`` in float32, softplus with
  PyTorch's threshold 20 (``x`` itself above it) and otherwise as ``max(x, 0) + log1p(exp(-|x|))``, with
  ``log1p(e) = log(u) * e / (u - 1)`` for ``u = 1 + e`` rounded (the rounding of ``u`` cancels, so it is
  accurate to a few ulps; Triton has no ``log1p`` the interpreter runs);
* ``beta[t, h] = sigmoid(b[t, h])`` computed in float32 and rounded once to b's dtype.

``f`` and ``b`` are ``[T, G, C]`` views addressed through two strides each (the last dimension contiguous),
so the head-grouped halves of a fused projection need no copy; ``g`` is a contiguous float32 ``[T, NC]``,
``beta`` a contiguous ``[T, NB]`` of b's dtype. One program a token. Numerics: float32 as in PyTorch;
``exp`` and ``log`` may differ from PyTorch's in the last bits, so ``g`` agrees to a few float32 ulps. No host synchronization: safe inside CUDA-graph capture.
"""

from __future__ import annotations

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

#: Above it softplus is the identity (PyTorch's default threshold).
SOFTPLUS_THRESHOLD = 20.0

if HAS_TRITON:

    @triton.jit
    def decay_gate(f, dt_bias, a_log, THRESHOLD: tl.constexpr):
        """``-exp(a_log) * softplus(f + dt_bias)`` in float32 (the module docstring's ``g``), elementwise."""
        x = f.to(tl.float32) + dt_bias.to(tl.float32)
        small = tl.exp(-tl.abs(x))
        u = 1.0 + small  # log1p(small) = log(u) * small / (u - 1): the rounding of u cancels
        log1p = tl.where(u == 1.0, small, tl.log(u) * (small / tl.where(u == 1.0, 1.0, u - 1.0)))
        softplus = tl.where(x > THRESHOLD, x, tl.maximum(x, 0.0) + log1p)
        return -tl.exp(a_log.to(tl.float32)) * softplus

    @triton.jit
    def write_strength(b):
        """``sigmoid(b)`` in float32 (the caller rounds it to b's dtype, as the module docstring's ``beta``)."""
        return 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))

    @triton.jit
    def _delta_gates_kernel(
        f_ptr, dt_bias_ptr, a_log_ptr, b_ptr, g_ptr, beta_ptr, NC, NB, C_F, C_B,
        stride_f0, stride_f1, stride_b0, stride_b1,
        HEAD_DIM: tl.constexpr, THRESHOLD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK_C)
        cm = c < NC
        f = tl.load(f_ptr + t * stride_f0 + (c // C_F) * stride_f1 + c % C_F, mask=cm, other=0.0)
        dt_bias = tl.load(dt_bias_ptr + c, mask=cm, other=0.0)
        a_log = tl.load(a_log_ptr + c // HEAD_DIM, mask=cm, other=0.0)
        tl.store(g_ptr + t * NC + c, decay_gate(f, dt_bias, a_log, THRESHOLD), mask=cm)
        h = tl.arange(0, BLOCK_B)
        hm = h < NB
        b = tl.load(b_ptr + t * stride_b0 + (h // C_B) * stride_b1 + h % C_B, mask=hm, other=0.0)
        tl.store(beta_ptr + t * NB + h, write_strength(b).to(beta_ptr.dtype.element_ty), mask=hm)


def _three_dims(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() == 2:
        x = x.unsqueeze(1)
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [T, C] or [T, G, C] with a contiguous last dimension, got "
                         f"{tuple(x.shape)} strides {tuple(x.stride())}")
    return x


def delta_gates(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g float32 [T, NC], beta [T, NB] in b's dtype)``: the module docstring. ``f``: ``[T, NC]`` or ``[T, G,
    C]`` with ``G * C = NC``; ``dt_bias``: ``NC`` values; ``a_log``: ``NC / head_dim`` values (any shape);
    ``b``: ``[T, NB]`` or ``[T, G, C]``."""
    if not HAS_TRITON:
        raise RuntimeError("delta_gates needs triton")
    f3, b3 = _three_dims(f, "f"), _three_dims(b, "b")
    t, nc, nb = f3.shape[0], f3.shape[1] * f3.shape[2], b3.shape[1] * b3.shape[2]
    if b3.shape[0] != t:
        raise ValueError(f"f and b must have one token count, got {f3.shape[0]} and {b3.shape[0]}")
    if dt_bias.numel() != nc or head_dim < 1 or nc % head_dim or a_log.numel() != nc // head_dim:
        raise ValueError(f"{nc} decay channels of {head_dim} a head need dt_bias of {nc} values and A_log of "
                         f"{nc // max(head_dim, 1)}, got {dt_bias.numel()} and {a_log.numel()}")
    g = torch.empty((t, nc), dtype=torch.float32, device=f.device)
    beta = torch.empty((t, nb), dtype=b.dtype, device=b.device)
    if t:
        block_c = triton.next_power_of_2(nc)
        _delta_gates_kernel[(t,)](
            f3, dt_bias.contiguous(), a_log.contiguous(), b3, g, beta, nc, nb, f3.shape[2], b3.shape[2],
            f3.stride(0), f3.stride(1), b3.stride(0), b3.stride(1),
            HEAD_DIM=head_dim, THRESHOLD=SOFTPLUS_THRESHOLD, BLOCK_C=block_c, BLOCK_B=triton.next_power_of_2(nb),
            num_warps=4 if block_c <= 1024 else 8,
        )  # fmt: skip
    return g, beta

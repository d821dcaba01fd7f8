"""Which kernel multiplies a linear layer's input by its weight: ``F.linear`` (cuBLAS on CUDA) or the
small-M Triton kernel (kvforge/kernels/triton_small_m_linear.py), decided in one place.

:func:`use_small_m_linear` is the rule; :func:`linear` applies it to one product and :class:`Linear` (an
``nn.Linear`` with the same parameters, names and loading) routes every call of its ``forward``. The
models' projections, the row-parallel layers of tensor parallelism and the LM head call :func:`linear`.

The small-M kernel takes a product when

* the switch is on: :data:`SMALL_M_LINEAR`, from ``KVFORGE_SMALL_M_LINEAR`` in the environment
  (kvforge/env.py), else :data:`SMALL_M_LINEAR_DEFAULT`; assigning the module attribute before a forward
  (and before CUDA-graph capture, which records whichever path ran) overrides both;
* the tensors are on a device type in :data:`SMALL_M_LINEAR_DEVICES` (CUDA; tests add ``"cpu"`` to run the
  kernel in Triton's interpreter);
* ``x`` and the weight are bfloat16 or float16 of one dtype, with 1 to :data:`SMALL_M_MAX_ROWS` rows, the
  weight at most :data:`SMALL_M_MAX_WEIGHT_BYTES`;
* the weight's rows are 16-byte aligned (``K`` a multiple of 8), so the kernel streams whole vectors;
* (in :func:`linear`) ``x`` is 2-D, both are contiguous along ``K`` and autograd is off (the kernel is
  inference-only and reads ``nn.Linear``'s layout; input-major CPU weights never qualify).

Everything else runs ``F.linear``. The rule reads shapes and dtypes only, so a CUDA graph captured for
``M`` tokens holds the kernel an eager step of ``M`` tokens runs.

Prologues: where a one-row product takes the kernel and :data:`SMALL_M_PROLOGUES` is on
(``KVFORGE_SMALL_M_PROLOGUES``, else :data:`SMALL_M_PROLOGUES_DEFAULT`), the kernel also computes its
input from what the layer before left, saving that layer's launch (:func:`use_prologue` is the rule):

* ``RMSNorm(x + residual)``: a decoder layer hands its sublayer a :class:`PendingNorm` instead of the
  normed row (:func:`norm_input`) when the sublayer declares the :class:`Linear` that first and only reads
  its input (``input_projection``); that Linear's forward runs the norm inside its product and records the
  new residual stream, which the layer then reads (:func:`stream_of`);
* ``SiLU(gate) * up``: a gated MLP's down projection over the ``[gate | up]`` row (:func:`silu_mul_linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.env import ENV

#: Whether the kernel serves where the environment does not say. On an H200 it beats cuBLAS on every
#: Llama-3.1-8B projection and the LM head at one row, and a batch-1 decode step is 6-7% faster with it
#: (docs/BENCHMARKS.md, "Batch 1").
SMALL_M_LINEAR_DEFAULT = True
#: The process's switch (see the module docstring).
SMALL_M_LINEAR: bool = SMALL_M_LINEAR_DEFAULT if ENV.small_m_linear is None else ENV.small_m_linear
SMALL_M_LINEAR_DEVICES: tuple[str, ...] = ("cuda",)
#: The most rows (tokens of a step) the kernel takes; more go to cuBLAS. The kernel handles up to 16. With the
#: present launch rule (taken from both cards' per-projection timings) 2-, 4- and 8-sequence Llama-3.1-8B decode
#: ran 6.0 / 4.8 / 4.7% faster on the kernel than on cuBLAS on an H100; the H200's per-projection timings put
#: its products 2-4% below cuBLAS's there (docs/BENCHMARKS.md, "Two to eight rows").
SMALL_M_MAX_ROWS = 8
#: The largest weight (bytes) the kernel takes; None: any. (Where cuBLAS already streams large weights at
#: copy bandwidth, only the smaller projections need the kernel.)
SMALL_M_MAX_WEIGHT_BYTES: int | None = None
#: Whether one-row products also compute their input (see the module docstring) where the environment
#: does not say.
SMALL_M_PROLOGUES_DEFAULT = True
SMALL_M_PROLOGUES: bool = SMALL_M_PROLOGUES_DEFAULT if ENV.small_m_prologues is None else ENV.small_m_prologues
_DTYPES = (torch.bfloat16, torch.float16)
_ROW_ALIGN_BYTES = 16

_kernel = None  # (small_m_linear, num_sms), imported on first use (the CPU engine never needs triton)


def use_small_m_linear(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``x [m, k] @ weight[n, k].T`` in ``dtype`` on ``device`` runs the small-M kernel."""
    return (
        SMALL_M_LINEAR
        and device.type in SMALL_M_LINEAR_DEVICES
        and dtype in _DTYPES
        and 1 <= m <= SMALL_M_MAX_ROWS
        and n > 0
        and (k * dtype.itemsize) % _ROW_ALIGN_BYTES == 0
        and (SMALL_M_MAX_WEIGHT_BYTES is None or n * k * dtype.itemsize <= SMALL_M_MAX_WEIGHT_BYTES)
    )


def _small_m_kernel():
    global _kernel
    if _kernel is None:
        from kvforge.kernels import gluon_support, triton_small_m_linear

        _kernel = (triton_small_m_linear, gluon_support.num_sms)
    return _kernel


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, by the small-M kernel where :func:`use_small_m_linear` says so."""
    if (
        x.dim() == 2
        and use_small_m_linear(x.shape[0], weight.shape[0], x.shape[1], x.dtype, x.device)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and (bias is None or bias.stride(0) == 1)
        and not torch.is_grad_enabled()
    ):
        kernel, num_sms = _small_m_kernel()
        return kernel.small_m_linear(x, weight, bias, num_sms=num_sms(x.device))
    return F.linear(x, weight, bias)


def use_prologue(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the product by ``weight`` of the row the prologue computes from the one row ``x`` (the
    residual stream, or the ``[gate | up]`` row) runs in the small-M kernel with that prologue."""
    return (
        SMALL_M_PROLOGUES
        and x.dim() == 2
        and x.shape[0] == 1
        and use_small_m_linear(1, weight.shape[0], weight.shape[1], x.dtype, x.device)
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.stride(1) == 1
        and (bias is None or bias.stride(0) == 1)
        and not torch.is_grad_enabled()
    )


class PendingNorm:
    """``RMSNorm(x + residual)`` (``RMSNorm(x)`` without a residual) not yet computed: the input of a
    :class:`Linear` that computes it inside its product. After that product, :attr:`stream` holds the
    residual stream ``x + residual`` (``x`` without a residual)."""

    def __init__(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float):
        self.x, self.residual, self.norm_weight, self.eps = x, residual, norm_weight, eps
        self.stream: torch.Tensor | None = None

    def project(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel, num_sms = _small_m_kernel()
        out, self.stream = kernel.rms_norm_linear(self.x, self.residual, self.norm_weight, self.eps, weight, bias,
                                                  num_sms=num_sms(self.x.device))  # fmt: skip
        return out


def norm_input(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
               consumer: nn.Module) -> tuple[torch.Tensor | PendingNorm, torch.Tensor | PendingNorm]:  # fmt: skip
    """``(h, stream)`` for a pre-norm sublayer ``consumer``: ``h = norm(x + residual)`` and the stream
    ``x + residual`` (``norm(x)`` and ``x`` without a residual), as ``norm(x, residual)`` returns them.

    Where ``consumer`` declares ``input_projection`` (a :class:`Linear` that is the first and only reader of
    its input), ``norm`` is the HF Llama RMSNorm (``norm_is_plain_rms``) and :func:`use_prologue` holds for
    that projection, both are one :class:`PendingNorm`: call the consumer with it, then read the stream
    with :func:`stream_of`."""
    proj = getattr(consumer, "input_projection", None)
    weight = getattr(norm, "weight", None)
    if (
        type(proj) is Linear
        and getattr(norm, "norm_is_plain_rms", False)
        and weight is not None
        and weight.dtype == x.dtype
        and weight.dim() == 1
        and weight.stride(0) == 1
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                  and residual.is_contiguous()))  # fmt: skip
        and use_prologue(x, proj.weight, proj.bias)
    ):
        pending = PendingNorm(x, residual, weight, norm.eps)
        return pending, pending
    if residual is None:
        return norm(x), x
    return norm(x, residual)


def stream_of(stream: torch.Tensor | PendingNorm) -> torch.Tensor:
    """The residual stream :func:`norm_input` returned, once its consumer has run."""
    if isinstance(stream, PendingNorm):
        if stream.stream is None:
            raise RuntimeError("the sublayer did not read its pending norm through its input projection")
        return stream.stream
    return stream


def silu_mul_linear(gate_up: torch.Tensor, proj: nn.Module) -> torch.Tensor | None:
    """``proj(F.silu(gate) * up)`` for ``gate_up = [gate | up]``, computed in one launch where ``proj`` is a
    :class:`Linear` and :func:`use_prologue` holds; None where it does not (the caller runs the two steps)."""
    if type(proj) is not Linear or gate_up.shape[-1] != 2 * proj.weight.shape[1]:
        return None
    if not use_prologue(gate_up, proj.weight, proj.bias):
        return None
    kernel, num_sms = _small_m_kernel()
    return kernel.silu_mul_linear(gate_up, proj.weight, proj.bias, num_sms=num_sms(gate_up.device))


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, names, initialisation and loading) whose forward is :func:`linear`;
    given a :class:`PendingNorm`, it computes the norm inside its product."""

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        if isinstance(x, PendingNorm):
            return x.project(self.weight, self.bias)
        return linear(x, self.weight, self.bias)

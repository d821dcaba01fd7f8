"""Which kernel multiplies the routed experts' rows: ``torch._grouped_mm`` or the Triton expert kernel
(kvforge/kernels/triton_expert_gemm.py), decided in one place.

:func:`use_triton_expert_gemm` is the rule and :func:`grouped_expert_matmul` applies it to one product of
rows grouped by expert (kvforge/models/expert_rows.py). The Triton kernel takes a product when

* the switch is on: :data:`TRITON_EXPERT_GEMM`, from ``KVFORGE_TRITON_EXPERT_GEMM`` in the environment
  (kvforge/env.py), else :data:`TRITON_EXPERT_GEMM_DEFAULT`; assigning the module attribute before a
  forward (and before CUDA-graph capture, which records whichever path ran) overrides both;
* the tensors are on a device type in :data:`TRITON_EXPERT_GEMM_DEVICES` (CUDA; tests add ``"cpu"`` to run
  the kernel in Triton's interpreter);
* input and weight are bfloat16 or float16 of one dtype, the weight ``[E, N, K]`` with K contiguous and
  the input contiguous along K;
* the step has at most :data:`TRITON_EXPERT_GEMM_MAX_ROWS_PER_EXPERT` routed rows (tokens x top-k) per
  routed expert of the weight on average: a decode step's few rows per expert, where reading the weights
  bounds the product. Folded shared experts (every token's rows, kvforge/models/shared_expert_fold.py) are
  left out of that average. Prefill steps keep ``torch._grouped_mm``.

:func:`gated_down_matmul` is the down product of a gated MLP's ``[gate | up]`` rows: where the kernel takes
it and the activation is SiLU, the kernel computes ``silu(gate) * up`` as it loads the rows
(:data:`FUSE_SILU_MUL`), else the activation runs first as its own launch.

The rule reads shapes and dtypes only, so a CUDA graph captured for a batch holds the kernel an eager step
of that batch runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.env import ENV
from kvforge.models import expert_kernel_rows
from kvforge.models.expert_rows import ExpertRows
from kvforge.models.layers import act_and_mul

#: Whether the kernel serves where the environment does not say. On an H200, over DeepSeek-V2-Lite's experts,
#: it beats ``torch._grouped_mm`` by 1.29-1.66x at 1-128 decode tokens (docs/BENCHMARKS.md, "Routed
#: experts").
TRITON_EXPERT_GEMM_DEFAULT = True
#: The process's switch (see the module docstring).
TRITON_EXPERT_GEMM: bool = (TRITON_EXPERT_GEMM_DEFAULT if ENV.triton_expert_gemm is None
                            else ENV.triton_expert_gemm)
TRITON_EXPERT_GEMM_DEVICES: tuple[str, ...] = ("cuda",)
#: The most routed rows per routed expert for the kernel (kvforge/models/expert_kernel_rows.py says why;
#: assigning this module attribute overrides it for the route).
TRITON_EXPERT_GEMM_MAX_ROWS_PER_EXPERT = expert_kernel_rows.TRITON_EXPERT_GEMM_MAX_ROWS_PER_EXPERT
#: Whether the kernel's down product computes SiLU-and-mul of its input rows itself (one launch fewer a MoE
#: layer; the same values as the separate kernel).
FUSE_SILU_MUL = True
_DTYPES = (torch.bfloat16, torch.float16)


def use_triton_expert_gemm(num_rows: int, a: torch.Tensor, weight: torch.Tensor, shared_experts: int = 0,
                           shared_rows: int = 0) -> bool:
    """Whether the product of ``num_rows`` rows of ``a`` by ``weight [E, N, K]`` runs the kernel;
    ``shared_rows`` of them belong to the last ``shared_experts`` experts (folded shared experts)."""
    return (
        TRITON_EXPERT_GEMM
        and a.device.type in TRITON_EXPERT_GEMM_DEVICES
        and a.dtype in _DTYPES
        and weight.dtype == a.dtype
        and weight.dim() == 3
        and num_rows > 0
        and expert_kernel_rows.kernel_takes_rows(num_rows - shared_rows, weight.shape[0] - shared_experts,
                                                 TRITON_EXPERT_GEMM_MAX_ROWS_PER_EXPERT)
        and weight.stride(2) == 1
        and a.stride(-1) == 1
        and not torch.is_grad_enabled()
    )


def _shared(rows: ExpertRows) -> dict:
    """The expert kernel's arguments for the folded shared experts of ``rows`` (each holds every token)."""
    s = rows.shared_experts
    return dict(shared_experts=s, shared_rows=rows.shared_rows // s if s else 0)


def grouped_expert_matmul(a: torch.Tensor, weight: torch.Tensor, rows: ExpertRows, gather: bool,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out[p] = a_row(p) @ weight[expert(p)].T (+ bias[expert(p)])`` for every sorted position ``p``
    (``[len(order), N]``): ``a_row(p) = a[rows.tokens[p]]`` with ``gather``, else ``a[p]`` (rows already in
    sorted order); ``bias`` ``[E, N]`` or None. Positions past ``rows.offs[-1]`` hold no defined values.
    The kernel adds the bias before its one rounding, ``torch._grouped_mm``'s path after rounding the
    product."""
    num_rows = rows.order.shape[0]
    if use_triton_expert_gemm(num_rows, a, weight, rows.shared_experts, rows.shared_rows) and (bias is None or bias.stride(-1) == 1):
        from kvforge.kernels.triton_expert_gemm import expert_gemm

        return expert_gemm(a, weight, rows.offs, rows.tokens if gather else None, num_rows=num_rows, bias=bias,
                           expert=rows.expert, **_shared(rows))
    out = torch._grouped_mm(a[rows.tokens] if gather else a, weight.transpose(-2, -1), offs=rows.offs)
    if bias is not None:  # rows held elsewhere (expert id E) take the last expert's bias; they are never read
        out = out + bias[rows.expert.clamp(max=weight.shape[0] - 1)]
    return out


def gated_down_matmul(gate_up: torch.Tensor, weight: torch.Tensor, rows: ExpertRows, act) -> torch.Tensor:
    """``grouped_expert_matmul(act(gate) * up, weight, rows, gather=False)`` for ``gate_up [len(order), 2I]``
    in sorted order and ``weight [E, N, I]``; SiLU inside the kernel where it takes the product."""
    if (FUSE_SILU_MUL and act is F.silu and gate_up.dim() == 2
            and use_triton_expert_gemm(rows.order.shape[0], gate_up, weight, rows.shared_experts, rows.shared_rows)):
        from kvforge.kernels.triton_expert_gemm import expert_gemm

        return expert_gemm(gate_up, weight, rows.offs, None, num_rows=rows.order.shape[0], silu_mul=True,
                           expert=rows.expert, **_shared(rows))
    return grouped_expert_matmul(act_and_mul(gate_up, act), weight, rows, gather=False)

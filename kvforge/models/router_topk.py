"""A softmax router's choice: softmax over every expert's logit, the top-k, optionally renormalised, times a
scale. The DeepSeek-V2 ``greedy`` gate and Qwen3-Next's router are this function.

:func:`router_softmax_topk` starts from the router's input and weight (float32 logits, DeepSeek's gate): for
1 to ``MAX_ROWS`` tokens on CUDA one Triton kernel computes the logits and the choice
(kvforge/kernels/triton_router_logits_topk.py, one launch where PyTorch takes a cast, a split product and
the top-k); elsewhere the logits are ``F.linear(x.float(), weight.float())`` and :func:`softmax_topk` chooses.

:func:`softmax_topk` is the one entry: on CUDA (with autograd off) it runs one Triton kernel
(kvforge/kernels/triton_router_topk.py) unless ``KVFORGE_DISABLE_FUSED_KERNELS`` turns the fused
kernels off (kvforge/env.py); elsewhere it runs :func:`softmax_topk_reference`, the PyTorch formulas the
kernel is tested against. Both return float32 weights in descending order and int64 expert ids; with
``shared = S`` each row carries ``S`` more slots, the ids ``E .. E + S - 1`` at weight 1 (shared experts
folded behind the routed ones, kvforge/models/shared_expert_fold.py; :func:`with_shared_slots`).
"""

from __future__ import annotations

import torch

from kvforge.env import ENV

#: Whether the kernel may serve (module attribute; assign before a forward and before CUDA-graph capture).
TRITON_ROUTER = not ENV.disable_fused_kernels
#: Device types it serves on (tests add "cpu" to run it in Triton's interpreter).
TRITON_ROUTER_DEVICES: tuple[str, ...] = ("cuda",)
#: Whether :func:`router_softmax_topk` may compute the logits inside the kernel (with ``TRITON_ROUTER``).
FUSED_ROUTER_LOGITS = True


def with_shared_slots(weights: torch.Tensor, ids: torch.Tensor, first: int,
                      shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weights``/``ids [T, k]`` with ``shared`` slots appended: ids ``first .. first + shared - 1``, weight 1."""
    if not shared:
        return weights, ids
    t = ids.shape[0]
    extra = torch.arange(first, first + shared, dtype=ids.dtype, device=ids.device).expand(t, shared)
    return torch.cat([weights, weights.new_ones(t, shared)], 1), torch.cat([ids, extra], 1)


def softmax_topk_reference(logits: torch.Tensor, k: int, renormalize: bool, scale: float = 1.0,
                           shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch: ``topk(softmax(logits in float32))``, divided by the chosen sum with ``renormalize``, times
    ``scale``; then ``shared`` slots (:func:`with_shared_slots`)."""
    weights, ids = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return with_shared_slots(weights * scale if scale != 1.0 else weights, ids, logits.shape[-1], shared)


def use_triton_router(logits: torch.Tensor) -> bool:
    """Whether :func:`softmax_topk` runs the kernel for these logits."""
    if not (TRITON_ROUTER and logits.device.type in TRITON_ROUTER_DEVICES and not torch.is_grad_enabled()):
        return False
    from kvforge.kernels import triton_router_topk

    return (triton_router_topk.HAS_TRITON and logits.dim() == 2 and logits.stride(-1) == 1
            and logits.shape[-1] <= triton_router_topk.MAX_EXPERTS)


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool, scale: float = 1.0,
                 shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32 [T, k + shared], ids int64 [T, k + shared])``: the router's top-``k`` and ``shared``
    slots of weight 1 (see the module docstring)."""
    if use_triton_router(logits):
        from kvforge.kernels.triton_router_topk import softmax_topk as kernel

        return kernel(logits, k, renormalize, scale, shared)
    return softmax_topk_reference(logits, k, renormalize, scale, shared)


def use_fused_router_logits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`router_softmax_topk` runs the logits-and-choice kernel for ``x [T, H]`` and ``weight
    [E, H]``: the router kernel's switches, 1 to ``MAX_ROWS`` tokens, at most ``MAX_EXPERTS`` experts, rows
    contiguous along the hidden size."""
    if not (FUSED_ROUTER_LOGITS and TRITON_ROUTER and x.device.type in TRITON_ROUTER_DEVICES
            and not torch.is_grad_enabled()):
        return False
    from kvforge.kernels import triton_router_logits_topk as fused

    return (fused.HAS_TRITON and x.dim() == 2 and weight.dim() == 2 and 0 < x.shape[0] <= fused.MAX_ROWS
            and weight.shape[0] <= fused.MAX_EXPERTS and x.stride(-1) == 1 and weight.stride(-1) == 1
            and weight.device == x.device)


def router_softmax_topk(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool, scale: float = 1.0,
                        shared: int = 0, counter: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`softmax_topk` of the float32 logits ``x @ weight.T`` (see the module docstring). ``counter``: the
    call site's int32 [1] zero on ``x``'s device, which the one-launch kernel needs (None: two steps)."""
    if counter is not None and use_fused_router_logits(x, weight):
        from kvforge.kernels.triton_router_logits_topk import router_logits_topk

        return router_logits_topk(x, weight, k, renormalize, scale, shared, counter)
    logits = torch.nn.functional.linear(x.float(), weight.float())
    return softmax_topk(logits, k, renormalize, scale, shared)

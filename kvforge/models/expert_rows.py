"""Routed (token, slot) rows grouped by expert for ``torch._grouped_mm``, and their weighted sum back per token.

A MoE layer routes each of ``T`` tokens to ``k`` experts: ``T * k`` rows, row ``r`` being token ``r // k``'s
slot ``r % k``. :func:`group_by_expert` orders the rows by expert (stably, so within an expert by row) and
gives the cumulative row counts ``torch._grouped_mm`` takes as ``offs``; rows whose expert is held elsewhere
carry the id ``num_experts`` and sort last, past ``offs[-1]``. :func:`weighted_sum_per_token` undoes the
order and sums each token's ``k`` outputs with their router weights.

Both run on the device with static shapes and no host synchronization, so a step using them can be
captured in a CUDA graph. The sort keys are int16 (expert ids are far below 32,767): a radix sort then
makes a quarter of the passes of int64 keys. The sum is one batched product per token (``[1, k] @ [k,
hidden]`` in float32) rather than an atomic ``index_add_`` in the model dtype: deterministic, one rounding
to the model dtype per output, and no atomics.

On CUDA the sum is one Triton kernel for any number of rows, and the grouping one or two for steps of at
most :data:`TRITON_ROWS_MAX` rows (decode steps and prompt steps of up to a few thousand tokens;
kvforge/kernels/triton_expert_rows.py), unless
``KVFORGE_DISABLE_FUSED_KERNELS`` turns the fused kernels off (kvforge/env.py). :func:`use_triton_sum` and
:func:`use_triton_rows` are the rules; rows grouped where the sum kernel serves carry ``inverse`` (from the
grouping kernel, or one scatter after PyTorch's sort), which sends their sum to that kernel. The PyTorch
code here is the reference both are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.env import ENV

#: Whether the Triton kernels may serve (module attribute; assign before a forward and before CUDA-graph
#: capture, which records whichever path ran).
TRITON_ROWS = not ENV.disable_fused_kernels
#: Device types they serve on (tests add "cpu" to run them in Triton's interpreter).
TRITON_ROWS_DEVICES: tuple[str, ...] = ("cuda",)
#: The most rows (tokens x top-k) a step may have for them (the counting sort's limit,
#: ``triton_expert_rows.COUNTING_MAX_ROWS``): larger prompt steps keep PyTorch's radix sort.
TRITON_ROWS_MAX = 16384


@dataclass(frozen=True)
class ExpertRows:
    """``order[p]``: the flat row at sorted position ``p``; ``offs`` int32 ``[num_experts]``: the end of each
    expert's range of sorted positions; ``expert[p]``: the expert id at position ``p`` (``num_experts`` for
    rows held elsewhere); ``tokens[p] = order[p] // k``, the token whose input row position ``p`` takes;
    ``inverse[r]``: the sorted position of flat row ``r`` (set where the Triton sum serves, None otherwise);
    ``shared_experts``: the last experts, which every token runs (folded shared experts), and
    ``shared_rows`` their rows."""

    order: torch.Tensor
    offs: torch.Tensor
    expert: torch.Tensor
    tokens: torch.Tensor
    inverse: torch.Tensor | None = None
    shared_experts: int = 0
    shared_rows: int = 0


def use_triton_sum(flat_ids: torch.Tensor) -> bool:
    """Whether :func:`weighted_sum_per_token` of rows grouped from these ids runs the Triton kernel (any
    number of rows; see the module docstring)."""
    if not (TRITON_ROWS and flat_ids.device.type in TRITON_ROWS_DEVICES
            and flat_ids.shape[0] > 0 and not torch.is_grad_enabled()):
        return False
    from kvforge.kernels import triton_expert_rows

    return triton_expert_rows.HAS_TRITON


def use_triton_rows(flat_ids: torch.Tensor, num_experts: int) -> bool:
    """Whether :func:`group_by_expert` runs the Triton kernel for these ids (see the module docstring)."""
    if not (flat_ids.shape[0] <= TRITON_ROWS_MAX and use_triton_sum(flat_ids)):
        return False
    from kvforge.kernels import triton_expert_rows

    return triton_expert_rows.sorts(flat_ids.shape[0], num_experts)


def group_by_expert(flat_ids: torch.Tensor, num_experts: int, top_k: int, shared_experts: int = 0) -> ExpertRows:
    """Group the ``T * top_k`` rows of ``flat_ids`` (int, ``num_experts`` for a row held elsewhere) by expert;
    ``shared_experts``: the last experts, in every token's ``top_k`` slots (folded shared experts)."""
    if num_experts >= torch.iinfo(torch.int16).max:
        raise ValueError(f"{num_experts} experts: expert ids must fit int16 keys")
    shared = dict(shared_experts=shared_experts, shared_rows=flat_ids.shape[0] // top_k * shared_experts)
    if use_triton_rows(flat_ids, num_experts):
        from kvforge.kernels.triton_expert_rows import group_rows

        order, offs, expert, tokens, inverse = group_rows(flat_ids, num_experts, top_k)
        return ExpertRows(order=order, offs=offs, expert=expert, tokens=tokens, inverse=inverse, **shared)
    order = torch.argsort(flat_ids.to(torch.int16), stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat_ids.device)
    counts.scatter_add_(0, flat_ids.long(), torch.ones_like(flat_ids, dtype=torch.int64))
    offs = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    inverse = None
    if use_triton_sum(flat_ids):
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
    return ExpertRows(order=order, offs=offs, expert=flat_ids[order], tokens=order // top_k, inverse=inverse,
                      **shared)


def weighted_sum_per_token(y: torch.Tensor, rows: ExpertRows, weights: torch.Tensor,
                           held: torch.Tensor | None = None, addend: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = addend[t] + sum_j weights[t, j] * y_row(t, j)``, summed in float32 and rounded once to
    ``y``'s dtype, ``y`` being the experts' outputs in sorted order (``[T * k, hidden]``), ``weights``
    ``[T, k]`` and ``addend`` ``[T, hidden]`` or None (nothing added; a MoE layer's shared experts).

    ``held`` (bool ``[T, k]``; None: every slot) marks the slots whose expert is held here: the others were
    not computed (their rows, past ``offs[-1]``, hold arbitrary values) and add nothing."""
    t, k = weights.shape
    if rows.inverse is not None and (addend is None or addend.stride(-1) == 1):
        from kvforge.kernels.triton_expert_rows import combine_rows

        return combine_rows(y, rows.inverse, weights, held, addend)
    per_token = torch.empty_like(y).index_copy_(0, rows.order, y)  # row (t, j) back at t * k + j
    w = weights.to(torch.float32)
    if held is not None:
        per_token.masked_fill_(~held.reshape(-1, 1), 0)
        w = torch.where(held, w, torch.zeros_like(w))
    out = torch.bmm(w.view(t, 1, k), per_token.view(t, k, -1).to(torch.float32)).view(t, -1)
    if addend is not None:
        out += addend.to(torch.float32)
    return out.to(y.dtype)

"""Whether a MoE model's shared experts join its routed experts' launches, decided in one place.

A DeepSeek-style MoE block adds ``S`` shared experts (one gated MLP of ``S x I`` intermediate rows) to
every token's top-k routed experts (gated MLPs of ``I`` rows, stacked ``[E, ...]``). Cut at its row
blocks, the shared MLP is ``S`` experts of the routed experts' shape, so after loading the engine may
append them to the stack (``[E + S, ...]``) and have the router add ``S`` slots of weight 1 to every
token (:meth:`kvforge.models.deepseek.MoE.fold_shared_experts`). A decode step then runs the shared
experts inside the routed experts' kernels (the grouping, the two expert products with SiLU-and-mul
inside the second, the weighted sum) instead of two cuBLAS products and an activation of their own.
The sum is the same up to rounding: each shared expert's output is rounded to the model dtype before the
float32 sum, as the routed experts' are, where the shared MLP rounded its whole output once.

:func:`fold_shared_experts` applies the rule to a loaded model: on CUDA (where the routed experts run
grouped, without host synchronization) when :data:`FOLD_SHARED_EXPERTS` is on. Tensor-parallel ranks keep
their slice of the shared experts apart (their blocks say no). CPU keeps the shared experts' own products.
"""

from __future__ import annotations

import torch
from torch import nn

#: The switch (module attribute; assign before the engine loads its weights).
FOLD_SHARED_EXPERTS = True
#: Device types whose models fold (tests add "cpu").
FOLD_DEVICES: tuple[str, ...] = ("cuda",)


def folds_shared_experts(device: torch.device | str) -> bool:
    """Whether a model loaded on ``device`` folds its shared experts."""
    return FOLD_SHARED_EXPERTS and torch.device(device).type in FOLD_DEVICES


def fold_shared_experts(model: nn.Module, device: torch.device | str) -> int:
    """Fold the shared experts of every MoE block of ``model`` (loaded on ``device``) where the rule says
    so; returns the number of blocks folded. Blocks fold one after another, so the transient peak is one
    block's old and new stacks (the target model folds before the KV pool is allocated; a draft model
    after it, inside the activation reserve).

    On CUDA each block's replaced stacks go back to the device before the next block allocates: left in
    the caching allocator, a block's old gate/up stack (``E`` experts) would hold the next block's new
    down stack (``E + S`` experts of half the bytes), and the unused half of every such segment stays
    reserved but unusable for the KV pool's one large allocation (on a 48B model, tens of GiB)."""
    if not folds_shared_experts(device):
        return 0
    on_cuda = torch.device(device).type == "cuda"
    folded = 0
    for m in list(model.modules()):
        if callable(getattr(m, "fold_shared_experts", None)) and m.fold_shared_experts():
            folded += 1
            if on_cuda:
                torch.cuda.empty_cache()
    return folded

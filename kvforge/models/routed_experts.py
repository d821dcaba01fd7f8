"""What a MoE layer's routed experts cost: the description cost models read (kvforge/bench/roofline.py).

Every module that holds routed experts (DeepSeek's and Kimi-Linear's ``MoE``, ``Qwen3NextMoE``,
``GptOssMLP``, and their tensor-parallel slices) answers ``routed_experts()`` with a
:class:`RoutedExperts`, so a cost model never needs to know a model's parameter names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only annotations: cost models import this without torch
    import torch


@dataclass(frozen=True)
class RoutedExperts:
    """``params``: this module's routed-expert tensors, each stacked over the experts it holds (dim 0, all
    of them at TP=1, ``num_experts / tp`` under tensor parallelism); a token runs ``top_k`` of the model's
    ``num_experts`` experts (counted over all ranks: the router's rows).

    Invariant: ``1 <= top_k <= num_experts``; every tensor has the same number of experts on dim 0.
    """

    params: tuple[torch.Tensor, ...]
    top_k: int
    num_experts: int

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} of {self.num_experts} experts: need 1 <= top_k <= num_experts")
        held = {p.shape[0] for p in self.params}
        if len(held) != 1:
            raise ValueError(f"routed-expert tensors disagree on the number of experts held: {sorted(held)}")

    @property
    def numel(self) -> int:
        """Parameters of the experts held here."""
        return sum(p.numel() for p in self.params)

    @property
    def nbytes(self) -> int:
        """Bytes of the experts held here."""
        return sum(p.numel() * p.element_size() for p in self.params)

    @property
    def fraction_per_token(self) -> float:
        """The share of the held experts one token runs in expectation under uniform routing."""
        return self.top_k / self.num_experts


def modules_with_routed_experts(model: torch.nn.Module) -> list[RoutedExperts]:
    """The :class:`RoutedExperts` of every module of ``model`` that holds routed experts, in module order."""
    return [m.routed_experts() for m in model.modules() if callable(getattr(type(m), "routed_experts", None))]

"""ProposerLayers: the layers a speculative proposer adds to the target's KV plan.

A draft model's layers, or extra layers the target's checkpoint carries for speculation (an MTP layer),
keep their KV in the target's pool: the resolver plans them by the target's rules (heads per rank, a
backend, the KV dtype, the block size they must accept) and places each in the target's group of the same
page layout, or in groups of their own with the pool's page size (kvforge/planner/resolver.py,
``_place_proposer``). Layer indices are the proposer's own (a draft model's 0 .. n - 1; an MTP layer may
use the index its checkpoint gives it); they name the proposer's layers in ``GroupPlan.draft_layers`` and
``DraftPlan.layers`` and must be distinct.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.errors import ConfigError
from kvforge.spec.layers import LayerSpec
from kvforge.spec.model_spec import ModelSpec


@dataclass(frozen=True)
class ProposerLayers:
    """``name``: shown in the plan and its errors; ``num_parameters``: the weights the proposer adds on top of
    the target's (0 when the target's parameter count already holds them)."""

    name: str
    architecture: str
    layers: tuple[LayerSpec, ...]
    num_parameters: int

    def __post_init__(self):
        indices = [layer.index for layer in self.layers]
        if not indices:
            raise ConfigError(f"the speculative proposer {self.name} has no layers to plan")
        if len(set(indices)) != len(indices):
            raise ConfigError(f"the speculative proposer {self.name} lists layer indices {indices}: each must be "
                              f"distinct")

    @classmethod
    def of_draft_model(cls, spec: ModelSpec) -> ProposerLayers:
        """Every layer of a draft model, with its weights."""
        return cls(spec.name, spec.architecture, tuple(spec.layers), spec.num_parameters)

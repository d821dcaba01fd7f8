"""ModelSpec: the model as the KV cache sees it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.spec.layers import LayerSpec, RingSpec


@dataclass(frozen=True)
class ModelSpec:
    """Layers, rings and sizes of one model; built without reading weights.

    ``hf_config`` is the (possibly synthesized) Hugging Face config dict the
    model code is built from; it is excluded from equality and hashing.
    ``num_parameters`` counts every weight (all experts of an MoE);
    ``model_dtype`` is the canonical dtype weights and activations run in.
    """

    architecture: str
    name: str
    layers: tuple[LayerSpec, ...]
    rings: tuple[RingSpec, ...]
    model_dtype: str
    hidden_size: int
    vocab_size: int
    num_parameters: int
    max_position_embeddings: int | None
    source: str
    #: (what, size) pairs a tensor-parallel size must divide beside the heads: MLP and expert sizes
    #: (kvforge/spec/tp_split_sizes.py).
    tp_split_sizes: tuple[tuple[str, int], ...] = ()
    hf_config: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kinds(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.kind] = counts.get(layer.kind, 0) + 1
        return counts

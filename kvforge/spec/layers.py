"""The layers of a model as the KV cache sees them.

Every layer is one of four kinds. Dimensions are the model's global values;
per-rank values are the planner's business (see kvforge.planner.resolver).

- ``full``: multi-head / grouped-query attention; K/V grow with context.
- ``sliding``: like full, but only the last ``sliding_window`` tokens are kept.
- ``mla``: multi-head latent attention; one latent row (kv_lora_rank + rope dim)
  per token, shared by all heads and replicated on every rank.
- ``state``: linear attention / SSM; a fixed number of bytes per sequence.

A ``RingSpec`` is an auxiliary per-request structure of ``rows`` x ``row_bytes``
that must fit inside one page of the layer it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LayerKind = Literal["full", "sliding", "mla", "state"]


@dataclass(frozen=True)
class AttentionLayerSpec:
    """A full or sliding-window attention layer (MHA/GQA/MQA).

    Invariants: num_heads and num_kv_heads >= 1, num_heads % num_kv_heads == 0,
    sliding_window is set iff kind == "sliding". ``sinks``: the layer adds one
    learned logit per query head to its softmax denominator (gpt-oss), so only
    a backend that declares sinks may serve it.
    """

    index: int
    kind: Literal["full", "sliding"]
    num_heads: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    sliding_window: int | None = None
    sinks: bool = False


@dataclass(frozen=True)
class MLALayerSpec:
    """A multi-head latent attention layer (DeepSeek-V2/V3 style)."""

    index: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    kind: Literal["mla"] = "mla"


@dataclass(frozen=True)
class StateLayerSpec:
    """A linear-attention / SSM layer with a constant-size per-sequence state.

    ``state_elements`` counts the elements of one sequence's state summed over
    all heads; ``tp_divisible_elements`` is the part split across TP ranks
    (usually all of it). The state is stored in ``state_dtype`` (the model dtype
    unless the config says otherwise) and is never quantized with the KV cache.
    ``split_heads`` names the head counts (config key, count) whose equal split
    over the ranks splits the state: the TP size must divide each of them.
    ``token_input_elements`` counts the elements of one token's inputs to the
    state update (the conv input, the delta rule's k, v, gate and beta), all
    split across ranks: a speculative verify step keeps them for its rows to
    replay the accepted ones (docs/LINEAR_ATTENTION.md, "Speculative decoding").
    ``value_heads``, ``key_dim`` and ``value_dim`` shape the delta rule's state (0 where unknown), and
    ``per_channel_gates`` says its gates decay each key channel (KDA) rather than each head.
    """

    index: int
    state_elements: int
    tp_divisible_elements: int
    state_dtype: str
    kind: Literal["state"] = "state"
    split_heads: tuple[tuple[str, int], ...] = ()
    token_input_elements: int = 0
    value_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    per_channel_gates: bool = False


LayerSpec = AttentionLayerSpec | MLALayerSpec | StateLayerSpec


@dataclass(frozen=True)
class RingSpec:
    """A per-request ring of ``rows`` (base rows; speculative tokens add one
    each) x ``row_bytes`` that must live inside one page of layer ``layer_index``."""

    layer_index: int
    base_rows: int
    row_bytes: int

    def rows(self, num_speculative_tokens: int) -> int:
        return self.base_rows + num_speculative_tokens

"""Qwen3-Next (Gated DeltaNet + gated attention + MoE) split over TP ranks.

Each rank builds the ordinary :class:`Qwen3NextForCausalLM` from a per-rank config (its heads, its
experts, its slices of the MLPs); :class:`~kvforge.distributed.tp_decoder.TensorParallelDecoder`
makes ``o_proj`` / ``out_proj`` / dense ``down_proj`` row-parallel and the vocabulary ends parallel.

* **Gated DeltaNet**: key heads and value heads split, rank r keeping key heads
  ``[r * Hk/tp, (r + 1) * Hk/tp)`` and the value heads they serve. ``in_proj_qkvz`` is laid out per
  key head (``[q | k | v | z]`` of that head and its ``Hv / Hk`` value heads), ``in_proj_ba`` per
  key head (``[b | a]``), so the rank's rows are one contiguous block of each (regrouped at load into
  the rank's stacked ``in_proj``, ``[q | k | v | z | b | a]`` of its heads; a TP=1 dummy ``in_proj`` is
  cut as the rank's share of each of those six blocks). The short conv's
  channels are ``[q of every key head | k | v of every value head]``: the rank keeps its share of
  each of the three blocks. ``dt_bias`` and ``A_log`` split by value head, the gated norm (one
  weight per value channel) replicated, ``out_proj`` row-parallel. The state slots hold the rank's
  heads: conv ``[W - 1, 2 * Hk/tp * K + Hv/tp * V]``, recurrent ``[Hv/tp, K, V]``.
* **Gated attention**: ``q_proj`` gives per head ``[q | gate]``, so the rank's query heads are one
  contiguous block of rows; KV heads split or replicated as for grouped-query families
  (kvforge/distributed/tp_gqa.py); q/k norms replicated; partial rope unchanged (per head).
* **MoE**: the router is replicated (every rank makes the same choice); rank r holds experts
  ``[r * E/tp, (r + 1) * E/tp)`` and the shared expert's column/row slice; its sigmoid gate is
  replicated, which scales the rank's partial sum as it scales the whole. Routed and shared partial
  sums are added and all-reduced once per layer. Dense MLPs are column/row-parallel.

TP must divide the attention heads, ``linear_num_key_heads`` and ``linear_num_value_heads`` (the plan
says so before any weight loads), ``num_experts``, ``intermediate_size`` and
``shared_expert_intermediate_size``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvforge.distributed.group import TPGroup
from kvforge.distributed.tp_decoder import (
    RankSlice,
    TensorParallelDecoder,
    check_heads_per_rank,
    check_tp_divides,
    even_slice,
    per_rank_config,
)
from kvforge.distributed.tp_deepseek import is_stacked_expert, rank_expert_tensors
from kvforge.distributed.tp_gqa import kv_head_start, kv_heads_for_rank
from kvforge.models.qwen3_next import Qwen3NextArgs, Qwen3NextForCausalLM, Qwen3NextMoE

_PER_VALUE_HEAD = (".linear_attn.dt_bias", ".linear_attn.A_log")


class TPQwen3NextMoE(Qwen3NextMoE):
    """This rank's experts and shared-expert slice under the full router; one all-reduce."""

    FOLDS_SHARED_EXPERTS = False  # the forward adds this rank's slice of the shared expert itself

    def __init__(self, rank_args: Qwen3NextArgs, full_args: Qwen3NextArgs, group: TPGroup, dtype=None):
        super().__init__(rank_args, dtype=dtype)
        self.gate = nn.Linear(full_args.hidden_size, full_args.num_experts, bias=False, dtype=dtype)
        self.group = group
        self.expert_start = group.rank * rank_args.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)  # global expert ids
        local = ids - self.expert_start
        mine = (local >= 0) & (local < self.experts_down.shape[0])
        shared = self.shared(x)
        out = self.routed(x, weights, torch.where(mine, local, torch.zeros_like(local)), mine, addend=shared)
        return self.group.all_reduce_(out)


class TPQwen3NextForCausalLM(TensorParallelDecoder, Qwen3NextForCausalLM):
    @classmethod
    def check_split(cls, config: dict, tp: int, heads_per_rank: int, kv_heads_per_rank: int) -> None:
        a = Qwen3NextArgs(config)
        check_heads_per_rank(a.num_heads, tp, heads_per_rank)
        kv_heads_for_rank(a.num_kv_heads, tp, kv_heads_per_rank)
        check_tp_divides(tp, a.linear_num_key_heads, "linear_num_key_heads")
        check_tp_divides(tp, a.linear_num_value_heads, "linear_num_value_heads")
        check_tp_divides(tp, a.intermediate_size, "intermediate_size")
        check_tp_divides(tp, a.num_experts, "num_experts")
        check_tp_divides(tp, a.shared_expert_intermediate_size, "shared_expert_intermediate_size")

    def __init__(self, config: dict, dtype: torch.dtype | None, group: TPGroup, heads_per_rank: int,
                 kv_heads_per_rank: int, with_mtp: bool = False):
        a = Qwen3NextArgs(config)
        tp = group.world_size
        self.check_split(config, tp, heads_per_rank, kv_heads_per_rank)
        sizes = dict(num_attention_heads=heads_per_rank, num_key_value_heads=kv_heads_per_rank, head_dim=a.head_dim,
                     linear_num_key_heads=a.linear_num_key_heads // tp,
                     linear_num_value_heads=a.linear_num_value_heads // tp,
                     intermediate_size=a.intermediate_size // tp, num_experts=a.num_experts // tp,
                     moe_intermediate_size=a.moe_intermediate_size,
                     shared_expert_intermediate_size=a.shared_expert_intermediate_size // tp)
        super().__init__(config, per_rank_config(config, a, group, **sizes), a, group, dtype, with_mtp)
        self.kv_start = kv_head_start(a.num_kv_heads, kv_heads_per_rank, group.rank, tp)
        for layer in (*self.model.layers, *self.mtp_decoder_layers()):
            if isinstance(layer.mlp, Qwen3NextMoE):
                layer.mlp = TPQwen3NextMoE(self.args, a, group, dtype=dtype)

    def mtp_decoder_layers(self) -> tuple:
        """The MTP block's decoder layer: gated attention of this rank's heads and MoE of its experts; its
        ``fc`` and norms are replicated, the embedding and head it reads are the model's (vocab-parallel)."""
        return (self.mtp.layers[0],) if self.mtp is not None else ()

    def rank_slices(self) -> dict[str, RankSlice]:
        a, g = self.full_args, self.group
        d = a.head_dim
        kv = RankSlice(self.kv_start * d, self.args.num_kv_heads * d, a.num_kv_heads * d)
        qkvz_rows = 2 * a.linear_num_key_heads * a.linear_key_head_dim + 2 * a.linear_num_value_heads * a.linear_value_head_dim
        mlp, shared = even_slice(a.intermediate_size, g), even_slice(a.shared_expert_intermediate_size, g)
        return {
            "self_attn.q_proj": even_slice(a.num_heads * 2 * d, g),  # [q | gate] per head
            "self_attn.k_proj": kv, "self_attn.v_proj": kv,
            "self_attn.o_proj": even_slice(a.num_heads * d, g),
            "linear_attn.in_proj_qkvz": even_slice(qkvz_rows, g),  # [q | k | v | z] per key head
            "linear_attn.in_proj_ba": even_slice(2 * a.linear_num_value_heads, g),  # [b | a] per key head
            "linear_attn.out_proj": even_slice(a.linear_num_value_heads * a.linear_value_head_dim, g),
            "mlp.gate_proj": mlp, "mlp.up_proj": mlp, "mlp.down_proj": mlp,
            "mlp.shared_expert.gate_proj": shared, "mlp.shared_expert.up_proj": shared,
            "mlp.shared_expert.down_proj": shared,
        }

    def _conv_blocks(self) -> list[int]:
        """Channels of the short conv's three blocks (q, k of every key head; v of every value head)."""
        a = self.full_args
        key_total = a.linear_num_key_heads * a.linear_key_head_dim
        return [key_total, key_total, a.linear_num_value_heads * a.linear_value_head_dim]

    def _input_blocks(self) -> list[int]:
        """Rows of the Gated DeltaNet's stacked input product at TP=1: q, k (every key head), v, z (every value
        head), b, a (one a value head)."""
        a = self.full_args
        key_total = a.linear_num_key_heads * a.linear_key_head_dim
        value_total = a.linear_num_value_heads * a.linear_value_head_dim
        return [key_total, key_total, value_total, value_total, a.linear_num_value_heads, a.linear_num_value_heads]

    def shard_parameter(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name.endswith(".linear_attn.in_proj.weight"):  # this rank's share of each of the six blocks
            blocks = full.split(self._input_blocks(), dim=0)
            return torch.cat([b.narrow(0, *_share(b.shape[0], self.group)) for b in blocks])
        return super().shard_parameter(name, full)

    def splits_first_dim(self, name: str) -> bool:
        return is_stacked_expert(name) or name.endswith(_PER_VALUE_HEAD)

    def shard_hf(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name.endswith(".linear_attn.conv1d.weight"):  # this rank's share of each of the q, k, v blocks
            blocks = full.split(self._conv_blocks(), dim=0)
            return torch.cat([b.narrow(0, *_share(b.shape[0], self.group)) for b in blocks])
        return super().shard_hf(name, full)

    def full_parameter_shape(self, name: str) -> tuple[int, ...]:
        if name.endswith(".linear_attn.conv1d.weight"):
            shape = list(dict(self.named_parameters())[name].shape)
            return (sum(self._conv_blocks()), *shape[1:])
        return super().full_parameter_shape(name)

    def rank_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Per-expert tensors of this rank's experts renumbered from 0, other ranks' skipped; the rest cut."""
        return rank_expert_tensors(weights, self.args.num_experts, self.group, self.shard_hf)


def _share(rows: int, group: TPGroup) -> tuple[int, int]:
    """(start, count) of this rank's equal share of ``rows``."""
    part = even_slice(rows, group)
    return part.start, part.count

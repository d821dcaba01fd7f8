"""Grouped-query attention split over TP ranks: what the Llama family, Gemma 3 and gpt-oss share.

Query heads are split (rank r holds heads ``[r * h/tp, (r + 1) * h/tp)``). KV heads are split when tp
divides them, otherwise (fewer KV heads than ranks) each rank holds one copy of KV head
``r * kv // tp``, the head its query heads attend to. The plan's ``heads_per_rank`` and
``kv_heads_per_rank`` are authoritative: the model is built from them and checks they agree. A family
with a dense gated MLP also splits its intermediate size (``split_intermediate``).
"""

from __future__ import annotations

import torch

from kvforge.distributed.group import TPGroup
from kvforge.distributed.tp_decoder import (
    RankSlice,
    TensorParallelDecoder,
    check_heads_per_rank,
    check_tp_divides,
    even_slice,
    per_rank_config,
)
from kvforge.errors import ConfigError
from kvforge.models.decoder import DecoderArgs


def kv_head_start(num_kv_heads: int, kv_per_rank: int, rank: int, tp: int) -> int:
    """First KV head held by ``rank``: a split slice, or the replicated head ``rank * kv // tp``."""
    if num_kv_heads % tp == 0:
        return rank * kv_per_rank
    return rank * num_kv_heads // tp


def kv_heads_for_rank(num_kv_heads: int, tp: int, kv_heads_per_rank: int) -> int:
    """KV heads each rank holds (split, or 1 replicated head when fewer than ranks), checked against the plan's."""
    if num_kv_heads % tp == 0:
        want = num_kv_heads // tp
    elif tp % num_kv_heads == 0:
        want = 1
    else:
        raise ConfigError(f"TP {tp} neither divides nor is a multiple of {num_kv_heads} KV heads")
    if kv_heads_per_rank != want:
        raise ConfigError(f"the plan gives {kv_heads_per_rank} KV heads per rank; TP {tp} over "
                          f"{num_kv_heads} KV heads needs {want}")
    return want


class GroupedQueryTP(TensorParallelDecoder):
    """Mixed in before a grouped-query family's model class: ``class TPFoo(GroupedQueryTP, FooForCausalLM)``.

    ``full``: the family's TP=1 args; ``split_intermediate``: the dense MLP's intermediate size is split too.
    """

    #: Whether the dense MLP's intermediate size is split too.
    SPLIT_INTERMEDIATE = True

    @classmethod
    def check_split(cls, config: dict, tp: int, heads_per_rank: int, kv_heads_per_rank: int) -> None:
        full = cls.ARGS(config)
        check_heads_per_rank(full.num_heads, tp, heads_per_rank)
        kv_heads_for_rank(full.num_kv_heads, tp, kv_heads_per_rank)
        if cls.SPLIT_INTERMEDIATE:
            check_tp_divides(tp, full.intermediate_size, "intermediate_size")

    def __init__(self, config: dict, dtype: torch.dtype | None, group: TPGroup, heads_per_rank: int,
                 kv_heads_per_rank: int, full: DecoderArgs):
        tp = group.world_size
        self.check_split(config, tp, heads_per_rank, kv_heads_per_rank)
        sizes = dict(num_attention_heads=heads_per_rank, num_key_value_heads=kv_heads_per_rank,
                     head_dim=full.head_dim)
        if self.SPLIT_INTERMEDIATE:
            sizes["intermediate_size"] = full.intermediate_size // tp
        super().__init__(config, per_rank_config(config, full, group, **sizes), full, group, dtype)
        self.kv_start = kv_head_start(full.num_kv_heads, kv_heads_per_rank, group.rank, tp)

    def attention_slices(self) -> dict[str, RankSlice]:
        """q/k/v/o: query heads split, KV heads split or replicated."""
        a, d = self.full_args, self.full_args.head_dim
        q = even_slice(a.num_heads * d, self.group)
        kv = RankSlice(self.kv_start * d, self.args.num_kv_heads * d, a.num_kv_heads * d)
        return {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "self_attn.o_proj": q}

    def gated_mlp_slices(self) -> dict[str, RankSlice]:
        """gate/up column-parallel, down row-parallel, over the split intermediate size."""
        mlp = even_slice(self.full_args.intermediate_size, self.group)
        return {"mlp.gate_proj": mlp, "mlp.up_proj": mlp, "mlp.down_proj": mlp}

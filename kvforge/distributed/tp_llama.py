"""The Llama family (Llama / Mistral / Qwen2 / Qwen3) split over TP ranks.

Each rank builds the ordinary :class:`LlamaForCausalLM` with its own sizes
(heads / tp query heads, the plan's KV heads per rank, intermediate / tp, a
vocabulary slice); :class:`~kvforge.distributed.tp_decoder.TensorParallelDecoder`
makes o_proj and down_proj row-parallel, the embedding vocab-parallel and the
LM head a vocabulary slice gathered on rank 0.

KV heads: split (rank r holds heads [r * kv/tp, (r + 1) * kv/tp)) when tp
divides them, otherwise (fewer KV heads than ranks) each rank holds one copy
of KV head ``r * kv // tp``, the head its query heads attend to. The plan's
``kv_heads_per_rank`` is authoritative; the model checks it agrees.

Checkpoints are full tensors with HF names, cut for this rank on loading.
Dummy weights draw the full TP=1 tensor with the TP=1 generator sequence and
keep this rank's part, so TP=1 and TP=N see the same model.
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
from kvforge.models.llama import LlamaArgs, LlamaForCausalLM

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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


class TPLlamaForCausalLM(TensorParallelDecoder, LlamaForCausalLM):
    def __init__(self, config: dict, dtype: torch.dtype | None, group: TPGroup, heads_per_rank: int,
                 kv_heads_per_rank: int):
        a = LlamaArgs(config)
        tp = group.world_size
        check_heads_per_rank(a.num_heads, tp, heads_per_rank)
        kv_heads_for_rank(a.num_kv_heads, tp, kv_heads_per_rank)
        check_tp_divides(tp, a.intermediate_size, "intermediate_size")
        local = per_rank_config(config, a, group, num_attention_heads=heads_per_rank,
                                num_key_value_heads=kv_heads_per_rank, head_dim=a.head_dim,
                                intermediate_size=a.intermediate_size // tp)
        super().__init__(config, local, a, group, dtype)
        self.kv_start = kv_head_start(a.num_kv_heads, kv_heads_per_rank, group.rank, tp)

    def rank_slices(self) -> dict[str, RankSlice]:
        a, la, d = self.full_args, self.args, self.full_args.head_dim
        q = even_slice(a.num_heads * d, self.group)
        kv = RankSlice(self.kv_start * d, la.num_kv_heads * d, a.num_kv_heads * d)
        mlp = even_slice(a.intermediate_size, self.group)
        return {
            "self_attn.q_proj": q,
            "self_attn.k_proj": kv,
            "self_attn.v_proj": kv,
            "self_attn.o_proj": q,
            "mlp.gate_proj": mlp,
            "mlp.up_proj": mlp,
            "mlp.down_proj": mlp,
        }

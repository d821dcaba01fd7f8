"""The Llama family (Llama / Mistral / Qwen2 / Qwen3) split over TP ranks.

Each rank builds the ordinary :class:`LlamaForCausalLM` with its own sizes
(heads / tp query heads, the plan's KV heads per rank, intermediate / tp, a
vocabulary slice); :class:`~kvforge.distributed.tp_decoder.TensorParallelDecoder`
makes o_proj and down_proj row-parallel, the embedding vocab-parallel and the
LM head a vocabulary slice gathered on rank 0.

Heads, KV heads and the MLP are split as for every grouped-query family
(kvforge/distributed/tp_gqa.py).

Checkpoints are full tensors with HF names, cut for this rank on loading.
Dummy weights draw the full TP=1 tensor with the TP=1 generator sequence and
keep this rank's part, so TP=1 and TP=N see the same model.
"""

from __future__ import annotations

import torch

from kvforge.distributed.group import TPGroup
from kvforge.distributed.tp_decoder import RankSlice
from kvforge.distributed.tp_gqa import GroupedQueryTP
from kvforge.models.llama import LlamaArgs, LlamaForCausalLM

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class TPLlamaForCausalLM(GroupedQueryTP, LlamaForCausalLM):
    def __init__(self, config: dict, dtype: torch.dtype | None, group: TPGroup, heads_per_rank: int,
                 kv_heads_per_rank: int):
        super().__init__(config, dtype, group, heads_per_rank, kv_heads_per_rank, LlamaArgs(config))

    def rank_slices(self) -> dict[str, RankSlice]:
        return {**self.attention_slices(), **self.gated_mlp_slices()}

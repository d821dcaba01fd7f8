"""Gemma 3 and gpt-oss split over TP ranks, as the Llama family is (kvforge/distributed/tp_llama.py).

:class:`~kvforge.distributed.tp_decoder.TensorParallelDecoder` makes
``o_proj`` (and Gemma's dense ``down_proj``) row-parallel, the embedding
vocab-parallel and the LM head a vocabulary slice gathered on rank 0. On top:

* Attention: query heads split (q rows; gpt-oss also its q bias and the sinks
  of this rank's heads); KV heads split when TP divides them, otherwise each
  rank holds one copy of KV head ``rank * kv // tp`` (the head its query heads
  attend to). Gemma's per-head q/k norms are replicated.
* Gemma 3: gate/up column-parallel; the ``sqrt(hidden)`` embedding scale is
  applied after the embedding's all-reduce and the final soft-capping to the
  gathered logits on rank 0.
* gpt-oss MoE: the router is replicated (every rank picks the same experts);
  rank r holds experts ``[r * E/tp, (r + 1) * E/tp)`` whole (weights and
  biases) and adds the weighted outputs of the tokens routed to them; the
  partial sums are all-reduced once per layer.

Checkpoint tensors are full and HF-named (a multimodal Gemma 3 checkpoint's
``language_model`` names are renamed first); dummy weights draw the TP=1
tensor and keep this rank's part.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvforge.distributed.group import TPGroup
from kvforge.distributed.tp_decoder import RankSlice, check_tp_divides
from kvforge.distributed.tp_gqa import GroupedQueryTP
from kvforge.models.gemma3 import Gemma3Args, Gemma3ForCausalLM, text_tensor_name
from kvforge.models.gpt_oss import GptOssArgs, GptOssExperts, GptOssForCausalLM


class TPGemma3ForCausalLM(GroupedQueryTP, Gemma3ForCausalLM):
    def __init__(self, config: dict, dtype: torch.dtype | None, group: TPGroup, heads_per_rank: int,
                 kv_heads_per_rank: int):
        super().__init__(config, dtype, group, heads_per_rank, kv_heads_per_rank, Gemma3Args(config))

    def rank_slices(self) -> dict[str, RankSlice]:
        return {**self.attention_slices(), **self.gated_mlp_slices()}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)  # the gathered logits (rank 0), soft-capped once there
        return None if logits is None else self.soft_cap(logits)

    def soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.args.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def rank_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return super().rank_checkpoint((text, t) for name, t in weights if (text := text_tensor_name(name)))


class TPGptOssExperts(GptOssExperts):
    """This rank's experts; the all-reduce of their weighted sum happens here, once per layer."""

    def __init__(self, a: GptOssArgs, group: TPGroup, dtype=None):
        n = a.num_experts // group.world_size
        super().__init__(a, num_local=n, first=group.rank * n, dtype=dtype)
        self.group = group

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce_(super().forward(x, weights, ids))


_PER_HEAD_OR_EXPERT = (".self_attn.sinks", ".mlp.experts.gate_up_proj", ".mlp.experts.gate_up_proj_bias",
                       ".mlp.experts.down_proj", ".mlp.experts.down_proj_bias")
"""gpt-oss tensors split along their first dimension in equal rank shares (query heads or experts)."""


class TPGptOssForCausalLM(GroupedQueryTP, GptOssForCausalLM):
    SPLIT_INTERMEDIATE = False  # experts only

    @classmethod
    def check_split(cls, config: dict, tp: int, heads_per_rank: int, kv_heads_per_rank: int) -> None:
        check_tp_divides(tp, GptOssArgs(config).num_experts, "num_local_experts")
        super().check_split(config, tp, heads_per_rank, kv_heads_per_rank)

    def __init__(self, config: dict, dtype: torch.dtype | None, group: TPGroup, heads_per_rank: int,
                 kv_heads_per_rank: int):
        a = GptOssArgs(config)
        # The rank's config keeps every expert, so the (replicated) router covers them all; the experts
        # module is replaced by this rank's share below.
        super().__init__(config, dtype, group, heads_per_rank, kv_heads_per_rank, a)
        for layer in self.model.layers:
            layer.mlp.experts = TPGptOssExperts(a, group, dtype=dtype)

    def rank_slices(self) -> dict[str, RankSlice]:
        return self.attention_slices()

    def splits_first_dim(self, name: str) -> bool:
        return name.endswith(_PER_HEAD_OR_EXPERT)

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
from kvforge.distributed.tp_decoder import (
    RankSlice,
    TensorParallelDecoder,
    check_heads_per_rank,
    check_tp_divides,
    even_slice,
    per_rank_config,
)
from kvforge.distributed.tp_llama import kv_head_start, kv_heads_for_rank
from kvforge.models.gemma3 import Gemma3Args, Gemma3ForCausalLM, text_tensor_name
from kvforge.models.gpt_oss import GptOssArgs, GptOssExperts, GptOssForCausalLM


def _attention_slices(model) -> dict[str, RankSlice]:
    """q/k/v/o of a grouped-query attention: query heads split, KV heads split or replicated."""
    a, d = model.full_args, model.full_args.head_dim
    q = even_slice(a.num_heads * d, model.group)
    kv = RankSlice(model.kv_start * d, model.num_kv_heads * d, a.num_kv_heads * d)
    return {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "self_attn.o_proj": q}


class TPGemma3ForCausalLM(TensorParallelDecoder, Gemma3ForCausalLM):
    def __init__(self, config: dict, dtype: torch.dtype | None, group: TPGroup, heads_per_rank: int,
                 kv_heads_per_rank: int):
        a = Gemma3Args(config)
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
        mlp = even_slice(self.full_args.intermediate_size, self.group)
        return {**_attention_slices(self), "mlp.gate_proj": mlp, "mlp.up_proj": mlp, "mlp.down_proj": mlp}

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


class TPGptOssForCausalLM(TensorParallelDecoder, GptOssForCausalLM):
    def __init__(self, config: dict, dtype: torch.dtype | None, group: TPGroup, heads_per_rank: int,
                 kv_heads_per_rank: int):
        a = GptOssArgs(config)
        tp = group.world_size
        check_heads_per_rank(a.num_heads, tp, heads_per_rank)
        kv_heads_for_rank(a.num_kv_heads, tp, kv_heads_per_rank)
        check_tp_divides(tp, a.num_experts, "num_local_experts")
        # The rank's config keeps every expert, so the (replicated) router covers them all; the experts
        # module is replaced by this rank's share below.
        local = per_rank_config(config, a, group, num_attention_heads=heads_per_rank,
                                num_key_value_heads=kv_heads_per_rank, head_dim=a.head_dim)
        super().__init__(config, local, a, group, dtype)
        self.kv_start = kv_head_start(a.num_kv_heads, kv_heads_per_rank, group.rank, tp)
        for layer in self.model.layers:
            layer.mlp.experts = TPGptOssExperts(a, group, dtype=dtype)

    def rank_slices(self) -> dict[str, RankSlice]:
        return _attention_slices(self)

    def shard_hf(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name.endswith(_PER_HEAD_OR_EXPERT):
            part = even_slice(full.shape[0], self.group)
            return full.narrow(0, part.start, part.count)
        return super().shard_hf(name, full)

    def full_parameter_shape(self, name: str) -> tuple[int, ...]:
        if name.endswith(_PER_HEAD_OR_EXPERT):
            shape = list(dict(self.named_parameters())[name].shape)
            shape[0] *= self.group.world_size
            return tuple(shape)
        return super().full_parameter_shape(name)

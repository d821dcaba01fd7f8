"""Kimi-Linear (KDA + MLA + DeepSeek-V3 MoE) split over TP ranks.

Each rank builds the ordinary :class:`KimiLinearForCausalLM` from a per-rank config (its KDA heads, its
MLA query heads, its experts and MLP slices); :class:`~kvforge.distributed.tp_decoder.TensorParallelDecoder`
makes every ``o_proj`` and the dense ``down_proj`` row-parallel and the vocabulary ends parallel.

* **KDA**: heads split, rank r keeping heads ``[r * H/tp, (r + 1) * H/tp)``: the rows of ``q_proj``,
  ``k_proj``, ``v_proj``, of their conv kernels (``q/k/v_conv1d``, one channel per row), of the gates'
  second projections ``f_b_proj`` / ``g_b_proj`` and of ``b_proj``; the per-channel ``dt_bias`` and the
  per-head ``A_log`` with them. The gates' low-rank first projections (``f_a_proj``, ``g_a_proj``) and
  ``o_norm`` (one weight per head channel) are replicated; ``o_proj`` is row-parallel. The state slots
  hold the rank's heads: conv ``[W - 1, 3 * H/tp * D]``, recurrent ``[H/tp, D, D]``.
* **MLA**: as DeepSeek's (kvforge/distributed/tp_deepseek.py): query heads split, the latent path and
  cache replicated.
* **MoE**: as DeepSeek-V3's: the router replicated, routed experts split by index, shared experts
  column/row-parallel, one all-reduce per layer. Dense MLPs column/row-parallel.

KDA and MLA layers share projection names (``self_attn.q_proj``, ``self_attn.o_proj``) with different
shapes, so the rank's slices are looked up per layer. TP must divide ``linear_num_heads`` (the plan says
so before any weight loads), the MLA heads, ``num_experts``, ``intermediate_size`` and the shared
experts' intermediate size.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from kvforge.distributed.group import TPGroup
from kvforge.distributed.tp_decoder import (
    RankSlice,
    TensorParallelDecoder,
    check_tp_divides,
    even_slice,
    per_rank_config,
)
from kvforge.distributed.tp_deepseek import (
    build_tp_moe,
    check_mla_moe_split,
    is_stacked_expert,
    mla_slices,
    rank_expert_tensors,
)
from kvforge.models.decoder import gate_up_parts
from kvforge.models.kimi_linear import KimiLinearArgs, KimiLinearForCausalLM, our_name
from kvforge.models.qwen3_next import LINEAR

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_A_LOG = ".self_attn.A_log"  # [1, 1, H, 1]: split along the head dimension (2)


class TPKimiLinearForCausalLM(TensorParallelDecoder, KimiLinearForCausalLM):
    @classmethod
    def check_split(cls, config: dict, tp: int, heads_per_rank: int, kv_heads_per_rank: int) -> None:
        a = KimiLinearArgs(config)
        check_mla_moe_split(a, tp, heads_per_rank, kv_heads_per_rank, "num_experts")
        check_tp_divides(tp, a.linear_num_heads, "linear_num_heads")

    def __init__(self, config: dict, dtype: torch.dtype | None, group: TPGroup, heads_per_rank: int,
                 kv_heads_per_rank: int):
        a = KimiLinearArgs(config)
        tp = group.world_size
        self.check_split(config, tp, heads_per_rank, kv_heads_per_rank)
        # The rank's MoE has E/tp experts and one expert group; its router is replaced by the full one below.
        sizes = dict(num_attention_heads=heads_per_rank, linear_num_heads=a.linear_num_heads // tp,
                     intermediate_size=a.intermediate_size // tp, num_experts=a.n_routed_experts // tp,
                     num_expert_group=1, topk_group=1, moe_intermediate_size=a.moe_intermediate_size)
        super().__init__(config, per_rank_config(config, a, group, **sizes), a, group, dtype)
        self.kv_start = 0
        for i, layer in enumerate(self.model.layers):
            if a.mlp_types[i] == "sparse":
                layer.mlp = build_tp_moe(self.args, a, group, dtype=dtype)

    def _shared_rows(self) -> int:
        a = self.full_args
        return a.moe_intermediate_size * a.n_shared_experts

    def fused_parameters(self) -> dict[str, list[tuple[str, int]]]:
        """As at TP=1 (the per-rank args give the KDA conv's and the dense MLPs' rows), with this rank's rows of
        the shared experts."""
        parts = super().fused_parameters()
        parts["mlp.shared_experts.gate_up_proj"] = gate_up_parts("mlp.shared_experts",
                                                                 self._shared_rows() // self.group.world_size)
        return parts

    def rank_slices_for(self, name: str) -> dict[str, RankSlice]:
        """The MLP slices, and the KDA or MLA slices of the layer ``name`` belongs to."""
        a, g = self.full_args, self.group
        mlp, shared = even_slice(a.intermediate_size, g), even_slice(self._shared_rows(), g)
        slices = {"mlp.gate_proj": mlp, "mlp.up_proj": mlp, "mlp.down_proj": mlp,
                  "mlp.shared_experts.gate_proj": shared, "mlp.shared_experts.up_proj": shared,
                  "mlp.shared_experts.down_proj": shared}
        m = _LAYER.search(name)
        if m is None:
            return slices
        if a.layer_types[int(m.group(1))] == LINEAR:
            width = even_slice(a.linear_num_heads * a.linear_head_dim, g)
            slices.update({f"self_attn.{p}": width for p in ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d",
                                                             "v_conv1d", "f_b_proj", "g_b_proj", "o_proj")})
            slices["self_attn.b_proj"] = even_slice(a.linear_num_heads, g)
        else:
            slices.update(mla_slices(a, g))
        return slices

    def splits_first_dim(self, name: str) -> bool:
        return is_stacked_expert(name) or name.endswith(".self_attn.dt_bias")

    def shard_hf(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name.endswith(_A_LOG):
            part = even_slice(full.shape[2], self.group)
            return full.narrow(2, part.start, part.count)
        return super().shard_hf(name, full)

    def full_parameter_shape(self, name: str) -> tuple[int, ...]:
        if name.endswith(_A_LOG):
            shape = list(dict(self.named_parameters())[name].shape)
            shape[2] *= self.group.world_size
            return tuple(shape)
        return super().full_parameter_shape(name)

    def rank_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names mapped to ours; this rank's experts renumbered from 0, other ranks' skipped; the rest
        cut."""
        return rank_expert_tensors(((our_name(n), t) for n, t in weights), self.args.n_routed_experts, self.group,
                                   self.shard_hf)

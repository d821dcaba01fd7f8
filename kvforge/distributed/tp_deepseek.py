"""DeepSeek-V2 / V3 (MLA + DeepSeekMoE) split over TP ranks.

* MLA: query heads are split. ``q_proj`` (or ``q_b_proj`` with q_lora) and
  ``kv_b_proj`` keep this rank's heads' rows (column-parallel, no
  communication); ``o_proj`` is row-parallel (all-reduce, bias added once).
  The latent path (``q_a_proj``, ``q_a_layernorm``, ``kv_a_proj_with_mqa``,
  ``kv_a_layernorm``) is replicated, so every rank computes and caches the same
  ``[latent | k_rope]`` rows: the latent cache is replicated (the plan's one
  "KV head" per rank and the same bytes per token as TP=1).
* Dense MLPs: gate/up column-parallel, down row-parallel.
* MoE: the float32 router is replicated (every rank makes the same choice);
  rank r holds routed experts ``[r * E/tp, (r + 1) * E/tp)`` and computes
  their weighted outputs for every token routed to them. Shared experts are
  split column/row-parallel (intermediate ``n_shared * moe_intermediate / tp``).
  The routed and shared partial sums are added and all-reduced once per layer.
* Embedding vocab-parallel, LM head vocabulary slices gathered on rank 0 (as
  for the Llama family, kvforge/distributed/tp_llama.py).

Checkpoint tensors are full and HF-named; each is cut for this rank on loading
and per-expert tensors of other ranks are skipped. Dummy weights draw the TP=1
tensors with the TP=1 generator sequence and keep this rank's part.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kvforge.distributed.group import TPGroup
from kvforge.distributed.layers import VocabParallelEmbedding, gather_vocab_logits
from kvforge.distributed.tp_decoder import (
    RankSlice,
    TensorParallelDecoder,
    check_heads_per_rank,
    check_tp_divides,
    even_slice,
    per_rank_config,
)
from kvforge.errors import ConfigError
from kvforge.models.decoder import gate_up_parts
from kvforge.models.deepseek import DeepseekArgs, DeepseekV2ForCausalLM, MoE
from kvforge.models.layers import GatedMLP
from kvforge.models.linear_route import linear
from kvforge.models.stacked_experts import FUSED_EXPERTS_NAME, PER_EXPERT_NAME

DEEPSEEK_FAMILY = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
#: The MTP block's own vocabulary tensors (HF ``model.layers.{n}.*``, ours ``mtp_layers.{n}.*``).
_MTP_VOCAB_PARAMETERS = (".embed_tokens.weight", ".shared_head.head.weight")


class TPMoE(MoE):
    """This rank's routed experts plus its slice of the shared experts; one all-reduce."""

    FOLDS_SHARED_EXPERTS = False  # the forward adds this rank's slice of the shared experts itself

    def __init__(self, a: DeepseekArgs, group: TPGroup, dtype=None):
        super().__init__(a, dtype=dtype)  # `a` is the rank's args: E/tp experts, shared intermediate / tp
        self.group = group
        self.expert_start = group.rank * self.experts_down.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the shared experts' down_proj is a plain Linear: its partial sum is reduced below with the routed one
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        weights, ids = self.gate(x)  # replicated router: global expert ids
        local = ids - self.expert_start
        mine = (local >= 0) & (local < self.experts_down.shape[0])
        out = self.routed(x, weights, torch.where(mine, local, torch.zeros_like(local)), mine, addend=shared)
        return self.group.all_reduce_(out)


def check_mla_moe_split(a, tp: int, heads_per_rank: int, kv_heads_per_rank: int, experts_key: str) -> None:
    """What an MLA + MoE model (DeepSeek's args ``a``: ``num_heads``, ``intermediate_size``,
    ``n_routed_experts``, ``moe_intermediate_size``, ``n_shared_experts``) needs to split over ``tp`` ranks:
    the plan's heads per rank, one replicated latent "KV head", and dense, routed and shared MLP sizes that
    divide by ``tp`` (``experts_key``: the config key of the routed expert count, named in the error)."""
    check_heads_per_rank(a.num_heads, tp, heads_per_rank)
    if kv_heads_per_rank != 1:
        raise ConfigError(f"the plan gives {kv_heads_per_rank} KV heads per rank; the MLA latent cache is "
                          f"replicated (1 per rank)")
    check_tp_divides(tp, a.intermediate_size, "intermediate_size")
    check_tp_divides(tp, a.n_routed_experts, experts_key)
    if a.n_routed_experts:
        check_tp_divides(tp, a.moe_intermediate_size * a.n_shared_experts, "the shared experts' intermediate size")


def build_tp_moe(rank_args, full_args, group: TPGroup, dtype=None) -> TPMoE:
    """This rank's MoE block: its routed experts (``rank_args``), the full router and its rows of the shared
    experts (``full_args``: every expert, the full group structure)."""
    moe = TPMoE(rank_args, group, dtype=dtype)
    moe.gate = type(moe.gate)(full_args)
    if full_args.n_shared_experts:
        rows = full_args.moe_intermediate_size * full_args.n_shared_experts // group.world_size
        moe.shared_experts = GatedMLP(full_args.hidden_size, rows, full_args.hidden_act, dtype=dtype)
    return moe


def mla_slices(a, group: TPGroup) -> dict[str, RankSlice]:
    """MLA query heads split: q (or q_b) and kv_b rows of this rank's heads, o_proj's columns; the latent path
    whole on every rank (named too, since a fused parameter cuts each of its parts by its slice)."""
    q = even_slice(a.num_heads * a.qk_head_dim, group)
    kv_a = a.kv_lora_rank + a.qk_rope_head_dim
    slices = {"self_attn.q_proj": q, "self_attn.q_b_proj": q,
              "self_attn.kv_b_proj": even_slice(a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), group),
              "self_attn.o_proj": even_slice(a.num_heads * a.v_head_dim, group),
              "self_attn.kv_a_proj_with_mqa": RankSlice(0, kv_a, kv_a)}
    if a.q_lora_rank is not None:
        slices["self_attn.q_a_proj"] = RankSlice(0, a.q_lora_rank, a.q_lora_rank)
    return slices


def is_stacked_expert(name: str) -> bool:
    """Stacked routed experts, ours or fused over experts in the checkpoint (split by expert index)."""
    return bool(FUSED_EXPERTS_NAME.match(name)) or name.endswith((".experts_gate_up", ".experts_down"))


def rank_expert_tensors(weights: Iterable[tuple[str, torch.Tensor]], n_local: int, group: TPGroup, shard
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert tensors of this rank's experts ``[rank * n_local, (rank + 1) * n_local)`` renumbered from 0,
    other ranks' skipped; every other tensor cut by ``shard(name, tensor)``."""
    lo = group.rank * n_local
    for name, t in weights:
        m = PER_EXPERT_NAME.match(name)
        if m:
            e = int(m.group(2))
            if lo <= e < lo + n_local:
                yield f"{m.group(1)}.experts.{e - lo}.{m.group(3)}.weight", t
            continue  # another rank's expert
        yield name, shard(name, t)


class TPDeepseekForCausalLM(TensorParallelDecoder, DeepseekV2ForCausalLM):
    @classmethod
    def check_split(cls, config: dict, tp: int, heads_per_rank: int, kv_heads_per_rank: int) -> None:
        check_mla_moe_split(DeepseekArgs(config), tp, heads_per_rank, kv_heads_per_rank, "n_routed_experts")

    def __init__(self, config: dict, dtype: torch.dtype | None, group: TPGroup, heads_per_rank: int,
                 kv_heads_per_rank: int, with_mtp: bool = False):
        a = DeepseekArgs(config)
        tp = group.world_size
        self.check_split(config, tp, heads_per_rank, kv_heads_per_rank)
        sizes = dict(num_attention_heads=heads_per_rank, intermediate_size=a.intermediate_size // tp)
        if a.n_routed_experts:
            # shared experts: one GatedMLP of n_shared * moe_intermediate, replaced below by its slice
            sizes.update(n_routed_experts=a.n_routed_experts // tp,
                         moe_intermediate_size=a.moe_intermediate_size, n_shared_experts=a.n_shared_experts)
            if a.v3 or a.topk_method == "group_limited_greedy":
                sizes.update(n_group=1, topk_group=1)  # the local args' router is replaced below
        super().__init__(config, per_rank_config(config, a, group, **sizes), a, group, dtype, with_mtp)
        self.kv_start = 0
        for i, layer in enumerate((*self.model.layers, *self.mtp_decoder_layers())):
            if a.is_moe(i):  # the MTP block: index num_hidden_layers, MoE or dense by the same rule
                layer.mlp = build_tp_moe(self.args, a, group, dtype=dtype)
        for mtp in self.mtp_decoder_layers():  # its own embedding and head, vocab-parallel as the model's
            mtp.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, group, dtype=dtype)

    def mtp_decoder_layers(self) -> tuple:
        """The MTP block (a decoder layer of this rank's heads and experts with its own embedding and head,
        both vocab-parallel; ``eh_proj`` and the norms replicated)."""
        return tuple(self.mtp_layers.values()) if self.mtp_layers is not None else ()

    def is_vocab_parameter(self, name: str) -> bool:
        return super().is_vocab_parameter(name) or name.endswith(_MTP_VOCAB_PARAMETERS)

    def mtp_logits(self, out: torch.Tensor) -> torch.Tensor | None:
        """Float32 [T, vocab] on rank 0 from this rank's vocabulary rows of the MTP head, None elsewhere."""
        head = self.mtp_layers[str(self.num_layers)].shared_head
        return gather_vocab_logits(linear(out, head.head.weight).float(), self.vocab_size, self.group)

    def _shared_rows(self) -> int:
        a = self.full_args
        return a.moe_intermediate_size * a.n_shared_experts

    def fused_parameters(self) -> dict[str, list[tuple[str, int]]]:
        """As at TP=1 (the per-rank args give the dense MLPs' rows), with this rank's rows of the shared experts."""
        parts = super().fused_parameters()
        parts["mlp.shared_experts.gate_up_proj"] = gate_up_parts("mlp.shared_experts",
                                                                 self._shared_rows() // self.group.world_size)
        return parts

    def rank_slices(self) -> dict[str, RankSlice]:
        a, g = self.full_args, self.group
        shared = even_slice(self._shared_rows(), g)
        mlp = even_slice(a.intermediate_size, g)
        return {
            **mla_slices(a, g),
            "mlp.shared_experts.gate_proj": shared,
            "mlp.shared_experts.up_proj": shared,
            "mlp.shared_experts.down_proj": shared,
            "mlp.gate_proj": mlp,
            "mlp.up_proj": mlp,
            "mlp.down_proj": mlp,
        }

    # -- routed experts: this rank's experts [rank * E/tp, (rank + 1) * E/tp) --------------
    def splits_first_dim(self, name: str) -> bool:
        """Stacked experts, ours or fused in the checkpoint (per-expert tensors: see :meth:`rank_checkpoint`)."""
        return is_stacked_expert(name)

    def rank_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Per-expert tensors of this rank's experts renumbered from 0, other ranks' skipped; the rest cut."""
        return rank_expert_tensors(weights, self.args.n_routed_experts, self.group, self.shard_hf)

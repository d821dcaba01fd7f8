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

Checkpoint tensors are full and HF-named; :meth:`shard_hf` cuts each one and
per-expert tensors of other ranks are skipped. Dummy weights draw the TP=1
tensors with the TP=1 generator sequence and keep this rank's part.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from kvforge.distributed.group import TPGroup
from kvforge.distributed.layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_vocab_logits,
    shard_vocab_rows,
    vocab_range,
)
from kvforge.errors import ConfigError
from kvforge.models.deepseek import _EXPERT, _FUSED, DeepseekArgs, DeepseekV2ForCausalLM, MoE
from kvforge.models.layers import GatedMLP

DEEPSEEK_FAMILY = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


class TPMoE(MoE):
    """This rank's routed experts plus its slice of the shared experts; one all-reduce."""

    def __init__(self, a: DeepseekArgs, group: TPGroup, dtype=None):
        super().__init__(a, dtype=dtype)  # `a` is the rank's args: E/tp experts, shared intermediate / tp
        self.group = group
        self.expert_start = group.rank * self.experts_down.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # replicated router: global expert ids
        local = ids - self.expert_start
        mine = (local >= 0) & (local < self.experts_down.shape[0])
        out = self.routed(x, weights, torch.where(mine, local, torch.zeros_like(local)), mine)
        if self.shared_experts is not None:  # down_proj is a plain Linear: partial sum reduced below
            out = out + self.shared_experts(x)
        return self.group.all_reduce_(out)


class TPDeepseekForCausalLM(DeepseekV2ForCausalLM):
    def __init__(self, config: dict, dtype: torch.dtype | None, group: TPGroup, heads_per_rank: int,
                 kv_heads_per_rank: int):
        a = DeepseekArgs(config)
        tp, r = group.world_size, group.rank
        if a.num_heads % tp or heads_per_rank != a.num_heads // tp:
            raise ConfigError(f"TP {tp}: {a.num_heads} attention heads give {a.num_heads / tp:g} per rank, "
                              f"the plan says {heads_per_rank}")
        if kv_heads_per_rank != 1:
            raise ConfigError(f"the plan gives {kv_heads_per_rank} KV heads per rank; the MLA latent cache is "
                              f"replicated (1 per rank)")
        if a.intermediate_size % tp:
            raise ConfigError(f"--tensor-parallel-size {tp} does not divide intermediate_size {a.intermediate_size}")
        if a.n_routed_experts % tp:
            raise ConfigError(f"--tensor-parallel-size {tp} does not divide n_routed_experts {a.n_routed_experts}")
        shared = a.moe_intermediate_size * a.n_shared_experts
        if a.n_routed_experts and shared % tp:
            raise ConfigError(f"--tensor-parallel-size {tp} does not divide the shared experts' intermediate "
                              f"size {shared}")
        _, _, vocab_rows = vocab_range(a.vocab_size, r, tp)
        local = dict(config)
        local.update(num_attention_heads=heads_per_rank, intermediate_size=a.intermediate_size // tp,
                     vocab_size=vocab_rows)
        if a.n_routed_experts:
            # shared experts: one GatedMLP of n_shared * moe_intermediate; keep 1 "expert" of shared / tp
            local.update(n_routed_experts=a.n_routed_experts // tp,
                         moe_intermediate_size=a.moe_intermediate_size, n_shared_experts=a.n_shared_experts)
            if a.v3 or a.topk_method == "group_limited_greedy":
                local.update(n_group=1, topk_group=1)  # the local args' router is replaced below
        super().__init__(local, dtype=dtype)
        self.config = dict(config)
        self.full_args = a
        self.group = group
        self.vocab_size = a.vocab_size
        self.kv_start = 0
        la = self.args
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            attn.o_proj = RowParallelLinear(la.num_heads * la.v_head_dim, a.hidden_size, a.attention_bias, group,
                                            dtype=dtype)
            if a.is_moe(i):
                moe = TPMoE(la, group, dtype=dtype)
                moe.gate = type(moe.gate)(a)  # the full router (all experts, full group structure)
                if a.n_shared_experts:
                    moe.shared_experts = GatedMLP(a.hidden_size, shared // tp, a.hidden_act, dtype=dtype)
                layer.mlp = moe
            else:
                layer.mlp.down_proj = RowParallelLinear(la.intermediate_size, a.hidden_size, False, group,
                                                        dtype=dtype)
        self.model.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, group, dtype=dtype)

    # -- logits -----------------------------------------------------------------
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 [T, vocab] on rank 0, None on the other ranks (every rank must call it)."""
        if hidden.shape[0] == 0:
            return hidden.new_zeros((0, self.vocab_size), dtype=torch.float32) if self.group.rank == 0 else None
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return gather_vocab_logits(F.linear(hidden, w).float(), self.vocab_size, self.group)

    # -- sharding ---------------------------------------------------------------
    def _sizes(self) -> dict[str, int]:
        """HF projection -> rows (or, for o/down, input columns) per rank."""
        a, tp = self.full_args, self.group.world_size
        hl = a.num_heads // tp
        return {
            "self_attn.q_proj": hl * a.qk_head_dim,
            "self_attn.q_b_proj": hl * a.qk_head_dim,
            "self_attn.kv_b_proj": hl * (a.qk_nope_head_dim + a.v_head_dim),
            "self_attn.o_proj": hl * a.v_head_dim,
            "mlp.shared_experts.gate_proj": a.moe_intermediate_size * a.n_shared_experts // tp,
            "mlp.shared_experts.up_proj": a.moe_intermediate_size * a.n_shared_experts // tp,
            "mlp.shared_experts.down_proj": a.moe_intermediate_size * a.n_shared_experts // tp,
            "mlp.gate_proj": a.intermediate_size // tp,
            "mlp.up_proj": a.intermediate_size // tp,
            "mlp.down_proj": a.intermediate_size // tp,
        }

    def shard_hf(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of an HF-named full tensor (routed experts: see :meth:`load_weights`)."""
        r = self.group.rank
        if name in _VOCAB:
            return shard_vocab_rows(full, r, self.group.world_size)
        if _FUSED.match(name) or name.endswith((".experts_gate_up", ".experts_down")):
            n = full.shape[0] // self.group.world_size
            return full.narrow(0, r * n, n)
        for proj, n in self._sizes().items():
            if f".{proj}." in name:
                if proj.endswith(("o_proj", "down_proj")):
                    return full if name.endswith(".bias") else full.narrow(1, r * n, n)
                return full.narrow(0, r * n, n)
        return full

    def _fused_halves(self, name: str) -> tuple[str, str] | None:
        for hf in ("mlp.shared_experts", "mlp"):
            if f".{hf}.gate_up_proj." in name:
                return hf, "gate_up_proj"
        return None

    def full_parameter_shape(self, name: str) -> tuple[int, ...]:
        """Shape of our parameter ``name`` in the TP=1 model."""
        a, tp = self.full_args, self.group.world_size
        p = dict(self.named_parameters())[name]
        shape = list(p.shape)
        if name in _VOCAB:
            shape[0] = a.vocab_size
        elif name.endswith((".experts_gate_up", ".experts_down")):
            shape[0] *= tp
        elif self._fused_halves(name) or any(f".{proj}." in name for proj in
                                              ("self_attn.q_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj")):
            shape[0] *= tp
        elif name.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
            shape[1] *= tp
        return tuple(shape)

    def shard_parameter(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of our (possibly fused) parameter ``name`` given its TP=1 value."""
        fused = self._fused_halves(name)
        if fused:
            hf, ours = fused
            gate, up = full.chunk(2, dim=0)
            return torch.cat([self.shard_hf(name.replace(f".{hf}.{ours}.", f".{hf}.{w}."), t)
                              for w, t in (("gate_proj", gate), ("up_proj", up))])
        return self.shard_hf(name, full)

    def _local_stream(self, weights: Iterable[tuple[str, torch.Tensor]]):
        n_local = self.args.n_routed_experts
        lo = self.group.rank * n_local
        for name, t in weights:
            m = _EXPERT.match(name)
            if m:
                e = int(m.group(2))
                if lo <= e < lo + n_local:
                    yield f"{m.group(1)}.experts.{e - lo}.{m.group(3)}.weight", t
                continue  # another rank's expert
            yield name, self.shard_hf(name, t)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._local_stream(weights))


def build_tp_deepseek(config: dict, dtype, device, group: TPGroup, hpr: int, kvpr: int) -> TPDeepseekForCausalLM:
    with torch.device("meta"):
        model = TPDeepseekForCausalLM(config, dtype, group, hpr, kvpr)
    model = model.to_empty(device=torch.device(device))
    model.reset_buffers()
    return model.eval()


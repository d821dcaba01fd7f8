"""The Llama family (Llama / Mistral / Qwen2 / Qwen3) split over TP ranks.

Each rank builds the ordinary :class:`LlamaForCausalLM` with its own sizes
(heads / tp query heads, the plan's KV heads per rank, intermediate / tp, a
vocabulary slice) and swaps in the parallel pieces: o_proj and down_proj are
row-parallel (all-reduce), the embedding is vocab-parallel, the LM head
computes this rank's vocabulary slice and rank 0 gathers the logits.

KV heads: split (rank r holds heads [r * kv/tp, (r + 1) * kv/tp)) when tp
divides them, otherwise (fewer KV heads than ranks) each rank holds one copy
of KV head ``r * kv // tp``, the head its query heads attend to. The plan's
``kv_heads_per_rank`` is authoritative; the model checks it agrees.

Checkpoints are full tensors with HF names; :meth:`shard_hf` cuts each for
this rank. Dummy weights draw the full TP=1 tensor with the TP=1 generator
sequence and keep this rank's part, so TP=1 and TP=N see the same model.
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
from kvforge.models.llama import LlamaArgs, LlamaForCausalLM

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def kv_head_start(num_kv_heads: int, kv_per_rank: int, rank: int, tp: int) -> int:
    """First KV head held by ``rank``: a split slice, or the replicated head ``rank * kv // tp``."""
    if num_kv_heads % tp == 0:
        return rank * kv_per_rank
    return rank * num_kv_heads // tp


class TPLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config: dict, dtype: torch.dtype | None, group: TPGroup, heads_per_rank: int,
                 kv_heads_per_rank: int):
        a = LlamaArgs(config)
        tp, r = group.world_size, group.rank
        if a.num_heads % tp or heads_per_rank != a.num_heads // tp:
            raise ConfigError(f"TP {tp}: {a.num_heads} attention heads give {a.num_heads / tp:g} per rank, "
                              f"the plan says {heads_per_rank}")
        if a.num_kv_heads % tp == 0:
            want_kv = a.num_kv_heads // tp
        elif tp % a.num_kv_heads == 0:
            want_kv = 1
        else:
            raise ConfigError(f"TP {tp} neither divides nor is a multiple of {a.num_kv_heads} KV heads")
        if kv_heads_per_rank != want_kv:
            raise ConfigError(f"the plan gives {kv_heads_per_rank} KV heads per rank; TP {tp} over "
                              f"{a.num_kv_heads} KV heads needs {want_kv}")
        if a.intermediate_size % tp:
            raise ConfigError(f"--tensor-parallel-size {tp} does not divide intermediate_size {a.intermediate_size}")
        _, _, vocab_rows = vocab_range(a.vocab_size, r, tp)
        local = dict(config)
        local.update(num_attention_heads=heads_per_rank, num_key_value_heads=kv_heads_per_rank,
                     head_dim=a.head_dim, intermediate_size=a.intermediate_size // tp, vocab_size=vocab_rows)
        super().__init__(local, dtype=dtype)
        self.config = dict(config)  # full config: GGUF Q/K unpermutation reads the full head counts
        self.full_args = a
        self.group = group
        self.vocab_size = a.vocab_size
        self.kv_start = kv_head_start(a.num_kv_heads, kv_heads_per_rank, r, tp)
        la = self.args
        for layer in self.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(la.num_heads * la.head_dim, a.hidden_size, la.o_bias,
                                                       group, dtype=dtype)
            layer.mlp.down_proj = RowParallelLinear(la.intermediate_size, a.hidden_size, la.mlp_bias, group,
                                                    dtype=dtype)
        self.model.embed_tokens = VocabParallelEmbedding(a.vocab_size, a.hidden_size, group, dtype=dtype)

    # -- logits -----------------------------------------------------------------
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 [T, vocab] on rank 0, None on the other ranks (every rank must call it)."""
        if hidden.shape[0] == 0:  # no rows wanted this step (every rank knows): no collective
            return hidden.new_zeros((0, self.vocab_size), dtype=torch.float32) if self.group.rank == 0 else None
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return gather_vocab_logits(F.linear(hidden, w).float(), self.vocab_size, self.group)

    # -- sharding ---------------------------------------------------------------
    def _ranges(self) -> dict[str, tuple[int, int]]:
        """HF projection -> (start, count) of the rows (or, for o/down, columns) this rank keeps."""
        a, la, r = self.full_args, self.args, self.group.rank
        d = a.head_dim
        inter = la.intermediate_size
        kv = (self.kv_start * d, la.num_kv_heads * d)
        return {
            "self_attn.q_proj": (r * la.num_heads * d, la.num_heads * d),
            "self_attn.k_proj": kv,
            "self_attn.v_proj": kv,
            "self_attn.o_proj": (r * la.num_heads * d, la.num_heads * d),
            "mlp.gate_proj": (r * inter, inter),
            "mlp.up_proj": (r * inter, inter),
            "mlp.down_proj": (r * inter, inter),
        }

    def shard_hf(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of an HF-named full tensor."""
        if name in _VOCAB:
            return shard_vocab_rows(full, self.group.rank, self.group.world_size)
        for proj, (start, n) in self._ranges().items():
            if f".{proj}." in name:
                if proj in ("self_attn.o_proj", "mlp.down_proj"):
                    return full if name.endswith(".bias") else full.narrow(1, start, n)
                return full.narrow(0, start, n)
        return full

    def _full_stacked(self) -> dict[str, list[tuple[str, int]]]:
        """Our fused parameter -> [(HF projection, full rows)] in order."""
        a = self.full_args
        qs, kvs = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        return {
            "self_attn.qkv_proj": [("self_attn.q_proj", qs), ("self_attn.k_proj", kvs), ("self_attn.v_proj", kvs)],
            "mlp.gate_up_proj": [("mlp.gate_proj", a.intermediate_size), ("mlp.up_proj", a.intermediate_size)],
        }

    def full_parameter_shape(self, name: str) -> tuple[int, ...]:
        """Shape of our parameter ``name`` in the TP=1 model."""
        a = self.full_args
        p = dict(self.named_parameters())[name]
        if name in _VOCAB:
            return (a.vocab_size, *p.shape[1:])
        for ours, parts in self._full_stacked().items():
            if f".{ours}." in name:
                return (sum(n for _, n in parts), *p.shape[1:])
        if name.endswith("self_attn.o_proj.weight"):
            return (p.shape[0], a.num_heads * a.head_dim)
        if name.endswith("mlp.down_proj.weight"):
            return (p.shape[0], a.intermediate_size)
        return tuple(p.shape)

    def shard_parameter(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of our (possibly fused) parameter ``name`` given its TP=1 value."""
        for ours, parts in self._full_stacked().items():
            if f".{ours}." in name:
                pieces = full.split([n for _, n in parts], dim=0)
                return torch.cat([self.shard_hf(name.replace(f".{ours}.", f".{hf}."), t)
                                  for (hf, _), t in zip(parts, pieces)])
        return self.shard_hf(name, full)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((name, self.shard_hf(name, t)) for name, t in weights)


def check_tp_architecture(hf_config: dict) -> str:
    """The architecture name, or ConfigError when it has no tensor-parallel implementation."""
    from kvforge.distributed.tp_deepseek import DEEPSEEK_FAMILY
    from kvforge.models.registry import resolve_architecture

    arch = resolve_architecture(hf_config)
    if arch not in LLAMA_FAMILY + DEEPSEEK_FAMILY:
        raise ConfigError(f"--tensor-parallel-size > 1 runs the Llama family ({', '.join(LLAMA_FAMILY)}) and "
                          f"DeepSeek-V2/V3; "
                          f"{arch} runs at TP 1 only (`kvforge plan` shows its per-rank figures for any TP)")
    return arch


def build_tp_model(hf_config: dict, dtype: torch.dtype, device: torch.device, group: TPGroup, plan):
    """This rank's model with uninitialised parameters (fill with kvforge.weights.load_weights)."""
    arch = check_tp_architecture(hf_config)
    heads = {(lp.heads_per_rank, lp.kv_heads_per_rank) for lp in plan.layers}
    if len(heads) != 1:
        raise ConfigError(f"the plan gives layers different heads per rank {sorted(heads)}; not supported at TP > 1")
    (hpr, kvpr), = heads
    config = dict(hf_config)
    config["architectures"] = [arch]
    from kvforge.distributed.tp_deepseek import DEEPSEEK_FAMILY, build_tp_deepseek

    if arch in DEEPSEEK_FAMILY:
        return build_tp_deepseek(config, dtype, device, group, hpr, kvpr)
    with torch.device("meta"):
        model = TPLlamaForCausalLM(config, dtype, group, hpr, kvpr)
    model = model.to_empty(device=torch.device(device))
    model.reset_buffers()
    return model.eval()

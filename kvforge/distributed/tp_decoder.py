"""What every tensor-parallel decoder shares: the per-rank model, vocab-parallel ends, cutting full tensors.

Each rank builds the family's ordinary model from a per-rank config (its query
heads, its MLP slice, ``ceil(vocab / tp)`` vocabulary rows) and then
:class:`TensorParallelDecoder` swaps in the parallel pieces every family has:
``o_proj`` (a linear-attention layer's ``out_proj``) and the dense MLPs' ``down_proj`` become
row-parallel (all-reduce),
the embedding vocab-parallel, and the LM head computes this rank's vocabulary
slice whose logits rank 0 gathers. Column-parallel projections (q/k/v,
gate/up, ...) stay the family's own linear modules of the rank's rows.

A family declares, per HF projection it shards, the :class:`RankSlice` this
rank keeps (``rank_slices``); cutting checkpoint tensors (``shard_hf``), the
TP=1 shape of a parameter (``full_parameter_shape``, for dummy weights drawn as
at TP=1) and cutting a fused parameter (``shard_parameter``) all read that table.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from kvforge.distributed.group import TPGroup
from kvforge.distributed.layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_vocab_logits,
    shard_vocab_rows,
    vocab_range,
)
from kvforge.errors import ConfigError
from kvforge.models.decoder import DecoderArgs, DecoderForCausalLM
from kvforge.models.layers import GatedMLP
from kvforge.models.linear_route import linear

VOCAB_PARAMETERS = ("model.embed_tokens.weight", "lm_head.weight")
ROW_PARALLEL_PROJECTIONS = ("o_proj", "out_proj", "down_proj")
"""Projections whose input columns are split (all-reduced outputs); every other sharded one splits output rows."""


@dataclass(frozen=True)
class RankSlice:
    """The rows (row-parallel projections: input columns) ``[start, start + count)`` of ``full`` this rank keeps."""

    start: int
    count: int
    full: int


def even_slice(full: int, group: TPGroup) -> RankSlice:
    """This rank's equal share of ``full`` rows (the caller checked that TP divides ``full``)."""
    count = full // group.world_size
    return RankSlice(group.rank * count, count, full)


def check_heads_per_rank(num_heads: int, tp: int, heads_per_rank: int) -> None:
    if num_heads % tp or heads_per_rank != num_heads // tp:
        raise ConfigError(f"TP {tp}: {num_heads} attention heads give {num_heads / tp:g} per rank, "
                          f"the plan says {heads_per_rank}")


def check_tp_divides(tp: int, size: int, what: str) -> None:
    if size % tp:
        raise ConfigError(f"--tensor-parallel-size {tp} does not divide {what} {size}")


def per_rank_config(config: dict, full: DecoderArgs, group: TPGroup, **sizes) -> dict:
    """The HF config of this rank's model: ``sizes`` replaced, the vocabulary cut to this rank's rows."""
    _, _, vocab_rows = vocab_range(full.vocab_size, group.rank, group.world_size)
    local = dict(config)
    local.update(vocab_size=vocab_rows, **sizes)
    return local


class TensorParallelDecoder(DecoderForCausalLM):
    """Mixed in before a family's model class: ``class TPFoo(TensorParallelDecoder, FooForCausalLM)``."""

    def __init__(self, config: dict, rank_config: dict, full_args: DecoderArgs, group: TPGroup,
                 dtype: torch.dtype | None, with_mtp: bool = False):
        super().__init__(rank_config, dtype=dtype, **({"with_mtp": True} if with_mtp else {}))
        self.config = dict(config)  # the full config: GGUF Q/K unpermutation reads the full head counts
        self.full_args = full_args
        self.group = group
        self.vocab_size = full_args.vocab_size
        for layer in (*self.model.layers, *self.mtp_decoder_layers()):
            for mixer, proj in (("self_attn", "o_proj"), ("linear_attn", "out_proj")):
                owner = getattr(layer, mixer, None)
                if owner is not None:
                    setattr(owner, proj, RowParallelLinear.like(getattr(owner, proj), group))
            if isinstance(layer.mlp, GatedMLP):
                layer.mlp.down_proj = RowParallelLinear.like(layer.mlp.down_proj, group)
        self.model.embed_tokens = VocabParallelEmbedding(full_args.vocab_size, full_args.hidden_size, group,
                                                         dtype=dtype)

    @classmethod
    def check_split(cls, config: dict, tp: int, heads_per_rank: int, kv_heads_per_rank: int) -> None:
        """ConfigError naming the first size of ``config`` that ``tp`` ranks cannot split as this family
        splits it (the plan giving ``heads_per_rank`` / ``kv_heads_per_rank``); builds nothing, so rank 0 asks
        before any worker starts, and every rank's constructor asks again."""
        raise NotImplementedError

    def rank_slices(self) -> dict[str, RankSlice]:
        """HF projection (name fragment) -> the part of it this rank keeps."""
        raise NotImplementedError

    def mtp_decoder_layers(self) -> tuple:
        """The decoder layers of the checkpoint's multi-token-prediction block (built with ``with_mtp``),
        split like the model's own layers; none by default."""
        return ()

    def is_vocab_parameter(self, name: str) -> bool:
        """Whether ``name`` (HF or ours) holds one row per vocabulary entry, split in vocabulary ranges."""
        return name in VOCAB_PARAMETERS

    def rank_slices_for(self, name: str) -> dict[str, RankSlice]:
        """The slices that apply to tensor ``name`` (families whose layer types share projection names
        answer per layer); :meth:`rank_slices` by default."""
        return self.rank_slices()

    def splits_first_dim(self, name: str) -> bool:
        """Whether the tensor ``name`` (HF or ours) is split along its first dimension in equal rank shares
        (stacked experts, per-head vectors); none by default."""
        return False

    # -- logits ------------------------------------------------------------------------
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 [T, vocab] on rank 0, None on the other ranks (every rank must call it)."""
        if hidden.shape[0] == 0:  # no rows wanted this step (every rank knows): no collective
            return hidden.new_zeros((0, self.vocab_size), dtype=torch.float32) if self.group.rank == 0 else None
        return gather_vocab_logits(linear(hidden, self.lm_head_weight).float(), self.vocab_size, self.group)

    # -- sharding ----------------------------------------------------------------------
    def _projection(self, name: str) -> tuple[str, RankSlice] | None:
        for proj, part in self.rank_slices_for(name).items():
            if f".{proj}." in name:
                return proj, part
        return None

    def shard_hf(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of an HF-named full tensor."""
        if self.splits_first_dim(name):
            part = even_slice(full.shape[0], self.group)
            return full.narrow(0, part.start, part.count)
        if self.is_vocab_parameter(name):
            return shard_vocab_rows(full, self.group.rank, self.group.world_size)
        found = self._projection(name)
        if found is None:
            return full  # replicated
        proj, part = found
        if proj.endswith(ROW_PARALLEL_PROJECTIONS):
            return full if name.endswith(".bias") else full.narrow(1, part.start, part.count)
        return full.narrow(0, part.start, part.count)

    def _fused_full_parts(self, name: str) -> tuple[str, list[tuple[str, int]]] | None:
        """``(our fused fragment, [(HF projection, TP=1 rows)])`` when ``name`` is a fused parameter (a part
        without a rank slice is replicated: its rows here are its TP=1 rows)."""
        slices = self.rank_slices_for(name)
        for ours, parts in self.fused_parameters().items():
            if f".{ours}." in name:
                return ours, [(hf, slices[hf].full if hf in slices else n) for hf, n in parts]
        return None

    def full_parameter_shape(self, name: str) -> tuple[int, ...]:
        """Shape of our parameter ``name`` in the TP=1 model."""
        shape = list(dict(self.named_parameters())[name].shape)
        fused = self._fused_full_parts(name)
        found = self._projection(name)
        if self.splits_first_dim(name):
            shape[0] *= self.group.world_size
        elif self.is_vocab_parameter(name):
            shape[0] = self.full_args.vocab_size
        elif fused:
            shape[0] = sum(n for _, n in fused[1])
        elif found and found[0].endswith(ROW_PARALLEL_PROJECTIONS):
            if name.endswith(".weight"):
                shape[1] = found[1].full
        elif found:
            shape[0] = found[1].full
        return tuple(shape)

    def shard_parameter(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of our (possibly fused) parameter ``name`` given its TP=1 value."""
        fused = self._fused_full_parts(name)
        if fused is None:
            return self.shard_hf(name, full)
        ours, parts = fused
        pieces = full.split([n for _, n in parts], dim=0)
        return torch.cat([self.shard_hf(name.replace(f".{ours}.", f".{hf}."), t) for (hf, _), t in zip(parts, pieces)])

    def rank_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The full HF-named checkpoint stream, cut to what this rank loads."""
        for name, t in weights:
            yield name, self.shard_hf(name, t)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self.rank_checkpoint(weights))

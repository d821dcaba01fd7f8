"""Parallel layers and how a full tensor is cut for one rank.

Column-parallel projections (q/k/v, gate/up) are the family's own linear modules
of the rank's output rows: no communication. Row-parallel projections (o_proj,
down_proj) hold the rank's input columns and all-reduce their partial sums; a
bias is added once, after the reduction. The embedding and the LM head hold a
contiguous slice of the vocabulary (padded to a multiple of the TP size);
embedding lookups outside the slice are zero and all-reduced, logits are
gathered on rank 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.distributed.group import TPGroup
from kvforge.models.linear_route import linear


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(start, end, rows per rank): rank ``rank`` owns ids [start, end); rows per rank
    is ceil(vocab / tp) (the last rank's extra rows are zero padding)."""
    per = -(-vocab_size // world_size)
    start = min(rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


def shard_vocab_rows(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    start, end, per = vocab_range(full.shape[0], rank, world_size)
    out = full.new_zeros((per, *full.shape[1:]))
    out[:end - start] = full[start:end]
    return out


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` over this rank's input features; partial sums (routed by
    :func:`~kvforge.models.linear_route.linear`) are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TPGroup, dtype=None):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.group = group

    @classmethod
    def like(cls, linear: nn.Linear, group: TPGroup) -> RowParallelLinear:
        """A row-parallel layer of ``linear``'s shape, bias and dtype (the rank's input columns)."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None, group,
                   dtype=linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce_(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding; ids owned by other ranks look up zeros."""

    def __init__(self, vocab_size: int, hidden: int, group: TPGroup, dtype=None):
        start, end, per = vocab_range(vocab_size, group.rank, group.world_size)
        super().__init__(per, hidden, dtype=dtype)
        self.vocab_start, self.vocab_end = start, end
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, torch.zeros_like(ids), ids - self.vocab_start)
        out = F.embedding(local, self.weight)
        out = out.masked_fill(outside[:, None], 0)
        return self.group.all_reduce_(out)


def gather_vocab_logits(local: torch.Tensor, vocab_size: int, group: TPGroup) -> torch.Tensor | None:
    """[T, rows per rank] on every rank -> [T, vocab] on rank 0 (None elsewhere)."""
    parts = group.gather_to_0(local)
    if parts is None:
        return None
    return torch.cat(parts, dim=-1)[:, :vocab_size]

"""Proposals that stay on the device until verification reads them.

A model-based proposer picks its proposals on the device. For greedy requests the engine need not read
them before the verify step: the scheduler only needs how many each sequence has, the verify step gathers
their ids on the device (``ModelRunner`` placeholders, as overlapped scheduling gathers an in-flight
token's), and verification reads them in the same host read as the target's argmax. One host wait a step
instead of two, and the host schedules and builds the verify step while the proposer's passes still run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The id a sequence's ``spec_token_ids`` hold in place of a proposal still on the device; every use of
#: its value gathers the real id on the device first, or reads it (``LLMEngine._verify``).
UNREAD = 0


@dataclass(frozen=True)
class DeviceProposals:
    """``tokens``: int64 [n] on the device, every proposal of a propose call; ``index``: per request id, the
    positions of its proposals in ``tokens``, in order (a request without proposals is absent)."""

    tokens: torch.Tensor
    index: dict[str, list[int]]

    def count(self, request_id: str) -> int:
        return len(self.index.get(request_id, ()))

    def positions(self, request_ids: list[str], counts: list[int]) -> list[int]:
        """Positions in ``tokens`` of the first ``counts[i]`` proposals of ``request_ids[i]``, in order."""
        return [p for rid, n in zip(request_ids, counts) if n for p in self.index[rid][:n]]

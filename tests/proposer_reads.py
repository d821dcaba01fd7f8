"""Counting a proposer's host reads: ``tolist`` calls made from given source files during each propose call."""

from __future__ import annotations

import sys

import torch


def count_propose_reads(proposer, monkeypatch, files: tuple[str, ...]) -> tuple[list[int], list[int]]:
    """Wrap ``proposer.propose``; returns two lists that fill as the engine proposes: per call, the ``tolist``
    calls made from a file whose name ends with one of ``files`` (so not, e.g., the CPU expert loop's), and
    the most proposals a sequence got."""
    propose, tolist = proposer.propose, torch.Tensor.tolist
    reads: list[int] = []
    made: list[int] = []

    def counted(self):
        if sys._getframe(1).f_code.co_filename.endswith(files):
            reads[-1] += 1
        return tolist(self)

    def counting_propose(seqs):
        reads.append(0)
        monkeypatch.setattr(torch.Tensor, "tolist", counted)
        try:
            out = propose(seqs)
        finally:
            monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        made.append(max((len(p) for p in out), default=0))
        return out

    proposer.propose = counting_propose
    return reads, made

"""Prompt-token logprobs (``SamplingParams.prompt_logprobs``), scored from a step's hidden rows a slice at a time.

A prompt chunk of ``R`` rows asks for ``R`` rows of logits over the whole vocabulary (8,192 x 128,256 float32
is 4.2 GB, and its log-softmax as much again). The runner never builds them at once: it takes the rows'
hidden states and, :data:`SLICE_ROWS` rows at a time, computes their logits, their log-softmax, each row's
target logprob and top ``k``; only those ``R x (1 + 2k)`` values are kept. The planner's activation reserve
counts one slice (kvforge/planner/activations.py, "prompt logprobs").

At TP > 1 every rank runs the same slices (their logits are gathered across ranks): the step carries the
number of scored rows and the slice length from rank 0 (``HostStep.num_scored``, ``scored_slice_rows``);
only rank 0, which holds a :class:`PromptScoring`, reduces them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvforge.engine.logprob import logprob_entry
from kvforge.host_copies import start_host_copy
from kvforge.planner.activations import PROMPT_LOGPROBS_SLICE_ROWS

SLICE_ROWS = PROMPT_LOGPROBS_SLICE_ROWS


@dataclass
class PromptLogprobs:
    """Prompt-token logprobs of one step, on the device until :meth:`to_host`.

    Row ``r`` is the logits row of the position before a prompt token;
    ``token_logprobs[r]`` is that token's logprob (log-softmax of the raw
    logits) and ``token_ranks[r]`` its rank in the vocabulary (the tokens
    scored at least as high, itself included, as vLLM counts a rank: a tie
    ranks it last among its equals), ``top_logprobs[r]``  / ``top_ids[r]`` the ``k`` best (k = the
    largest ``prompt_logprobs`` of the step's requests). ``spans``: per request,
    ``(seq, first prompt token, number of rows)``, in row order.
    """

    token_logprobs: torch.Tensor
    token_ranks: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor
    spans: list

    def to_host(self) -> PromptLogprobs:
        """Start the copies to host memory (pinned, non-blocking on CUDA); read after the step's sync."""
        if self.token_logprobs.device.type != "cuda":
            return self
        return PromptLogprobs(start_host_copy(self.token_logprobs), start_host_copy(self.token_ranks),
                              start_host_copy(self.top_logprobs), start_host_copy(self.top_ids), self.spans)

    def apply(self) -> None:
        """Record each request's entries (``Sequence.add_prompt_logprobs``); host tensors only."""
        lps, tops, ids = self.token_logprobs.tolist(), self.top_logprobs.tolist(), self.top_ids.tolist()
        ranks = self.token_ranks.tolist()
        row = 0
        for seq, first, count in self.spans:
            k = seq.params.prompt_logprobs
            prompt = seq.prompt_token_ids
            entries = [logprob_entry(prompt[first + r - row], lps[r], ranks[r], ids[r][:k], tops[r][:k])
                       for r in range(row, row + count)]
            seq.add_prompt_logprobs(first, entries)
            row += count


@dataclass
class PromptScoring:
    """What rank 0 scores a step's prompt rows against: ``targets`` int64 [R] (the prompt token after each
    row's position, on the step's device), ``k`` (top logprobs a row keeps), ``spans`` (as
    :class:`PromptLogprobs`). :func:`score_rows` sets ``result``."""

    targets: torch.Tensor
    k: int
    spans: list
    result: PromptLogprobs | None = None

    @property
    def num_rows(self) -> int:
        return int(self.targets.shape[0])


def set_scored_rows(host, scoring: PromptScoring | None) -> None:
    """Mark the last rows of ``host`` (a ``HostStep`` on rank 0) as ``scoring``'s, sliced :data:`SLICE_ROWS`
    at a time."""
    host.num_scored = scoring.num_rows if scoring is not None else 0
    host.scored_slice_rows = SLICE_ROWS if scoring is not None else 0


def score_rows(compute_logits: Callable[[torch.Tensor], torch.Tensor | None], hidden: torch.Tensor,
               slice_rows: int, scoring: PromptScoring | None) -> None:
    """Score the rows of ``hidden`` [R, hidden], ``slice_rows`` at a time (module docstring).
    ``compute_logits`` is the model's head: float32 logits on rank 0, None on the other ranks, which pass
    ``scoring=None`` and only take part in each slice's gather."""
    token_lp, token_rank, top_lp, top_ids = [], [], [], []
    for start in range(0, hidden.shape[0], slice_rows):
        logits = compute_logits(hidden[start:start + slice_rows])
        if logits is None or scoring is None:
            continue
        lp = torch.log_softmax(logits.float(), dim=-1)
        del logits
        k = min(scoring.k, lp.shape[-1])
        target = lp.gather(1, scoring.targets[start:start + lp.shape[0], None])
        token_lp.append(target.squeeze(1))
        token_rank.append((lp >= target).sum(dim=-1))
        values, indices = lp.topk(k, dim=-1)
        top_lp.append(values)
        top_ids.append(indices)
        del lp  # before the next slice's logits: one slice alive at a time
    if scoring is not None and token_lp:
        scoring.result = PromptLogprobs(torch.cat(token_lp), torch.cat(token_rank), torch.cat(top_lp),
                                        torch.cat(top_ids), scoring.spans)

"""Repetition, presence and frequency penalties on a batch of logits (vLLM's and OpenAI's definitions).

For a row with history ``prompt`` + ``output`` (the tokens before the one being sampled):

* ``repetition_penalty`` r (1: off) on every token of the prompt or the output: a positive logit is divided
  by r, any other multiplied by r (as vLLM and transformers' ``RepetitionPenaltyLogitsProcessor``);
* ``frequency_penalty`` f and ``presence_penalty`` p (0: off) on the output only:
  ``logit -= f * count + p * (count > 0)``, ``count`` the token's occurrences in the output (OpenAI's
  formula).

The penalized logits feed greedy and random sampling alike; logprobs stay those of the raw logits (the
sampler computes them before). Only rows with a penalty are touched; their histories are gathered into
one padded host array, so the host cost grows with the history lengths of those rows only (sequences
keep their ids as growing int64 arrays, ``Sequence.token_arrays``, so a step copies arrays, not lists).

``pending``: int64 ``[rows]`` on the logits' device, a token of the output not on the host yet (overlapped
scheduling: the previous step's sampled token), or -1; it counts as one more output token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvforge.engine.sampling_params import SamplingParams
from kvforge.host_copies import values_to_device

History = tuple[Sequence[int], Sequence[int]]  # (prompt token ids, output token ids): lists or int64 arrays


def _padded(lists: list[Sequence[int]], fill: int, device: torch.device) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0)
    arr = np.full((len(lists), max(width, 1)), fill, dtype=np.int64)
    for i, x in enumerate(lists):
        arr[i, : len(x)] = x
    return values_to_device(arr, device)


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[History],
    pending: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """``logits`` (float32 ``[rows, vocab]``) with each row's penalties applied (module docstring): a new
    tensor where any row has one, else ``logits`` itself."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    n, vocab = logits.shape
    device = logits.device
    idx = values_to_device(rows, device)
    sub = logits[idx]
    # Counts of each row's output tokens; column `vocab` takes the padding and is dropped.
    outputs = _padded([histories[i][1] for i in rows], vocab, device)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.float32))
    if pending is not None:
        tok = pending[idx]
        col = torch.where(tok >= 0, tok, torch.full_like(tok, vocab))
        counts.scatter_add_(1, col[:, None], torch.ones(len(rows), 1, device=device))
    counts = counts[:, :vocab]
    freq_pres = values_to_device([[params[i].frequency_penalty for i in rows], [params[i].presence_penalty for i in rows]],
                                 device, torch.float32)
    freq, pres = freq_pres[0, :, None], freq_pres[1, :, None]
    rep = [params[i].repetition_penalty for i in rows]
    if any(r != 1.0 for r in rep):
        seen = counts > 0
        prompts = _padded([histories[i][0] for i in rows], vocab, device)
        in_prompt = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
        in_prompt.scatter_(1, prompts, True)
        seen |= in_prompt[:, :vocab]
        r = values_to_device(rep, device, torch.float32)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    sub = sub - freq * counts - pres * (counts > 0).float()
    out = logits.clone()
    out[idx] = sub
    return out

"""How a model-based proposer turns its logits into proposals (draft models, the MTP layer).

Greedy requests (temperature 0) take the argmax. Sampled ones draw from the proposer's distribution
``q``: the request's own sampling settings (temperature, min-p, top-k, top-p) applied to the
proposer's logits, drawn with the request's generator when it has a seed. ``q`` of every drawn
proposal goes to the verifier, whose rejection sampling then keeps the target's distribution exactly.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from kvforge.engine.sampler import Sampler
from kvforge.engine.sequence import Sequence
from kvforge.host_copies import values_to_device
from kvforge.speculative.verify import _exponential


def pick_proposal_tokens(logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> tuple[torch.Tensor,
                                                                                   list[torch.Tensor | None]]:
    """One proposal per row of ``logits`` [rows, vocab] (row i for ``seqs[i]``), as int64 [rows] on the logits'
    device (no host read), and its ``q`` (None when greedy)."""
    tokens = logits.argmax(dim=-1)
    probs: list[torch.Tensor | None] = [None] * len(seqs)
    sampled = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy]
    if sampled:
        idx = values_to_device(sampled, logits.device)
        q = Sampler.target_probs(logits[idx], [seqs[i].params for i in sampled])
        race = _exponential(q.shape[1], [seqs[i].generator_for(logits.device) for i in sampled],
                            logits.device).clamp_(min=1e-20)
        tokens = tokens.index_copy(0, idx, (q / race).argmax(dim=-1))
        for i, row in zip(sampled, q):
            probs[i] = row
    return tokens, probs


def read_passes(passes: list[tuple[list[int], torch.Tensor]], num_seqs: int) -> list[list[int]]:
    """The proposals of ``num_seqs`` sequences from a propose call's passes (per pass: the indices of the
    sequences its rows belong to, and the rows' proposals on the device), read to the host at once."""
    out: list[list[int]] = [[] for _ in range(num_seqs)]
    if passes:
        picked = iter(torch.cat([tokens for _, tokens in passes]).tolist())  # the one host read
        for indices, _ in passes:
            for i in indices:
                out[i].append(next(picked))
    return out

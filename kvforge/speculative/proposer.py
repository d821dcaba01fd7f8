"""The interface every proposer implements, and the one place that builds a proposer from a config."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Protocol

from kvforge.engine.sequence import Sequence
from kvforge.errors import ConfigError
from kvforge.speculative.config import SpeculativeConfig


class Proposer(Protocol):
    """Guesses the tokens that follow each sequence.

    ``propose(seqs)`` returns one list per sequence, in order, of at most ``num_speculative_tokens``
    token ids that would follow ``seq.all_token_ids``; an empty list proposes nothing for that sequence.
    Proposals only cost compute when they are wrong: verification keeps exactly the tokens the target
    model would have produced. A proposer that runs a model (a draft model) batches the sequences
    itself; the engine calls ``propose`` once per step, before scheduling, with the decoding sequences.

    Optional methods (the engine calls them when a proposer has them): ``proposal_probs(seq, n)``,
    the distribution ``q`` [n, vocab] each of the sequence's first ``n`` proposals was drawn from (None or
    absent: point masses, as for n-gram proposals), which rejection sampling needs;
    ``discard(request_id)``, called when a request finishes, is aborted or preempted, for a proposer that
    keeps per-request state (a draft model's KV); and ``observe(scheduled, new_tokens)``, called after every
    verified step with the step's scheduled chunks and each sampled request's appended tokens, for a
    proposer that reads the target's hidden states of that step (the MTP layer, kvforge/speculative/mtp.py);
    ``propose_on_device(seqs)``, for greedy sequences, the proposals left on the device as
    :class:`kvforge.speculative.device_proposals.DeviceProposals` (or None when there are none), which
    verification reads with the target's argmax.
    """

    num_speculative_tokens: int

    def propose(self, seqs: SequenceOf[Sequence]) -> list[list[int]]: ...


def build_proposer(config: SpeculativeConfig, draft=None, mtp=None) -> Proposer:
    """The proposer of ``config.method``. ``draft``: for method draft_model, the keyword arguments of
    :class:`DraftModelProposer` besides the count; ``mtp``: for method mtp, those of :class:`MTPProposer`."""
    if config.method == "ngram":
        from kvforge.speculative.ngram import NgramProposer

        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model" and draft is not None:
        from kvforge.speculative.draft_model import DraftModelProposer

        return DraftModelProposer(config.num_speculative_tokens, **draft)
    if config.method == "mtp" and mtp is not None:
        from kvforge.speculative.mtp import MTPProposer

        return MTPProposer(config.num_speculative_tokens, **mtp)
    raise ConfigError(f"speculative method {config.method} needs its model: draft_model a draft, mtp the "
                      f"target's MTP layer")

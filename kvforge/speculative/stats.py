"""Acceptance counters: per request (``RequestOutput.speculative``) and for the engine (``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeStats:
    """One request's verification record. ``num_drafts``: steps in which it had proposals verified;
    ``num_draft_tokens``: proposals verified; ``num_accepted_tokens``: proposals accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed (0 when nothing was proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step: 1 (the target's own token) + accepted proposals per step,
        vLLM's "mean acceptance length" (1.0 when nothing was proposed)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def plus(self, num_proposed: int, num_accepted: int) -> SpeculativeStats:
        return SpeculativeStats(self.num_drafts + 1, self.num_draft_tokens + num_proposed,
                                self.num_accepted_tokens + num_accepted)


class SpecDecodeCounters:
    """The engine's totals since it started (vLLM v1's spec_decode counters): verification steps with
    proposals (``num_drafts``), proposals, accepted proposals, and accepted proposals per position
    (``accepted_per_pos[j]``: how often proposal ``j + 1`` of a step was accepted)."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if not num_proposed:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def as_dict(self) -> dict:
        """The ``engine.stats()["spec_decode"]`` entry."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos)}


def spec_decode_summary(before: dict | None, after: dict | None) -> dict | None:
    """The counters of ``engine.stats()["spec_decode"]`` between two snapshots, with the acceptance rate
    (accepted / proposed) and the mean accepted length (1 + accepted per verification step); None when
    the engine does not speculate."""
    if after is None:
        return None
    before = before or {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                        "accepted_per_pos": [0] * len(after["accepted_per_pos"])}
    d = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    d["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"])]
    d["acceptance_rate"] = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0
    d["mean_accepted_length"] = 1.0 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 1.0
    return d

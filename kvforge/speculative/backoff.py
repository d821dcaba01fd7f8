"""When a sequence asks the proposer again: proposals that keep failing stop costing every step.

A speculative step is synchronous (the next step's positions depend on how many proposals were
accepted) and pays for the proposer's work and for verifying ``1 + k`` rows. A sequence whose proposals
are rejected, or for which the proposer finds nothing (an n-gram lookup without a match), gains nothing
for that price. Each such *probe* lengthens the sequence's streak; once the streak reaches
``min_streak`` the sequence skips ``2, 4, 8, ...`` steps (at most ``max_skip``) before the next probe, and
the steps it skips are ordinary decode steps, overlapped with the host under async scheduling. One
accepted proposal ends the streak: the sequence is probed every step again.

Skipping never changes output: verification is exact whether or not a step carries proposals.

The clock is the sequence's own count of output tokens, not the engine's step counter: a plain step adds
one token, so a skip of ``n`` tokens is ``n`` plain steps, and when a sequence probes depends on its own
history only, never on the batch around it. So sample ``j`` of a seeded ``n``-sample request probes
where a lone request with seed ``+ j`` probes, and draws the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProposalBackoff:
    """Per-request streaks and next probes (``clock``: the request's output tokens so far)."""

    min_streak: int = 3
    max_skip: int = 32
    _state: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (streak, next probe)

    def due(self, request_id: str, clock: int) -> bool:
        state = self._state.get(request_id)
        return state is None or clock >= state[1]

    def record(self, request_id: str, clock: int, num_proposed: int, num_accepted: int) -> None:
        """The outcome of probing ``request_id`` at ``clock``: ``num_proposed`` proposals (0: the proposer
        found none), ``num_accepted`` of them accepted."""
        if num_accepted > 0:
            self._state.pop(request_id, None)
            return
        streak = self._state.get(request_id, (0, 0))[0] + 1
        skip = 0 if streak < self.min_streak else min(2 ** (streak - self.min_streak + 1), self.max_skip)
        self._state[request_id] = (streak, clock + 1 + skip)

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)

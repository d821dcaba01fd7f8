"""A bounded record of the engine's recent steps: what each step computed and when its tokens came.

The engine adds one ``StepRecord`` per resolved step (its sampled tokens are on the host).
``launched`` and ``finished`` are wall-clock seconds (``time.time()``), so a client on the same host
can line its own timestamps up with them. ``seconds`` is the part of the elapsed time the step had to
itself: from its launch, or from the previous step's tokens if those came later (with async
scheduling a step is launched while its predecessor still runs), to its own tokens. It is the delay
the step added to every stream in it, and it is measured on the monotonic clock, so a step of the
wall clock (a time-sync adjustment) never shows up as a slow or negative step.

Reads come from other threads (the server's event loop): every access holds a lock, and a read
returns a list copy.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import NamedTuple

DEFAULT_CAPACITY = 4096


class Stamp(NamedTuple):
    """One instant on both clocks: ``wall`` (``time.time()``) and ``mono`` (``time.monotonic()``)."""

    wall: float
    mono: float

    @classmethod
    def now(cls) -> Stamp:
        return cls(time.time(), time.monotonic())


@dataclass(frozen=True)
class StepRecord:
    step: int  # 0-based index of the step among those the engine resolved
    launched: float  # wall-clock time the step was launched
    finished: float  # wall-clock time its sampled tokens were on the host
    seconds: float  # the wall time the step had to itself (module docstring)
    num_prefill_tokens: int  # tokens of prompt (or recompute) chunks
    num_decode_tokens: int  # tokens of decoding sequences
    num_seqs: int

    def as_dict(self) -> dict:
        return asdict(self)


class StepLog:
    """The last ``capacity`` steps, oldest first; ``total`` counts every step ever added."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._records: deque[StepRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.total = 0
        self._last_finished_mono = -float("inf")

    def add(self, launched: Stamp, finished: Stamp, num_prefill_tokens: int, num_decode_tokens: int,
            num_seqs: int) -> StepRecord:
        with self._lock:
            seconds = finished.mono - max(launched.mono, self._last_finished_mono)
            rec = StepRecord(self.total, launched.wall, finished.wall, seconds,
                             num_prefill_tokens, num_decode_tokens, num_seqs)
            self._records.append(rec)
            self.total += 1
            self._last_finished_mono = finished.mono
            return rec

    def last(self, n: int | None = None) -> list[StepRecord]:
        """The newest ``n`` records (all kept when None), oldest first."""
        with self._lock:
            recs = list(self._records)
        return recs if n is None else recs[max(0, len(recs) - n):]

    def since(self, step: int) -> list[StepRecord]:
        """Records with ``record.step >= step`` still kept, oldest first."""
        with self._lock:
            first = self.total - len(self._records)
            return list(self._records)[max(0, step - first):]

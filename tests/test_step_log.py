"""The engine's step record: each step's own time, ring capacity, and reads by step index."""

from __future__ import annotations

import pytest

from kvforge.engine.step_log import Stamp, StepLog


def test_seconds_is_the_time_a_step_had_to_itself():
    log = StepLog()
    a = log.add(Stamp(100.0, 5.0), Stamp(100.5, 5.5), 32, 0, 1)
    # launched while the first still ran (overlapped scheduling): counted from the first's tokens
    b = log.add(Stamp(100.4, 5.4), Stamp(100.7, 5.7), 0, 2, 2)
    # launched after a pause: counted from its own launch
    c = log.add(Stamp(101.0, 6.0), Stamp(101.1, 6.1), 0, 2, 2)
    assert [r.seconds for r in (a, b, c)] == pytest.approx([0.5, 0.2, 0.1], abs=1e-12)
    assert (b.launched, b.finished) == (100.4, 100.7)


def test_a_wall_clock_step_does_not_change_seconds():
    """The wall clock jumping back 30 s or forward 9 s mid-step: the step's time comes from the
    monotonic clock, so it is neither negative nor 9 s long; the record keeps the wall times."""
    log = StepLog()
    back = log.add(Stamp(1000.0, 50.0), Stamp(970.02, 50.02), 0, 1, 1)
    forward = log.add(Stamp(970.03, 50.03), Stamp(979.06, 50.06), 0, 1, 1)
    assert back.seconds == pytest.approx(0.02, abs=1e-12)
    assert forward.seconds == pytest.approx(0.03, abs=1e-12)
    assert forward.finished == 979.06


def test_capacity_keeps_the_newest_and_since_reads_by_index():
    log = StepLog(capacity=3)
    for i in range(5):
        log.add(Stamp(float(i), float(i)), Stamp(i + 0.5, i + 0.5), i, 0, 1)
    assert log.total == 5
    assert [r.step for r in log.last()] == [2, 3, 4]
    assert [r.step for r in log.last(2)] == [3, 4]
    assert [r.step for r in log.since(0)] == [2, 3, 4]
    assert [r.step for r in log.since(4)] == [4]
    assert log.since(5) == []
    with pytest.raises(ValueError, match="capacity"):
        StepLog(capacity=0)

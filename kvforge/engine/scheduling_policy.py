"""``--scheduling-policy`` (vLLM's flag): which request the scheduler serves first (kvforge/engine/scheduler.py).

- ``fcfs``: arrival order; a preempted request goes back to the front of the waiting queue.
- ``priority``: each request's ``priority`` (an integer, lower first), arrival order among equals.
"""

from __future__ import annotations

SCHEDULING_POLICIES = ("fcfs", "priority")

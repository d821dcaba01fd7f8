"""``--max-model-len auto``: the longest max model len whose plan goes through, found before any weight loads.

Every part of a plan that grows with max model len grows with it monotonically: the block ids of one
sequence (each growing group and each sliding window), the sliding groups' chunk blocks and the step's
activation reserve (its attention over the longest context). So a length that plans implies every shorter
length plans, and the longest is found by halving the range between 2 (one prompt token and one generated
token) and the model's context length, each probe a whole resolve (well under a millisecond each, so 18
probes cost nothing beside a weight load). The plan at the found length is returned with a reason saying
which rule set it; a length below the model's context length also adds a warning, as vLLM warns when it
shortens the length after profiling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvforge.errors import PlanError
from kvforge.planner.kv_plan import KVPlan

#: The shortest sequence a plan takes: one prompt token and one generated token.
SHORTEST_MODEL_LEN = 2


def fit_max_model_len(longest: int, plan_at: Callable[[int, bool], KVPlan],
                      whose: str = "the model's context length") -> KVPlan:
    """The plan at the longest length in ``[2, longest]`` that ``plan_at(length, final)`` plans (PlanError
    otherwise). ``final`` is False for probes (the resolver then skips its baseline plan) and True for the
    returned plan; ``whose`` names where ``longest`` comes from. Raises PlanError, prefixed with the flag,
    where not even 2 tokens plan."""
    try:
        plan = plan_at(longest, True)
        return dataclasses.replace(plan, max_model_len_reason=f"auto: {whose} ({longest}) fits one sequence")
    except PlanError:
        pass
    try:
        plan_at(SHORTEST_MODEL_LEN, False)
    except PlanError as exc:
        raise PlanError(f"--max-model-len auto: no length plans, not even {SHORTEST_MODEL_LEN} tokens: {exc}") from exc
    lo, hi = SHORTEST_MODEL_LEN, longest - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            plan_at(mid, False)
            lo = mid
        except PlanError:
            hi = mid - 1
    plan = plan_at(lo, True)
    reason = f"auto: the longest that fits one sequence ({whose}, {longest}, does not)"
    warning = (f"--max-model-len auto planned {lo} tokens: one sequence of {whose} ({longest}) "
               f"does not fit; more KV memory per rank gives a longer one (--kv-cache-memory; on a GPU "
               f"--gpu-memory-utilization or --tensor-parallel-size)")
    return dataclasses.replace(plan, max_model_len_reason=reason, warnings=(*plan.warnings, warning))

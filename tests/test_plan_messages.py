"""The fixes a refused plan names are ones that work."""

import re

import pytest

from kvforge.errors import PlanError
from kvforge.planner.api import plan

GIB = 2**30
LLAMA_WEIGHTS = 8_030_261_248 * 2  # Llama-3.1-8B's parameters in bfloat16: 14.96 GiB


def refusal(**kw) -> str:
    with pytest.raises(PlanError) as exc:
        plan("llama-3.1-8b", device="cuda", **kw)
    return str(exc.value)


def named_utilization(text: str) -> float | None:
    found = re.search(r"--gpu-memory-utilization to (\d\.\d\d) or more", text)
    return float(found.group(1)) if found else None


@pytest.mark.parametrize("kw, says", [
    (dict(gpu_memory=20 * GIB, gpu_memory_utilization=0.7, max_model_len=1024), "weights need 14.96 GiB"),
    (dict(gpu_memory=18 * GIB, max_model_len=1024), "leave no KV memory"),  # weights + activations > 18 x 0.9
    (dict(gpu_memory=80 * GIB, gpu_memory_utilization=0.1), "weights need"),  # then one sequence of 131,072
    (dict(gpu_memory=80 * GIB, gpu_memory_utilization=0.19), "leave no KV memory"),
    (dict(gpu_memory=80 * GIB, gpu_memory_utilization=0.3), "holds less than one sequence"),
], ids=["weights", "activations", "weights-then-kv", "activations-then-kv", "kv"])
def test_the_named_utilization_plans_and_a_hundredth_less_does_not(kw, says):
    """Each refusal names the least utilization (in hundredths) that holds the weights, a step's activations
    and one sequence of max-model-len together: the plan at that value goes through, one hundredth below
    it is refused."""
    text = refusal(**kw)
    assert says in text
    least = named_utilization(text)
    assert least is not None, text
    kw = {k: v for k, v in kw.items() if k != "gpu_memory_utilization"}
    assert plan("llama-3.1-8b", device="cuda", gpu_memory_utilization=least, **kw).capacity.max_concurrency >= 1
    refusal(gpu_memory_utilization=round(least - 0.01, 2), **kw)


@pytest.mark.parametrize("kw", [dict(gpu_memory=14 * GIB, gpu_memory_utilization=1.0),  # weights > the device
                                dict(gpu_memory=16 * GIB, gpu_memory_utilization=1.0),  # weights + activations
                                dict(gpu_memory=18 * GIB)])  # no share of 18 GiB holds a 131,072-token sequence
def test_no_utilization_is_named_where_none_can_work(kw):
    text = refusal(**kw)
    assert "raise --tensor-parallel-size" in text or "lower --max-model-len" in text
    assert "--gpu-memory-utilization to" not in text and "or --gpu-memory-utilization" not in text

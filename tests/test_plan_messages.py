"""The fixes a refused plan names are ones that work."""

import pytest

from kvforge.errors import PlanError
from kvforge.planner.api import plan

GIB = 2**30
LLAMA_WEIGHTS = 8_030_261_248 * 2  # Llama-3.1-8B's parameters in bfloat16: 14.96 GiB


def refusal(**kw) -> str:
    with pytest.raises(PlanError) as exc:
        plan("llama-3.1-8b", device="cuda", **kw)
    return str(exc.value)


def test_weights_refusal_names_the_utilization_that_holds_them():
    # 16 GiB x 0.9 = 14.40 GiB < 14.96 GiB of weights; 16 GiB x 0.94 = 15.04 GiB holds them.
    assert LLAMA_WEIGHTS / (16 * GIB) == pytest.approx(0.9348, abs=1e-4)
    text = refusal(gpu_memory=16 * GIB)
    assert "weights need 14.96 GiB" in text and "--gpu-memory-utilization to 0.94 or more" in text
    assert "weights need" not in refusal(gpu_memory=16 * GIB, gpu_memory_utilization=0.94)


@pytest.mark.parametrize("kw", [dict(gpu_memory=14 * GIB, gpu_memory_utilization=1.0),  # weights > the device
                                dict(gpu_memory=16 * GIB, gpu_memory_utilization=1.0)])  # weights + activations
def test_no_utilization_is_named_where_none_can_work(kw):
    text = refusal(**kw)
    assert "raise --tensor-parallel-size" in text
    assert "--gpu-memory-utilization to" not in text and "or --gpu-memory-utilization" not in text


def test_activation_refusal_names_the_utilization_that_leaves_kv_memory():
    # 18 GiB x 0.9 = 16.2 GiB; the weights and a 8192-token step's activations need about 16.9 GiB (0.94 of 18).
    text = refusal(gpu_memory=18 * GIB)
    assert "leave no KV memory" in text and "--gpu-memory-utilization to 0.94 or more" in text
    kv = plan("llama-3.1-8b", device="cuda", gpu_memory=18 * GIB, gpu_memory_utilization=0.94, max_model_len=64)
    assert 0 < kv.capacity.kv_cache_memory < 32 * 2**20

"""The device-memory check before weights load (kvforge/engine/device_memory.py): the plan's weights,
activations and KV against what the device has free, and the fix it names, checked by planning again with
that fix (the planner, not the check, says what the fixed plan needs)."""

from __future__ import annotations

import re

import pytest
import torch

import kvforge
from kvforge.engine import device_memory, llm_engine
from kvforge.engine.device_memory import DeviceMemory, memory_shortfall
from kvforge.errors import ConfigError

GIB = 2**30
TOTAL = 141 * GIB


def _plan(**kw):
    return kvforge.plan("llama-3.1-8b", device="cuda", gpu_memory=TOTAL, **kw)


def _need(plan) -> int:
    return sum(device_memory.planned_bytes(plan))


def test_the_plan_takes_its_share_of_the_device():
    plan = _plan(gpu_memory_utilization=0.9)
    assert _need(plan) == int(TOTAL * 0.9)  # weights + activations + KV = the usable share
    assert memory_shortfall(plan, DeviceMemory(total=TOTAL, free=TOTAL - GIB), False, 0.9) is None


def test_another_process_on_the_device_is_named_with_a_utilization_that_fits():
    plan = _plan(gpu_memory_utilization=0.9)
    memory = DeviceMemory(total=TOTAL, free=100 * GIB)
    problem = memory_shortfall(plan, memory, False, 0.9)
    assert problem is not None and "41.00 GiB held by other processes" in problem
    utilization = float(re.search(r"--gpu-memory-utilization (\d\.\d\d) or less", problem).group(1))
    assert utilization == 0.70
    assert _need(_plan(gpu_memory_utilization=utilization)) <= memory.available
    room = float(re.search(r"--kv-cache-memory (\d+\.\d\d)GiB or less", problem).group(1))
    assert _need(_plan(kv_cache_memory=int(room * GIB))) <= memory.available


def test_an_explicit_kv_size_is_fixed_by_that_flag():
    plan = _plan(kv_cache_memory=60 * GIB)
    memory = DeviceMemory(total=TOTAL, free=50 * GIB)
    problem = memory_shortfall(plan, memory, True, 0.9)
    assert "--gpu-memory-utilization" not in problem
    room = float(re.search(r"--kv-cache-memory (\d+\.\d\d)GiB or less", problem).group(1))
    assert _need(_plan(kv_cache_memory=int(room * GIB))) <= memory.available
    assert memory_shortfall(plan, DeviceMemory(total=TOTAL, free=20 * GIB, reserved=60 * GIB, allocated=0),
                            True, 0.9) is None  # this process's cached bytes count


def test_weights_that_do_not_fit_at_all_say_so():
    problem = memory_shortfall(_plan(), DeviceMemory(total=TOTAL, free=10 * GIB), False, 0.9)
    assert "the weights and activations alone do not fit" in problem


def test_the_engine_refuses_before_loading_weights(monkeypatch):
    """A CUDA engine on a device with 20 GiB free: ConfigError from the check, no weight read."""
    monkeypatch.setattr(llm_engine, "pick_device", lambda requested: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * GIB, TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr("kvforge.weights.load_weights", no_weights)
    monkeypatch.setattr("kvforge.models.registry.build_model", no_weights)
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization 0\.14 or less"):
        kvforge.LLM("llama-3.1-8b", load_format="dummy", device="cuda", skip_tokenizer_init=True)


def test_a_failed_pool_allocation_names_the_fix(monkeypatch):
    from kvforge.engine.kv_pool import KVPool

    plan = kvforge.plan("llama-3.1-8b", kv_cache_memory=512 * 2**20, max_model_len=1024)
    monkeypatch.setattr(DeviceMemory, "of", classmethod(lambda cls, device: DeviceMemory(
        total=TOTAL, free=GIB, reserved=30 * GIB, allocated=3 * GIB)))

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "empty", out_of_memory)
    with pytest.raises(ConfigError, match=r"1\.00 GiB of the device are free and PyTorch's allocator holds "
                                          r"27\.00 GiB unused.*--gpu-memory-utilization"):
        KVPool(plan, "cpu")


def test_a_plan_for_more_memory_than_the_device_names_gpu_memory():
    """``--gpu-memory 200GiB`` on a 141 GiB device: the utilization that fits is a share of the 200 GiB."""
    plan = kvforge.plan("llama-3.1-8b", device="cuda", gpu_memory=200 * GIB, gpu_memory_utilization=0.9)
    memory = DeviceMemory(total=TOTAL, free=TOTAL - GIB)
    problem = memory_shortfall(plan, memory, False, 0.9, planned_device_bytes=200 * GIB)
    utilization = float(re.search(r"--gpu-memory-utilization (\d\.\d\d) or less of --gpu-memory 200\.00 GiB",
                                  problem).group(1))
    again = kvforge.plan("llama-3.1-8b", device="cuda", gpu_memory=200 * GIB, gpu_memory_utilization=utilization)
    assert _need(again) <= memory.available

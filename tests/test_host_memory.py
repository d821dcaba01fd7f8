"""The host-memory check of a CPU engine before weights load (kvforge/engine/host_memory.py): a model the
machine cannot hold is refused with the numbers and a fix, instead of loading until the kernel kills the
process; the fix it names is checked by planning again with it."""

from __future__ import annotations

import re

import pytest

import kvforge
from kvforge.engine import host_memory
from kvforge.engine.host_memory import available_host_bytes, host_memory_shortfall
from kvforge.errors import ConfigError

GIB = 2**30


def _plan(**kw):
    kw.setdefault("kv_cache_memory", GIB)  # the CPU engine's default
    return kvforge.plan("llama-3.1-8b", device="cpu", max_model_len=512, **kw)


def _need(plan) -> int:
    """The plan's bytes on one rank, read from its fields."""
    activations = plan.activations.bytes if plan.activations is not None else 0
    return plan.weights_bytes_per_rank + activations + plan.capacity.kv_cache_memory


def test_available_bytes_are_memavailable_and_free_swap(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:          100 kB\nMemAvailable:    1000 kB\n"
                       "SwapTotal:         64 kB\nSwapFree:          24 kB\n")
    assert available_host_bytes(str(meminfo), str(tmp_path / "none")) == (1000 + 24) * 1024
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:    2048 kB\n")  # no swap lines
    assert available_host_bytes(str(meminfo), str(tmp_path / "none")) == 2048 * 1024


def test_a_cgroup_limit_bounds_what_is_available(tmp_path):
    """In a container /proc/meminfo shows the host: the cgroup's limit less its use bounds it."""
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    meminfo.write_text("MemAvailable:    8000 kB\n")
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{6000 * 1024}\n")
    (cgroup / "memory.current").write_text(f"{1000 * 1024}\n")
    assert available_host_bytes(str(meminfo), str(cgroup)) == 5000 * 1024
    (cgroup / "memory.max").write_text("max\n")  # no limit
    assert available_host_bytes(str(meminfo), str(cgroup)) == 8000 * 1024
    (cgroup / "memory.max").write_text(f"{20000 * 1024}\n")  # a limit above what the host has
    assert available_host_bytes(str(meminfo), str(cgroup)) == 8000 * 1024
    assert available_host_bytes(str(meminfo), str(tmp_path / "none")) == 8000 * 1024


def test_reclaimable_page_cache_is_not_counted_as_use(tmp_path):
    """A cgroup's use includes file pages the kernel drops before it kills (a weight file read earlier):
    the inactive ones do not shrink the room, so a container that has read files is not refused."""
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    meminfo.write_text("MemAvailable:    8000 kB\n")
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{6000 * 1024}\n")
    (cgroup / "memory.current").write_text(f"{5000 * 1024}\n")
    (cgroup / "memory.stat").write_text(f"anon {1000 * 1024}\nfile {4000 * 1024}\ninactive_file {3000 * 1024}\n")
    assert available_host_bytes(str(meminfo), str(cgroup)) == (6000 - 2000) * 1024


def test_a_cgroup_v1_limit_bounds_what_is_available(tmp_path):
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    meminfo.write_text("MemAvailable:    8000 kB\n")
    (cgroup / "memory").mkdir(parents=True)
    v1 = cgroup / "memory"
    (v1 / "memory.limit_in_bytes").write_text(f"{6000 * 1024}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{3000 * 1024}\n")
    (v1 / "memory.stat").write_text(f"cache {2000 * 1024}\ntotal_inactive_file {500 * 1024}\n")
    assert available_host_bytes(str(meminfo), str(cgroup)) == (6000 - 2500) * 1024
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1 without a limit
    assert available_host_bytes(str(meminfo), str(cgroup)) == 8000 * 1024


def test_a_plan_that_fits_or_an_unknown_host_passes():
    plan = _plan()
    assert host_memory_shortfall(plan, 1, _need(plan)) is None
    assert host_memory_shortfall(plan, 1, None) is None


def test_weights_that_cannot_fit_name_the_smaller_dtype():
    plan = _plan()  # float32 on CPU: ~30 GiB of weights
    problem = host_memory_shortfall(plan, 1, 16 * GIB)
    assert problem is not None and "the weights alone do not fit" in problem and "--dtype bfloat16" in problem
    assert f"needs {_need(plan) / GIB:.2f} GiB" in problem and "16.00 GiB are available" in problem
    assert "--dtype" not in host_memory_shortfall(_plan(dtype="bfloat16"), 1, 8 * GIB)


def test_the_kv_size_it_names_fits():
    plan = _plan(dtype="bfloat16", kv_cache_memory=8 * GIB)
    available = _need(plan) - 3 * GIB
    problem = host_memory_shortfall(plan, 1, available)
    room = float(re.search(r"--kv-cache-memory (\d+\.\d\d)GiB or less", problem).group(1))
    assert _need(_plan(dtype="bfloat16", kv_cache_memory=int(room * GIB))) <= available


def test_every_tensor_parallel_rank_counts():
    plan = _plan(dtype="bfloat16")
    assert host_memory_shortfall(plan, 1, int(1.5 * _need(plan))) is None
    problem = host_memory_shortfall(plan, 2, int(1.5 * _need(plan)))
    assert problem is not None and "for 2 ranks" in problem


def test_the_engine_refuses_before_reading_weights(monkeypatch):
    import kvforge.weights

    def no_load(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(kvforge.weights, "load_weights", no_load)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 4 * GIB)
    with pytest.raises(ConfigError, match="needs .* GiB of host memory .* but 4.00 GiB are available"):
        kvforge.LLM("llama-3.1-8b", load_format="dummy", device="cpu", max_model_len=512)

"""Whether the host can hold what a CPU engine's plan sets aside, checked before any weight is read.

On CPU the weights (in the engine's dtype: float32 unless ``--dtype`` says otherwise) and the KV cache
live in the process's memory. A model larger than the machine's memory would otherwise load for minutes
and then be killed by the kernel's out-of-memory killer, with no message at all. The check compares the
plan's bytes, for every rank (tensor-parallel ranks on CPU are processes of this host), with the memory
the kernel reports available (``MemAvailable`` and free swap on Linux, within a container's cgroup v2 or v1 memory
limit; the free pages elsewhere) and refuses with the numbers and the fixes. Where the host reports nothing, nothing is checked.
"""

from __future__ import annotations

import os

from kvforge.engine.device_memory import GIB, planned_bytes
from kvforge.errors import ConfigError
from kvforge.planner.kv_plan import KVPlan

MEMINFO = "/proc/meminfo"
#: Where a container's memory cgroup is mounted (a container's /proc/meminfo shows the whole host).
CGROUP = "/sys/fs/cgroup"
#: (folder under ``CGROUP``, limit file, use file, the ``memory.stat`` key of reclaimable page cache):
#: cgroup v2, then v1. A v1 cgroup without a limit reports a limit near 2^63.
CGROUP_LAYOUTS = (
    ("", "memory.max", "memory.current", "inactive_file"),
    ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
)


def _cgroup_room(cgroup: str) -> int | None:
    """Bytes a memory cgroup can still grow: its limit less its use, where the use does not count the
    inactive page cache the kernel reclaims before it kills (the working set, as container runtimes
    count it). None where no limit is readable."""
    for folder, limit_file, use_file, reclaimable_key in CGROUP_LAYOUTS:
        base = os.path.join(cgroup, folder)
        try:
            with open(os.path.join(base, limit_file)) as f:
                limit = int(f.read().strip())  # "max" (no limit) raises ValueError
            with open(os.path.join(base, use_file)) as f:
                use = int(f.read().strip())
        except (OSError, ValueError):
            continue
        reclaimable = 0
        try:
            with open(os.path.join(base, "memory.stat")) as f:
                stats = dict(line.split(None, 1) for line in f if line.strip())
            reclaimable = int(stats.get(reclaimable_key, "0"))
        except (OSError, ValueError):
            pass
        return max(0, limit - max(0, use - reclaimable))
    return None


def available_host_bytes(meminfo: str = MEMINFO, cgroup: str = CGROUP) -> int | None:
    """Bytes the host can give this process now: ``MemAvailable + SwapFree`` from ``meminfo`` where it
    exists, else the free physical pages (``sysconf``), else None; within a cgroup memory limit (v2 or
    v1), at most the limit less the cgroup's working set."""
    host = None
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        host = 1024 * (int(fields["MemAvailable"].split()[0]) + int(fields.get("SwapFree", "0 kB").split()[0]))
    except (OSError, KeyError, ValueError):
        try:
            host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):
            pass
    room = _cgroup_room(cgroup)
    if room is None:
        return host
    return room if host is None else min(host, room)


def host_memory_shortfall(plan: KVPlan, ranks: int, available: int | None) -> str | None:
    """None when ``ranks`` copies of the plan's per-rank bytes fit in ``available`` (or it is unknown);
    else the error text naming what is needed, what is available and the fixes."""
    if available is None:
        return None
    weights, activations, kv = planned_bytes(plan)
    need = ranks * (weights + activations + kv)
    if need <= available:
        return None
    of_ranks = f" for {ranks} ranks" if ranks > 1 else ""
    head = (f"the CPU engine needs {need / GIB:.2f} GiB of host memory{of_ranks} (weights {ranks * weights / GIB:.2f}"
            f" + KV cache {ranks * kv / GIB:.2f}"
            + (f" + activations {ranks * activations / GIB:.2f}" if activations else "")
            + f" GiB) but {available / GIB:.2f} GiB are available")
    room = available - ranks * (weights + activations)
    if room <= 0:
        smaller = " or --dtype bfloat16 (weights are float32 here)" if plan.model_dtype == "float32" else ""
        return (f"{head}; the weights alone do not fit: run a smaller model{smaller}, or on a machine with more "
                f"memory")
    return f"{head}; fix: --kv-cache-memory {room / ranks / GIB:.2f}GiB or less, or free memory"


def check_host_memory(plan: KVPlan, ranks: int) -> None:
    """ConfigError (before any weight is read) when this host cannot hold ``ranks`` copies of the plan's
    per-rank bytes now."""
    problem = host_memory_shortfall(plan, ranks, available_host_bytes())
    if problem is not None:
        raise ConfigError(problem)

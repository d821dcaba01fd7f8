"""Whether the device can hold what the plan sets aside, checked before any weight is read.

The plan sizes the KV cache from the device's total memory (``--gpu-memory-utilization`` of it, less the
weights and the activation reserve) or takes ``--kv-cache-memory``; either way it assumes this process can
get ``weights + activations + KV`` bytes. Another process on the same GPU, or a second engine in this one,
breaks that assumption, and without this check the KV pool's one allocation fails only after the weights
are loaded (minutes for a large checkpoint), as a bare out-of-memory error.

:func:`memory_shortfall` compares the plan's bytes with what this process can allocate now: the device's
free memory plus what PyTorch's caching allocator holds unused. :func:`pool_allocation_error` explains an
allocation that fails anyway (memory the allocator keeps in pieces, another process starting meanwhile).
Both name the numbers and the flag that fixes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.errors import ConfigError
from kvforge.planner.kv_plan import KVPlan

GIB = 2**30


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of one device as this process sees them: ``total``, ``free`` (the driver's count: what no
    process holds), and this process's caching allocator's ``reserved`` bytes, ``allocated`` of them in use."""

    total: int
    free: int
    reserved: int = 0
    allocated: int = 0

    @property
    def cached(self) -> int:
        """Held by this process's allocator, unused."""
        return self.reserved - self.allocated

    @property
    def available(self) -> int:
        """What this process can allocate: the free bytes and its own cached ones."""
        return self.free + self.cached

    @property
    def held_elsewhere(self) -> int:
        """Held outside this process's allocator: other processes, CUDA contexts."""
        return max(0, self.total - self.free - self.reserved)

    @classmethod
    def of(cls, device: torch.device) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(total=total, free=free, reserved=torch.cuda.memory_reserved(device),
                   allocated=torch.cuda.memory_allocated(device))


def planned_bytes(plan: KVPlan) -> tuple[int, int, int]:
    """The plan's (weights, activations, KV) bytes per rank; the weights include a draft's."""
    weights = plan.weights_bytes_per_rank + (plan.draft.weights_bytes_per_rank if plan.draft is not None else 0)
    activations = plan.activations.bytes if plan.activations is not None else 0
    return weights, activations, plan.capacity.kv_cache_memory or 0


def memory_shortfall(plan: KVPlan, memory: DeviceMemory, kv_from_flag: bool, utilization: float,
                     planned_device_bytes: int | None = None) -> str | None:
    """None when the plan's bytes fit in ``memory.available``; else the error text: what the plan needs,
    what is free, and the fix (``kv_from_flag``: the KV size came from ``--kv-cache-memory``, else from
    ``utilization`` of ``planned_device_bytes``, ``--gpu-memory`` where given, else the device's total)."""
    weights, activations, kv = planned_bytes(plan)
    need = weights + activations + kv
    if need <= memory.available:
        return None
    head = (f"the plan needs {need / GIB:.2f} GiB of the device (weights {weights / GIB:.2f} + activations "
            f"{activations / GIB:.2f} + KV cache {kv / GIB:.2f} GiB) but {memory.available / GIB:.2f} GiB of its "
            f"{memory.total / GIB:.2f} GiB are free ({memory.held_elsewhere / GIB:.2f} GiB held by other processes "
            f"and CUDA contexts)")
    fixed = weights + activations
    if fixed >= memory.available:
        return (f"{head}; the weights and activations alone do not fit: free the device, lower "
                f"--max-num-batched-tokens, or raise --tensor-parallel-size")
    room = memory.available - fixed
    if kv_from_flag:
        return f"{head}; fix: --kv-cache-memory {room / GIB:.2f}GiB or less, or free the device"
    # The largest utilization whose plan fits: (weights + activations + KV) = utilization x planned bytes.
    planned = planned_device_bytes or memory.total
    fits = int(memory.available / planned * 100) / 100
    of = "" if planned_device_bytes is None else f" of --gpu-memory {planned / GIB:.2f} GiB"
    return (f"{head}; fix: --gpu-memory-utilization {fits:.2f} or less{of} (now {utilization}), "
            f"--kv-cache-memory {room / GIB:.2f}GiB or less, or free the device")


def check_device_memory(plan: KVPlan, device: torch.device, kv_from_flag: bool, utilization: float,
                        planned_device_bytes: int | None = None) -> None:
    """ConfigError (before any weight is read) when ``device`` cannot hold the plan's bytes now
    (``planned_device_bytes``: ``--gpu-memory`` where the plan was made for that much)."""
    problem = memory_shortfall(plan, DeviceMemory.of(device), kv_from_flag, utilization, planned_device_bytes)
    if problem is not None:
        raise ConfigError(problem)


def pool_allocation_error(nbytes: int, device: torch.device, error: BaseException) -> ConfigError:
    """The KV pool's allocation of ``nbytes`` failed after the weights: the error to raise instead."""
    memory = DeviceMemory.of(device)
    return ConfigError(
        f"the KV pool's {nbytes / GIB:.2f} GiB could not be allocated after the weights: {memory.free / GIB:.2f} "
        f"GiB of the device are free and PyTorch's allocator holds {memory.cached / GIB:.2f} GiB unused, not in "
        f"one piece ({type(error).__name__}); fix: lower --gpu-memory-utilization or set --kv-cache-memory")

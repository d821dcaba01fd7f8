"""One engine's process group: rank, world size, the device group and a gloo
group for host-side step inputs, with a timeout on every collective."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from kvforge.errors import DistributedError

__all__ = ["DistributedError", "TPGroup", "destroy_group", "init_group"]


@dataclass
class TPGroup:
    rank: int
    world_size: int
    backend: str                 # "gloo" or "nccl"
    device: torch.device
    timeout_s: float
    cpu_group: object = None     # gloo group for host arrays (the default group when backend is gloo)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def all_reduce_max_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def gather_to_0(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0 gets every rank's ``t`` (same shape everywhere); others get None."""
        t = t.contiguous()
        if self.rank == 0:
            out = [torch.empty_like(t) for _ in range(self.world_size)]
            dist.gather(t, out, dst=0)
            return out
        dist.gather(t, None, dst=0)
        return None

    def broadcast_device_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place broadcast of ``t`` from rank 0 over the device group (NCCL on GPUs, gloo on CPU)."""
        dist.broadcast(t, 0)
        return t

    def broadcast_host(self, arr: np.ndarray | None, dtype, n: int) -> np.ndarray:
        """Broadcast a 1-D host array of ``n`` elements from rank 0 over the gloo group."""
        if self.rank == 0:
            t = torch.from_numpy(np.ascontiguousarray(arr, dtype=dtype))
        else:
            t = torch.empty(n, dtype=torch.from_numpy(np.empty(0, dtype=dtype)).dtype)
        if n:
            dist.broadcast(t, 0, group=self.cpu_group)
        return t.numpy()


def init_group(rank: int, world_size: int, store, backend: str, device: torch.device,
               timeout_s: float) -> TPGroup:
    """Join the default process group through ``store`` (a TCPStore shared with rank 0)."""
    if dist.is_initialized():
        raise DistributedError("this process already has a torch.distributed process group; run one "
                               "tensor-parallel engine per process (call shutdown() on the previous one)")
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return TPGroup(rank, world_size, backend, device, timeout_s, cpu_group)


def destroy_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a peer may already be gone
            pass

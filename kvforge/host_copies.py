"""Small host values to the device, and device results to the host, without a host wait.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then synchronizes the stream: the
host waits for every kernel queued before it. On the engine's hot paths (input building, sampling, penalties,
proposals) that would stall overlapped scheduling behind the step in flight, so host values go through
:func:`values_to_device` instead.
"""

from __future__ import annotations

import torch


def values_to_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (a list, a numpy array or a CPU tensor) as ``dtype`` on ``device``, copied without waiting:
    staged in pinned memory and copied ``non_blocking`` on CUDA; on the CPU a plain conversion. The caching
    host allocator keeps the pinned block until the copy is done."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def start_host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host tensor that receives ``t`` (on CUDA: pinned, copied ``non_blocking``, complete once the work
    queued so far is; read it after an event recorded later has fired); ``t`` itself on the CPU."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out

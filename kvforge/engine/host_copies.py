"""Small host arrays to the device without a host wait."""

from __future__ import annotations

import torch


def ints_on_device(values, device: torch.device) -> torch.Tensor:
    """int64 ``values`` (a list, a numpy array or a CPU tensor) on ``device``, copied without waiting: staged
    in pinned memory and copied ``non_blocking`` on CUDA (a pageable copy would stage through the driver);
    on the CPU a plain conversion. The caching host allocator keeps the pinned block until the copy is done."""
    t = torch.as_tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)

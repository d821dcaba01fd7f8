"""A torch function mode that records host-to-device copies which would block the host on CUDA."""

from __future__ import annotations

import torch


class BlockingCopies(torch.overrides.TorchFunctionMode):
    """Records host-to-device copies that would block the host on CUDA: ``torch.tensor`` / ``torch.as_tensor``
    given a device (a pageable copy, then a stream synchronize) and ``Tensor.to`` a device without
    ``non_blocking``. On the CPU the same calls are made, so the rule is checked without a GPU (pinning the
    source, which a non-blocking copy also needs on CUDA, is kvforge/host_copies.py's; tests/test_host_copies_gpu.py
    checks the stream is never synchronized)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.calls.append(name)
        elif name == "to" and not kwargs.get("non_blocking") and (
                "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])):
            self.calls.append(name)
        return func(*args, **kwargs)


"""Peak bytes of live tensors while a block of code runs, counted from the allocations it makes.

Every tensor an operator returns is attributed to its storage; the storage's bytes count from its first
sight until the storage is freed (torch keeps one Python object per storage, so a weak reference to it
dies with the storage). Tensors that exist before the block (weights, inputs) are not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorPeak(TorchDispatchMode):
    """``with LiveTensorPeak() as m: ...``; then ``m.peak`` is the most bytes alive at once."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self._before: set[int] = set()

    def ignore(self, *tensors: torch.Tensor) -> None:
        """Storages that existed before the block (outputs of in-place ops on them are not new)."""
        self._before.update(t.untyped_storage().data_ptr() for t in tensors)

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self._seen or key in self._before:
                continue
            self._seen.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, nbytes)
        return out

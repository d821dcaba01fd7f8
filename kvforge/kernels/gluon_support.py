"""The Gluon imports every ``gluon_*`` module shares, and the Gluon gate evaluated for a device.

The gate's rule (tested Triton versions, compute capability, ``KVFORGE_DISABLE_GLUON``) is data in
:mod:`kvforge.attention.routing.platform`; this module only asks the installed Triton and the device.
"""

from __future__ import annotations

import functools

import torch

from kvforge.attention.routing.platform import DEFAULT_NUM_SMS, Device, gluon_enabled, gluon_runs_on_device
from kvforge.env import ENV

try:  # Gluon ships with Triton >= 3.5; the CPU engine needs neither.
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    HAS_GLUON = True
except ImportError:  # pragma: no cover
    triton = gluon = gl = async_copy = mma_v2 = None
    HAS_GLUON = False

#: Decided once at import (why global: the installed Triton and the environment do not change while the
#: process runs, and every decode call asks).
GLUON_ENABLED: bool = HAS_GLUON and gluon_enabled(getattr(triton, "__version__", None), ENV.disable_gluon)


@functools.cache  # a device's compute capability never changes in a process
def _capability_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """SM count of a CUDA device (cached); ``DEFAULT_NUM_SMS`` for other devices (the Triton interpreter)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def gluon_runs_on(t: torch.Tensor | torch.device) -> bool:
    """True when the Gluon kernels may launch for a tensor (or on a device) here."""
    device = t if isinstance(t, torch.device) else t.device
    if not (GLUON_ENABLED and device.type == "cuda"):
        return False
    return gluon_runs_on_device(GLUON_ENABLED, True, _capability_major(device.index))


_DEVICES: dict[torch.device, Device] = {}


def routing_device(t: torch.Tensor | torch.device) -> Device:
    """What the routing tables need to know about the device of ``t`` (cached: neither fact changes while
    the process runs)."""
    device = t if isinstance(t, torch.device) else t.device
    known = _DEVICES.get(device)
    if known is None:
        known = _DEVICES[device] = Device(num_sms=num_sms(device), gluon=gluon_runs_on(device))
    return known

"""Whether the Gluon kernels may run here: one gate for every ``gluon_*`` module.

Gluon (``triton.experimental.gluon``) is experimental and its API moves between Triton releases:
3.9 removed ``async_copy_global_to_shared``, which these kernels use. So they run only on the Triton
minor versions they were tested on, and only on Hopper (sm_90, the one GPU they were measured on).
Everywhere else the tl.dot kernels serve. ``KVFORGE_DISABLE_GLUON=1`` turns them off as well.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Gluon ships with Triton >= 3.5; the CPU engine needs neither.
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    HAS_GLUON = True
except ImportError:  # pragma: no cover
    triton = gluon = gl = async_copy = mma_v2 = None
    HAS_GLUON = False

TESTED_TRITON_VERSIONS: tuple[str, ...] = ("3.6",)
TESTED_COMPUTE_CAPABILITY_MAJOR: int = 9


def gluon_enabled(triton_version: str | None, env: str | None) -> bool:
    """The gate, as a pure function of the Triton version and ``KVFORGE_DISABLE_GLUON``."""
    if triton_version is None:
        return False
    tested = ".".join(triton_version.split(".")[:2]) in TESTED_TRITON_VERSIONS
    return tested and (env or "0").strip().lower() in ("", "0", "false", "no")


#: Decided once at import (why global: the installed Triton and the environment do not change while the
#: process runs, and every decode call asks).
GLUON_ENABLED: bool = HAS_GLUON and gluon_enabled(
    getattr(triton, "__version__", None), os.environ.get("KVFORGE_DISABLE_GLUON")
)


@functools.cache  # a device's compute capability never changes in a process
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def gluon_runs_on(t: torch.Tensor) -> bool:
    """True when the Gluon kernels may launch for a tensor on this device."""
    return GLUON_ENABLED and t.is_cuda and _capability(t.device.index)[0] == TESTED_COMPUTE_CAPABILITY_MAJOR

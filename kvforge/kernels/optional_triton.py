"""Triton where it is installed: ``triton``, ``tl`` (``triton.language``) and ``HAS_TRITON``.

The CPU engine never needs Triton, so the kernel modules import these three names from here: on a machine
without Triton the modules still import (``triton`` and ``tl`` are None, ``HAS_TRITON`` is False) and their
launchers refuse with a clear error.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "tl", "triton"]

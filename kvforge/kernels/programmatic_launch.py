"""Programmatic dependent launch (compute capability 9.0 and later) for the kernels of a decode step.

A kernel launched with ``launch_pdl=True`` may be scheduled before the kernel ahead of it in the stream has
finished, so its launch overlaps that kernel's last programs instead of following them. A kernel that takes
part keeps one contract, through the two calls below under its ``PDL`` constexpr:

* :func:`wait_for_previous_kernel` first, before it reads or writes any memory another kernel touches: it
  returns once the kernel ahead has finished and its writes are visible (``griddepcontrol.wait``).
* :func:`allow_next_kernel` after its last store: the next kernel may launch once every program has called
  it or exited (``griddepcontrol.launch_dependents``). Letting it launch earlier, right after the wait, made
  a batch-1 step's products slower (the waiting programs of the next launch took SM slots); so does each
  program's L2 prefetch of its own first weight bytes before the wait (docs/BENCHMARKS.md, "One-row
  products of a decode step, back to back").

A kernel launched without the attribute waits for everything ahead of it as usual, and both instructions
are no-ops in a kernel launched without it, so the order of kernels with and without it is free. The
interpreter runs no inline PTX: :func:`supported` is False there, and the kernels compile without the calls.
"""

from __future__ import annotations

import functools
import os

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

#: Launch the participating kernels with programmatic dependent launch where the GPU has it.
ENABLED = True
#: The first compute capability with ``griddepcontrol``.
MIN_CAPABILITY_MAJOR = 9


@functools.cache
def _capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= MIN_CAPABILITY_MAJOR


def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch: ``ENABLED``, a compiled
    (not interpreted) Triton and a CUDA GPU of compute capability 9 or later."""
    if not (ENABLED and HAS_TRITON) or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capable(device)


if HAS_TRITON:

    @triton.jit
    def wait_for_previous_kernel(PDL: tl.constexpr):
        """Return once the kernel ahead in the stream has finished and its writes are visible (``PDL``)."""
        if PDL:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def allow_next_kernel(PDL: tl.constexpr):
        """Let the next kernel in the stream launch once every program has called this or exited (``PDL``)."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()

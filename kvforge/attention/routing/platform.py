"""Where the Gluon kernels may run, as data, and the facts about a device that routing reads.

Gluon (``triton.experimental.gluon``) is experimental and its API moves between Triton releases (3.9
removed ``async_copy_global_to_shared``, which these kernels use), so the Gluon kernels run only on the
Triton minor versions and the compute capability they were tested on, and not when
``KVFORGE_DISABLE_GLUON`` is set (:mod:`kvforge.env`). Everywhere else the tl.dot kernels serve.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Triton minor versions the Gluon kernels were tested on.
GLUON_TRITON_VERSIONS: tuple[str, ...] = ("3.6",)
#: Compute capability major the Gluon kernels were tested on (Hopper, sm_90).
GLUON_COMPUTE_CAPABILITY_MAJOR: int = 9
#: SM count assumed where there is no CUDA device to ask (the Triton interpreter, CPU tests): an H100/H200.
DEFAULT_NUM_SMS: int = 132


def gluon_enabled(triton_version: str | None, disabled: bool) -> bool:
    """The process-wide part of the gate: a tested Triton is installed and the switch is not set."""
    if triton_version is None:
        return False
    return ".".join(triton_version.split(".")[:2]) in GLUON_TRITON_VERSIONS and not disabled


def gluon_runs_on_device(enabled: bool, is_cuda: bool, compute_capability_major: int | None) -> bool:
    """The whole gate for one device: enabled in this process, a CUDA device, the tested architecture."""
    return enabled and is_cuda and compute_capability_major == GLUON_COMPUTE_CAPABILITY_MAJOR


@dataclass(frozen=True)
class Device:
    """What routing needs to know about the device a batch runs on."""

    num_sms: int = DEFAULT_NUM_SMS
    gluon: bool = False  # the Gluon gate is open for this device (:func:`gluon_runs_on`)

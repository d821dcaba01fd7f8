"""Every kernel switch kvforge reads from the environment, typed, in one place (the server's
``KVFORGE_API_KEY`` and the evaluators' ``KVFORGE_DATA_DIR`` are read where they are used).

The environment is read once, at import, into the frozen :data:`ENV` (the installed process does not
change its mind while it runs). Switches that a user chooses per engine (the MLA prefill mode, the query
dtype, ...) are engine arguments (:class:`kvforge.config.EngineArgs`), not environment variables; what
stays here turns an optional accelerated path off for the whole process.

=================================  ==========================================================================
``KVFORGE_DISABLE_GLUON``          any value but ``""``/``0``/``false``/``no`` turns the Gluon kernels off
                                   (the tl.dot kernels serve; kvforge/kernels/gluon_support.py)
``KVFORGE_DISABLE_FUSED_KERNELS``  the same, for the fused Triton RMSNorm/rope/SiLU kernels, the MoE
                                   row bookkeeping (kvforge/models/expert_rows.py) and the softmax
                                   router's top-k (kvforge/models/router_topk.py) on CUDA
``KVFORGE_DISABLE_SDPA_PREFILL``   the same, for long prefill chunks of the Triton paged backend through
                                   torch's fused attention (the kernels serve every sequence;
                                   kvforge/attention/routing/paged.py)
``KVFORGE_SMALL_M_LINEAR``         ``1``/``0`` turns the small-M Triton linear kernel on or off for decode
                                   steps on CUDA; unset: its default (kvforge/models/linear_route.py)
``KVFORGE_SMALL_M_PROLOGUES``      ``1``/``0`` lets that kernel compute its one-row input from the layer before
                                   (add + RMSNorm, SiLU-and-mul) instead of separate kernels; unset: its default
``KVFORGE_TRITON_EXPERT_GEMM``     ``1``/``0`` turns the Triton routed-experts kernel on or off for MoE steps of
                                   few rows on CUDA; unset: its default (kvforge/models/expert_gemm_route.py)
``KVFORGE_SDPA_PREFILL_CUDNN``     lets torch pick cuDNN's fused attention for those prefill chunks and MLA's
                                   sdpa prefill (off: flash, memory-efficient or math only; cuDNN builds a plan
                                   per new shape, kvforge/attention/end_aligned_sdpa.py)
=================================  ==========================================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

_OFF_VALUES = ("", "0", "false", "no")


def switch_is_on(value: str | None) -> bool:
    """A boolean switch: unset, empty, ``0``, ``false`` and ``no`` (any case, spaces ignored) are off."""
    return (value or "0").strip().lower() not in _OFF_VALUES


@dataclass(frozen=True)
class Env:
    """The process's environment switches (see the module docstring)."""

    disable_gluon: bool = False
    disable_fused_kernels: bool = False
    small_m_linear: bool | None = None  # None: unset, the route's default
    small_m_prologues: bool | None = None  # None: unset, the route's default
    disable_sdpa_prefill: bool = False
    sdpa_prefill_cudnn: bool = False
    triton_expert_gemm: bool | None = None  # None: unset, the route's default


def read_env(environ: Mapping[str, str]) -> Env:
    """The switches as set in ``environ`` (``os.environ`` for :data:`ENV`)."""
    return Env(
        disable_gluon=switch_is_on(environ.get("KVFORGE_DISABLE_GLUON")),
        disable_fused_kernels=switch_is_on(environ.get("KVFORGE_DISABLE_FUSED_KERNELS")),
        small_m_linear=_optional_switch(environ.get("KVFORGE_SMALL_M_LINEAR")),
        small_m_prologues=_optional_switch(environ.get("KVFORGE_SMALL_M_PROLOGUES")),
        disable_sdpa_prefill=switch_is_on(environ.get("KVFORGE_DISABLE_SDPA_PREFILL")),
        sdpa_prefill_cudnn=switch_is_on(environ.get("KVFORGE_SDPA_PREFILL_CUDNN")),
        triton_expert_gemm=_optional_switch(environ.get("KVFORGE_TRITON_EXPERT_GEMM")),
    )


def _optional_switch(value: str | None) -> bool | None:
    """A switch whose absence (unset or empty) leaves the choice to the code's default."""
    return None if value is None or not value.strip() else switch_is_on(value)


#: Read once at import (why global: the environment of a running process is fixed; every reader asks).
ENV: Env = read_env(os.environ)

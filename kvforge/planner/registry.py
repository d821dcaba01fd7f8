"""The built-in backend declarations, in one explicit list.

No global mutable registry: the resolver takes the list it should consider,
and tests pass their own (built-ins plus test backends) to exercise negotiation.
"""

from __future__ import annotations

from kvforge.planner.declaration import BackendDeclaration


def builtin_backends() -> tuple[BackendDeclaration, ...]:
    from kvforge.attention.mla_reference_backend import MLA_REFERENCE
    from kvforge.attention.reference_backend import REFERENCE
    from kvforge.attention.ring_backend import RING
    from kvforge.attention.triton_backend import TRITON_PAGED
    from kvforge.attention.triton_mla_backend import TRITON_MLA

    return (TRITON_PAGED, TRITON_MLA, MLA_REFERENCE, REFERENCE, RING)

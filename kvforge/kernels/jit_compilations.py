"""Counting Triton's JIT compilations: ``with JitCompilations() as log: ...`` then ``log.names``.

Triton calls its ``jit_cache_hook`` before every compilation in the process (a hit in its disk cache
included), never for a kernel variant this process already built. While the context is open the hook
records the kernel's name and lets the compilation go on; on exit the hook in place before is restored.
Without Triton, or in Triton's CPU interpreter (which compiles nothing), nothing is recorded.
"""

from __future__ import annotations

from kvforge.kernels.optional_triton import HAS_TRITON


class JitCompilations:
    def __init__(self):
        self.names: list[str] = []
        self._previous = None

    def __enter__(self) -> JitCompilations:
        if HAS_TRITON:
            from triton import knobs

            self._previous = knobs.runtime.jit_cache_hook

            def record(*, fn, **_):
                self.names.append(fn.name)
                return False  # compile as usual

            knobs.runtime.jit_cache_hook = record
        return self

    def __exit__(self, *exc) -> None:
        if HAS_TRITON:
            from triton import knobs

            knobs.runtime.jit_cache_hook = self._previous

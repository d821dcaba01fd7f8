"""``JitCompilations`` records what Triton's JIT hook reports while open and restores the hook after."""

from __future__ import annotations

import types

import pytest

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402

from kvforge.kernels.jit_compilations import JitCompilations  # noqa: E402


def _report(name):
    """What Triton does before compiling a kernel variant: call the hook; a true result skips the compile."""
    hook = knobs.runtime.jit_cache_hook
    return hook(key=(), repr=name, fn=types.SimpleNamespace(name=name), compile={}, is_manual_warmup=False,
                already_compiled=False) if hook else None


def test_records_names_and_lets_compilation_proceed():
    previous = knobs.runtime.jit_cache_hook
    with JitCompilations() as log:
        assert _report("_a_kernel") is False
        assert _report("_b_kernel") is False
    assert log.names == ["_a_kernel", "_b_kernel"]
    assert knobs.runtime.jit_cache_hook is previous


def test_nested_logs_restore_in_order():
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        with JitCompilations() as outer:
            with JitCompilations() as inner:
                _report("_x")
            _report("_y")
        _report("_z")
        assert (inner.names, outer.names, seen) == (["_x"], ["_y"], ["_z"])
    finally:
        knobs.runtime.jit_cache_hook = None

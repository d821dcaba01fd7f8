"""Where the Triton kernel tests run: compiled on a CUDA GPU, else in Triton's CPU interpreter.

tests/conftest.py sets ``TRITON_INTERPRET=1`` on a machine without CUDA before any kernel module is
imported (Triton reads it when a kernel is defined). The same tests then launch the ``tl.*`` kernels on
CPU tensors, where the interpreter evaluates every op with numpy: slowly (tests keep shapes tiny there)
and, in the places named below, not as the GPU does. A test that reaches one of those places skips with
the constant as its reason, for that case only. Gluon kernels never run in the interpreter.

Triton is a test dependency (``pip install -e '.[test]'``): without it the kernel test modules fail to
import instead of skipping, so a test run cannot silently leave the kernels out.
"""

from __future__ import annotations

import functools

import pytest
import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - an environment without the test extras
    raise ImportError("the Triton kernel tests need triton: pip install -e '.[test]'") from e

#: True when Triton interprets kernels on the CPU instead of compiling them.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
#: The device the kernel tests put their tensors on.
DEVICE: str = "cpu" if INTERPRETED else "cuda"
#: Whether the ``tl.*`` kernels can run here at all.
KERNELS_RUN: bool = INTERPRETED or torch.cuda.is_available()

requires_kernels = pytest.mark.skipif(
    not KERNELS_RUN, reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (TRITON_INTERPRET=0 is set)"
)
_gpu_skip = pytest.mark.skipif(
    INTERPRETED or not torch.cuda.is_available(),
    reason="GPU only: long contexts, many heads or CUDA-only features (the interpreted cases cover the logic)",
)


def gpu_only(test):
    """Mark ``test`` ``gpu`` and skip it unless the kernels run compiled on a CUDA GPU."""
    return pytest.mark.gpu(_gpu_skip(test))


#: The reason Gluon tests skip: Gluon kernels are compiled for one GPU generation and never interpreted.
GLUON_GPU_ONLY = (
    "Gluon kernel: GPU only (sm_90 with a tested Triton, kvforge/kernels/gluon_support.py); "
    "Triton's interpreter does not run Gluon"
)


def gluon_gpu_only(test):
    """Mark ``test`` ``gpu`` and skip it unless compiled kernels run on a CUDA GPU (Gluon tests)."""
    skip = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason=GLUON_GPU_ONLY)
    return pytest.mark.gpu(skip(test))

# What the interpreter does differently from the GPU (measured on Triton 3.6 and 3.9).
BF16_DOT = "interpreter: tl.dot multiplies bfloat16 operands as their raw uint16 bit patterns"
BF16_ROUNDING = "interpreter: float32 -> bfloat16 casts truncate instead of rounding to nearest even"
FP8_ROUNDING = (
    "interpreter: float32 -> fp8 casts round ties away from zero and drop the carry into the exponent "
    "(1.97 -> e4m3 gives 1.0, not 2.0)"
)
LOOP_BOUND = (
    "interpreter: this Triton turns a loaded loop bound into an int with int(array of shape (1,)), which "
    "NumPy >= 2.4 refuses, and its interpreter has no _patch_lang_tensor to convert with .item() instead"
)


if INTERPRETED:
    from triton.runtime import interpreter as _interpreter

    @triton.jit
    def _sum_below(n_ptr, out_ptr):
        acc = 0
        for i in range(0, tl.load(n_ptr)):
            acc += i
        tl.store(out_ptr, acc)


def _loop_over_loaded_bound_runs() -> bool:
    out = torch.zeros(1, dtype=torch.int32)
    try:
        _sum_below[(1,)](torch.tensor([4], dtype=torch.int32), out)
    except triton.runtime.errors.InterpreterError as e:
        if "0-dimensional" in str(e):
            return False
        raise
    assert int(out) == 6, f"interpreter: sum of range(4) gave {int(out)}"
    return True


def _index_scalars_with_item() -> None:
    """Make the interpreter convert a scalar tensor (a numpy array of shape (1,)) to an index with
    ``.item()``, as later Triton releases do (triton-lang/triton#9171), where it uses ``int(array)``."""
    original = _interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    _interpreter._patch_lang_tensor = patch_lang_tensor


@functools.cache  # the installed Triton and NumPy do not change while the tests run
def loaded_loop_bounds_work() -> bool:
    """Whether a ``range`` over a loaded bound runs here (the attention kernels' context loops); where
    the interpreter's scalar conversion fails under NumPy >= 2.4 it is switched to ``.item()`` first."""
    if not INTERPRETED or _loop_over_loaded_bound_runs():
        return True
    if not hasattr(_interpreter, "_patch_lang_tensor"):
        return False
    _index_scalars_with_item()
    return _loop_over_loaded_bound_runs()


def skip_unless_loaded_loop_bounds_work() -> None:
    if not loaded_loop_bounds_work():
        pytest.skip(LOOP_BOUND)



def route_fixture(module, switch: str, devices: str):
    """A fixture ``device`` that runs a test once per path of a route with a module-level switch: "torch"
    turns ``module.switch`` off (the PyTorch reference, tensors on the CPU); "triton" turns it on and lists
    :data:`DEVICE` in ``module.devices`` (skipped where the kernels cannot run). Autograd is off, as in the
    engine: the kernels are inference-only. The fixture's value is the device the tensors go to."""

    @pytest.fixture(params=["torch", "triton"])
    def device(request, monkeypatch):
        if request.param == "torch":
            monkeypatch.setattr(module, switch, False)
            dev = "cpu"
        elif not KERNELS_RUN:
            pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
        else:
            monkeypatch.setattr(module, switch, True)
            monkeypatch.setattr(module, devices, (DEVICE,))
            dev = DEVICE
        with torch.no_grad():
            yield dev

    return device

"""``make test-gpu``'s list (tests/gpu_test_files.txt) names files that exist, and every test file with a
test that needs a CUDA device (a CUDA check, or the kernel tests' GPU-only marks) is on it (but the
activation-reserve test, which the target runs alone)."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).parent
ALONE = {"tests/test_activation_reserve_gpu.py"}


def _listed() -> list[str]:
    return [line.strip() for line in (TESTS / "gpu_test_files.txt").read_text().splitlines() if line.strip()]


def test_every_listed_file_exists_once():
    listed = _listed()
    assert len(listed) == len(set(listed))
    assert [p for p in listed if not (TESTS.parent / p).is_file()] == []


def test_every_cuda_test_file_is_listed():
    marks = ("cuda.is_available()", "@gpu_only", "@gluon_gpu_only")  # the last two: tests/triton_kernel_device.py
    needs_cuda = {f"tests/{p.name}" for p in TESTS.glob("test_*.py")
                  if p.name != Path(__file__).name and any(m in p.read_text() for m in marks)}
    assert needs_cuda - set(_listed()) - ALONE == set()

"""benchmarks/bench_host_step.py builds an LLMEngine by hand around a stubbed model; this runs it at a
tiny size so a new engine attribute that the script does not set fails here, not at measurement time."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_host_step.py"


@pytest.mark.parametrize("windows, metrics", [(None, False), ("64,full", False), (None, True)])
def test_host_step_benchmark_runs(monkeypatch, capsys, windows, metrics):
    extra = (["--group-windows", windows] if windows else []) + (["--metrics"] if metrics else [])
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--seqs", "4", "--context", "600", "--steps", "3",
                                      "--warmup", "1", "--vocab", "512", "--no-tokenizer", *extra])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith(f"4 seqs, context ~600, groups {windows or 'full'},")
    for phase in ("step", "host", "schedule", "build_host", "sample", "update", "outputs"):
        assert f"{phase} " in out
    assert ("metrics " in out) == metrics

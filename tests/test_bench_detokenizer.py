"""benchmarks/bench_detokenizer.py runs both detokenizer paths and checks they give the same text; this runs
it at a tiny size over a text of its own."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_detokenizer.py"


def test_detokenizer_benchmark_runs_both_paths(monkeypatch, capsys, tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "tinyshakespeare.txt").write_text("First Citizen:\nSpeak, speak. héllo 世界 🙂\n\n" * 40)
    monkeypatch.setenv("KVFORGE_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--seqs", "3", "--tokens", "40", "--rounds", "1"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    assert "DecodeStream" in out and "Python window" in out
    assert out.rstrip().endswith("same text: True")

"""benchmarks/ab_offline.py's ``--set`` parsing and the bootstrap that applies it in each run's process."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from kvforge.attention.routing import paged

_SPEC = importlib.util.spec_from_file_location("ab_offline", Path(__file__).parents[1] / "benchmarks" / "ab_offline.py")
ab_offline = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ab_offline)


def _apply(overrides) -> dict:
    """Run the bootstrap's override loop (not its benchmark) on fresh imports, returning the changed rows."""
    code = ab_offline._BOOTSTRAP.format(overrides=overrides, args=[]).split("from kvforge.cli import main")[0]
    scope: dict = {}
    exec(code, scope)
    return scope


def test_plain_field_and_nested_field(monkeypatch):
    monkeypatch.setattr(paged, "TL_DOT", paged.TL_DOT)  # restored after the bootstrap replaces it
    monkeypatch.setattr(paged, "GLUON_FP8_CTA", paged.GLUON_FP8_CTA)
    plain = ab_offline.parse_override("kvforge.attention.routing.paged.GLUON_FP8_CTA.min_waves=3")
    nested = ab_offline.parse_override("kvforge.attention.routing.paged.TL_DOT.splits.small_grid_min_tokens=0")
    assert plain == ("kvforge.attention.routing.paged.GLUON_FP8_CTA", "min_waves", 3)
    assert nested == ("kvforge.attention.routing.paged.TL_DOT", "splits.small_grid_min_tokens", 0)
    before = paged.TL_DOT
    _apply([plain, nested])
    assert paged.GLUON_FP8_CTA.min_waves == 3
    assert paged.TL_DOT.splits.small_grid_min_tokens == 0 and paged.TL_DOT.splits.min_tokens == before.splits.min_tokens
    assert paged.TL_DOT.name == before.name


def test_class_attribute(monkeypatch):
    from kvforge.engine.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "admit_whole_prompts", Scheduler.admit_whole_prompts)  # restored after
    override = ab_offline.parse_override("kvforge.engine.scheduler.Scheduler.admit_whole_prompts=False")
    assert override == ("kvforge.engine.scheduler.Scheduler", "admit_whole_prompts", False)
    _apply([override])
    assert Scheduler.admit_whole_prompts is False
    with pytest.raises(argparse.ArgumentTypeError, match="nor a class with that attribute"):
        ab_offline.parse_override("kvforge.engine.scheduler.Scheduler.nope=1")


def test_module_attribute_and_refusals():
    assert ab_offline.parse_override("kvforge.attention.backends.triton_paged.FUSE_ROPE_WITH_CACHE_WRITE=False") == (
        "kvforge.attention.backends.triton_paged.FUSE_ROPE_WITH_CACHE_WRITE", "", False)
    with pytest.raises(argparse.ArgumentTypeError, match="not a dataclass with a field 'nope'"):
        ab_offline.parse_override("kvforge.attention.routing.paged.TL_DOT.splits.nope=1")
    with pytest.raises(argparse.ArgumentTypeError, match="is a int"):
        ab_offline.parse_override("kvforge.attention.routing.paged.TL_DOT.splits.min_tokens=big")
    with pytest.raises(argparse.ArgumentTypeError, match="no module attribute"):
        ab_offline.parse_override("kvforge.attention.routing.nothing_here=1")


def test_b_env_reaches_side_b_only(monkeypatch, tmp_path):
    """``--b-env NAME=value`` sets the variable in side B's process environment and nowhere else; a bad
    form is refused."""
    assert ab_offline.parse_env("KVFORGE_SDPA_PREFILL_CUDNN=1") == ("KVFORGE_SDPA_PREFILL_CUDNN", "1")
    assert ab_offline.parse_env("X=a=b") == ("X", "a=b")
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=value"):
        ab_offline.parse_env("X")
    seen = []

    def fake_run(cmd, check, stdout, env, cwd=None):
        seen.append(None if env is None else env.get("KVFORGE_AB_PROBE"))
        Path(cmd[-1].split("'--out', '")[1].split("'")[0]).write_text('{"runs": []}')

    monkeypatch.setattr(ab_offline.subprocess, "run", fake_run)
    monkeypatch.setattr("sys.argv", ["ab_offline", "--b-env", "KVFORGE_AB_PROBE=1", "--rounds", "1", "--", "x"])
    with pytest.raises(statistics.StatisticsError):  # no timed runs: the median of an empty list
        ab_offline.main()
    assert seen == [None, "1"]


def test_decode_profiles_are_reported_per_run_and_side(monkeypatch, tmp_path, capsys):
    """With ``--profile-decode`` each run's replayed step is printed, and each side's median step."""
    steps = iter([9.5, 9.8, 9.7, 9.9])

    def fake_run(cmd, check, stdout, env, cwd=None):
        out = Path(cmd[-1].split("'--out', '")[1].split("'")[0])
        prof = {"wall_ms_per_step_graph_timed": next(steps), "step_floor_ms": 7.5, "batch": 64,
                "context_tokens": 345}
        out.write_text(json.dumps({"runs": [{"output_tokens_per_s": 4000.0}], "fraction_of_floor": 0.7,
                                   "decode_profile": prof}))

    monkeypatch.setattr(ab_offline.subprocess, "run", fake_run)
    monkeypatch.setattr("sys.argv", ["ab_offline", "--b-env", "X=1", "--rounds", "2", "--", "x", "--profile-decode"])
    ab_offline.main()
    out = capsys.readouterr().out
    assert "round 0 A: output tok/s [4000], fraction of floor 0.700, decode step 9.50 ms (floor 7.50) at 64 x 345" in out
    assert "A: median 4,000 [4,000-4,000] output tok/s over 2 timed runs; decode step 9.60 ms over 2 profiles" in out
    assert "B: median 4,000 [4,000-4,000] output tok/s over 2 timed runs; decode step 9.85 ms over 2 profiles" in out
    assert ab_offline.decode_step({}) == ""


def test_b_tree_runs_side_b_from_another_checkout(monkeypatch, tmp_path):
    """``--b-tree DIR``: side B's process starts in DIR with DIR first on its path (``python -c`` would put its
    working directory first), side A in this checkout; a folder without the package is refused."""
    (tmp_path / "kvforge").mkdir()
    seen = []

    def fake_run(cmd, check, stdout, env, cwd=None):
        seen.append((cwd, env.get("PYTHONPATH", "").split(":")[0] if cwd else None))
        Path(cmd[-1].split("'--out', '")[1].split("'")[0]).write_text('{"runs": [{"output_tokens_per_s": 1.0}]}')

    monkeypatch.setattr(ab_offline.subprocess, "run", fake_run)
    monkeypatch.setattr("sys.argv", ["ab_offline", "--b-tree", str(tmp_path), "--rounds", "1", "--", "x"])
    ab_offline.main()
    assert seen == [(None, None), (str(tmp_path), str(tmp_path))]
    monkeypatch.setattr("sys.argv", ["ab_offline", "--b-tree", str(tmp_path / "kvforge"), "--", "x"])
    with pytest.raises(SystemExit):
        ab_offline.main()

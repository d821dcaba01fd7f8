"""The ``kvforge`` command line itself: --version, --log-level on either side of the subcommand, and
output to a reader that stops early."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvforge import __version__
from kvforge.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvforge {__version__}"


@pytest.mark.parametrize("argv", [
    ["--log-level", "WARNING", "plan", "--json"],
    ["plan", "--log-level", "WARNING", "--json"],
    ["plan", "--json", "--log-level=WARNING"],
])
def test_log_level_before_or_after_the_subcommand(capsys, argv):
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "SmolLM2-135M-Instruct"


def test_log_level_after_an_engine_subcommand_is_parsed(capsys):
    # A bad --port stops serve before any engine is built; --log-level after `serve` must parse first.
    assert main(["serve", "--log-level", "DEBUG", "--port", "99999"]) == 2
    assert "--port must be in" in capsys.readouterr().err


def test_bad_log_level_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--log-level", "LOUD"])
    assert exc.value.code == 2
    assert "--log-level" in capsys.readouterr().err


def test_reader_that_stops_early_is_not_an_error():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "kvforge.cli", "plan", "--json"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the plan is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err


@pytest.mark.parametrize("argv,prog", [
    (["plan", "--bogus"], "kvforge plan"),
    (["serve", "--bogus"], "kvforge serve"),
    (["bench", "serve", "--bogus"], "kvforge bench serve"),
    (["eval", "kld", "--bogus"], "kvforge eval kld"),
])
def test_unknown_flag_is_reported_with_the_subcommands_usage(capsys, argv, prog):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: {prog}" in err
    assert f"{prog}: error: unrecognized arguments: --bogus" in err
    # no flag resembles it once the "--" every flag shares is left out of the comparison
    assert "did you mean" not in err


@pytest.mark.parametrize("argv,named", [
    (["plan", "--max-model", "100"], "--max-model: did you mean --max-model-len"),
    (["serve", "--gpu-memory-util", "0.5"], "--gpu-memory-util: did you mean --gpu-memory-utilization"),
    (["generate", "--max-token", "4"], "--max-token: did you mean --max-tokens"),
    (["bench", "serve", "--concurency", "4"], "--concurency: did you mean --concurrency"),
])
def test_an_abbreviated_flag_is_refused_naming_the_flag_it_resembles(capsys, argv, named):
    """Flags are taken only as spelled in full (argparse would bind a unique prefix to today's flag); the
    error names the closest flags of the subcommand."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {argv[-2]}" in err and named in err, err


def test_a_failed_rank_is_one_line_and_exit_1(capsys, monkeypatch):
    """A tensor-parallel rank that dies (not the user's error: exit 1, not 2) ends the command with the
    engine's message on one line, no traceback."""
    import kvforge.generate_cmd
    from kvforge.distributed.group import DistributedError as raised

    def die(args):
        raise raised("tensor-parallel worker rank 1 (pid 7) was killed by SIGKILL during startup")

    monkeypatch.setattr(kvforge.generate_cmd, "generate_main", die)
    assert main(["generate", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err == "error: tensor-parallel worker rank 1 (pid 7) was killed by SIGKILL during startup\n"

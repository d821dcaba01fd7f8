"""README.md names every flag the plan, generate and serve commands accept, so a new flag cannot land
without its line in the README's CLI section."""

import argparse
import re
from pathlib import Path

import pytest

from kvforge.cli import build_parser

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _subcommand_flags(command: str) -> set[str]:
    parser = build_parser(command)
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    flags = set()
    for action in subparsers.choices[command]._actions:
        flags.update(s for s in action.option_strings if s.startswith("--") and s not in ("--help", "--log-level"))
    return flags


@pytest.mark.parametrize("command", ["plan", "generate", "serve"])
def test_readme_names_every_flag(command):
    flags = _subcommand_flags(command)
    assert flags, "the parser exposes no flags: the test would pass vacuously"
    # a whole flag: `--gpu-memory` inside `--gpu-memory-utilization` does not count
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", README))
    assert not missing, f"README.md does not name these `kvforge {command}` flags: {missing}"

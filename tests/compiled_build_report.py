"""Kernel builds for a GPU target on any machine: a test module whose ``__main__`` prints one JSON report of
builds runs itself in a child process without ``TRITON_INTERPRET``. The tests run Triton's interpreter on
CPU (conftest.py), which replaces the kernels; an ahead-of-time build needs them compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def build_report(test_file: str, timeout_s: float = 600) -> dict:
    """The JSON object the last line of ``python test_file`` prints, run with the checkout on the path and
    the interpreter off."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent.parent), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, test_file], capture_output=True, text=True, env=env, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

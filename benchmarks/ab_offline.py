"""A/B of ``kvforge bench offline`` in one sitting: the same workload on engines built alternately with and
without module-attribute overrides, so that both sides share the machine, its clocks and its caches.

    python benchmarks/ab_offline.py --set kvforge.models.expert_rows.TRITON_ROWS=False --rounds 2 -- \\
        deepseek-v2-lite --load-format dummy --device cuda --skip-tokenizer-init --max-model-len 4096 \\
        --num-prompts 64 --input-len 100 512 --output-len 64 192 --async-scheduling --repetitions 3

Each run is its own process (``python -c`` with the overrides assigned before the command line runs, as a
switch's docstring asks: before the engine starts and captures its graphs); the order is A, B, A, B, ...
(A: the tree as it is; B: with every ``--set``, the arguments ``--b-args`` adds to the command line and the
environment variables of ``--b-env``, run from the checkout ``--b-tree`` names where given: a change without
a switch against the commit before it, e.g. ``git worktree add /tmp/before HEAD~3`` then ``--b-tree
/tmp/before``).
Values are Python literals (``0``, ``False``, ``(16, 256)``) or else strings. ``MODULE.ATTR.FIELD=VALUE``
replaces one field of a frozen dataclass attribute (a routing table's row) or sets a class attribute
(``kvforge.engine.scheduler.Scheduler.admit_whole_prompts=False``), and a dotted ``FIELD`` one field
of a dataclass inside it: ``--set kvforge.attention.routing.paged.GLUON_FP8_WARP1.min_programs_per_sm=1e9``
switches that row off, ``--set kvforge.attention.routing.paged.TL_DOT.splits.small_grid_min_tokens=0`` gives
its small grids the long splits. Prints each run's output tok/s and the median per side over all their timed runs, with
min-max, and the ratio B / A of the medians; with ``--profile-decode`` among the offline arguments also each
run's replayed decode step and each side's median step (a decode step varies less than a whole run, so small
changes show there first); ``--out`` keeps every run's JSON in one file.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path

_BOOTSTRAP = """
import dataclasses, importlib, sys

def replaced(obj, path, value):
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, type):  # a class attribute: set on the class itself
        setattr(obj, head, replaced(getattr(obj, head), rest, value))
        return obj
    return dataclasses.replace(obj, **{{head: replaced(getattr(obj, head), rest, value)}})

for target, field, value in {overrides!r}:
    module, attr = target.rsplit(".", 1)
    mod = importlib.import_module(module)
    setattr(mod, attr, replaced(getattr(mod, attr), field.split(".") if field else [], value))
from kvforge.cli import main
sys.argv = ["kvforge", "bench", "offline"] + {args!r}
sys.exit(main())
"""


def parse_override(text: str) -> tuple[str, str, object]:
    """``module.path.ATTR=value`` -> (``module.path.ATTR``, "", value); ``module.path.ATTR.FIELD=value``, where
    ``ATTR`` is a frozen dataclass (a routing-table row) -> (``module.path.ATTR``, ``FIELD``, value): the
    attribute becomes a copy with that field replaced; ``FIELD`` may be a dotted path through nested frozen
    dataclasses (``GLUON_FP8_CTA.splits.small_grid_min_tokens``). The value is a Python literal, else the
    string."""
    target, sep, raw = text.partition("=")
    if not sep or "." not in target:
        raise argparse.ArgumentTypeError(f"--set wants module.path.ATTR=value, got {text!r}")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):  # the longest module prefix whose next name is an attribute
        module = ".".join(parts[:i])
        if _is_module(module) and _holds_value(importlib.import_module(module), parts[i]):
            break
    else:
        raise argparse.ArgumentTypeError(f"--set {text!r}: no module attribute in {target}")
    owner, fields = ".".join(parts[: i + 1]), parts[i + 1 :]
    current = getattr(importlib.import_module(module), parts[i])
    for j, field in enumerate(fields):
        is_class_attr = isinstance(current, type) and not dataclasses.is_dataclass(current) and hasattr(current, field)
        if not is_class_attr and (not dataclasses.is_dataclass(current)
                                  or field not in {f.name for f in dataclasses.fields(current)}):
            where = ".".join([owner, *fields[:j]])
            raise argparse.ArgumentTypeError(f"--set {text!r}: {where} is not a dataclass with a field {field!r}"
                                             f" nor a class with that attribute")
        current = getattr(current, field)
    if fields:
        if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not type(current):
            raise argparse.ArgumentTypeError(f"--set {text!r}: {target} is a {type(current).__name__}, "
                                             f"got {value!r}")
    return owner, ".".join(fields), value


def _holds_value(module: types.ModuleType, name: str) -> bool:
    """Whether ``module`` has an attribute ``name`` that is not itself a module."""
    return hasattr(module, name) and not isinstance(getattr(module, name), types.ModuleType)


def _is_module(name: str) -> bool:
    """Whether ``name`` names an importable module (without importing it unless its parent is imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is missing or is a module, not a package
        return False


def parse_env(text: str) -> tuple[str, str]:
    """``NAME=value`` -> (``NAME``, ``value``)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--b-env wants NAME=value, got {text!r}")
    return name, value


def decode_step(d: dict) -> str:
    """One run's replayed decode step from ``--profile-decode`` (its wall time with the floor, the batch and
    context it stepped), or "" without a profile."""
    prof = d.get("decode_profile")
    if not prof:
        return ""
    floor = prof.get("step_floor_ms")
    return (f", decode step {prof['wall_ms_per_step_graph_timed']:.2f} ms"
            + (f" (floor {floor:.2f})" if floor else "") + f" at {prof['batch']} x {prof['context_tokens']} tokens")


def run_once(overrides: list[tuple[str, str, object]], args: list[str], out: Path,
             env: dict[str, str] | None = None, tree: str | None = None) -> dict:
    """One run in its own process; ``tree``: the checkout it imports kvforge from (None: this one)."""
    code = _BOOTSTRAP.format(overrides=overrides, args=args + ["--out", str(out)])
    env = {**os.environ, **(env or {})}
    if tree is not None:  # python -c puts its working directory first on the path
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL, env=env,
                   cwd=tree)  # the result: --out
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--set", dest="overrides", type=parse_override, action="append", default=[],
                   metavar="MODULE.ATTR[.FIELD]=VALUE", help="an override of side B (repeatable)")
    p.add_argument("--b-args", default="", metavar="ARGS",
                   help="command-line arguments side B adds to the offline benchmark's, as one string, e.g. "
                        "'--cuda-graph-sizes 1 2 4 8 16 32 64 128 192 256'")
    p.add_argument("--b-env", type=parse_env, action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable side B sets (repeatable), e.g. KVFORGE_SDPA_PREFILL_CUDNN=1")
    p.add_argument("--b-tree", default=None, metavar="DIR",
                   help="a checkout side B runs from (a worktree of another commit) instead of this one")
    p.add_argument("--rounds", type=int, default=2, help="A/B pairs (default 2)")
    p.add_argument("--out", default=None, help="write every run's JSON here")
    p.add_argument("offline_args", nargs=argparse.REMAINDER, help="-- then the arguments of `kvforge bench offline`")
    a = p.parse_args()
    args = a.offline_args[1:] if a.offline_args[:1] == ["--"] else a.offline_args
    if not args:
        p.error("give the offline benchmark's arguments after --")
    b_args = shlex.split(a.b_args)
    b_env = dict(a.b_env)
    if not a.overrides and not b_args and not b_env and not a.b_tree:
        p.error("side B needs at least one --set, --b-args, --b-env or --b-tree")
    if a.b_tree is not None and not (Path(a.b_tree) / "kvforge").is_dir():
        p.error(f"--b-tree {a.b_tree}: no kvforge package there (give a checkout's root)")
    results: dict[str, list[dict]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for side, overrides, extra, env, tree in (("A", [], [], {}, None),
                                                      ("B", a.overrides, b_args, b_env, a.b_tree)):
                d = run_once(overrides, args + extra, Path(tmp) / f"{side}{r}.json", env, tree)
                results[side].append(d)
                speeds = [round(x["output_tokens_per_s"]) for x in d["runs"]]
                print(f"round {r} {side}: output tok/s {speeds}, fraction of floor {d.get('fraction_of_floor', 0):.3f}"
                      f"{decode_step(d)}", flush=True)
    med = {}
    for side, runs in results.items():
        speeds = [x["output_tokens_per_s"] for d in runs for x in d["runs"]]
        med[side] = statistics.median(speeds)
        steps = [d["decode_profile"]["wall_ms_per_step_graph_timed"] for d in runs if d.get("decode_profile")]
        step = f"; decode step {statistics.median(steps):.2f} ms over {len(steps)} profiles" if steps else ""
        print(f"{side}: median {med[side]:,.0f} [{min(speeds):,.0f}-{max(speeds):,.0f}] output tok/s over "
              f"{len(speeds)} timed runs{step}")
    named = ", ".join([f"{t}{'.' + f if f else ''}={v!r}" for t, f, v in a.overrides]
                      + ([" ".join(b_args)] if b_args else []) + [f"{k}={v}" for k, v in b_env.items()]
                      + ([f"the checkout {a.b_tree}"] if a.b_tree else []))
    print(f"B / A: {med['B'] / med['A']:.3f}  (B: {named})")
    if a.out:
        Path(a.out).write_text(json.dumps({"overrides": a.overrides, "b_args": b_args, "b_env": b_env, "runs": results},
                                          indent=1))


if __name__ == "__main__":
    main()

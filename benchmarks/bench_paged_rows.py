"""fp8 paged decode as the routing table sends it, against the same table with one row changed, side by side.

    PYTHONUNBUFFERED=1 python benchmarks/bench_paged_rows.py [--row gluon_fp8_warp1] [--set FIELD=VALUE ...]
        [--rounds 2]

Llama-3.1-8B's attention shape (32 query / 8 KV heads, head size 128), block size 16, an fp8 e4m3 cache of
random values with shuffled block tables, one new token per sequence: batches 4-256 at contexts of 1024,
4096 and 16384 tokens (up to 2M context tokens a call), and 256 sequences of lengths uniform in 100..1100.
Each call is the engine's entry, ``paged_attention``, timed as a CUDA-graph replay with L2 cleared
(median us); "table" is the table as it is, "changed" the same table with the named row replaced by a
copy with each ``--set`` field (a Python literal; ``splits.FIELD`` for its split rule). Without ``--set``
the row is switched off (a bound it never meets). The sides alternate ``--rounds``
times and each keeps its fastest median. Printed per shape: each side's kernel and split count, us, % of
the copy bandwidth (K and V bytes of every context token), their ratio, and the relative L2 distance
between the two outputs.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_timing import copy_bandwidth, graph_bench  # noqa: E402

from kvforge.attention.metadata import AttentionMetadata  # noqa: E402
from kvforge.attention.routing import paged  # noqa: E402
from kvforge.kernels.gluon_support import routing_device  # noqa: E402
from kvforge.kernels.triton_paged_attention import paged_attention  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
#: Per row this script can change: its module attribute, the fields that switch it off, and the fields
#: ``route()`` reads for it (``splits.*`` for every row; the launcher reads ``tiling``).
ROWS = {
    "gluon_fp8_warp1": ("GLUON_FP8_WARP1", dict(min_programs_per_sm=float("inf")),
                        {"min_programs_per_sm", "tiling"}),
    "gluon_fp8_warp": ("GLUON_FP8_WARP", dict(min_context=1 << 62), {"min_context", "min_waves", "tiling"}),
}


def changed_row(row, assignments: list[str], off: dict, fields: set[str]):
    """``row`` with each ``FIELD=VALUE`` / ``splits.FIELD=VALUE`` replaced; none: switched off (``off``).
    A field ``route()`` does not read for this row, or a value of another type than the field's, is a
    ValueError naming it."""
    if not assignments:
        return dataclasses.replace(row, **off)
    for text in assignments:
        field, sep, raw = text.partition("=")
        owner, name = (row.splits, field[7:]) if field.startswith("splits.") else (row, field)
        if not sep or not (owner is row.splits or name in fields) or not hasattr(owner, name):
            allowed = sorted(fields) + [f"splits.{f.name}" for f in dataclasses.fields(row.splits)]
            raise ValueError(f"--set {text!r}: FIELD=VALUE with FIELD one of {', '.join(allowed)}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            raise ValueError(f"--set {text!r}: the value must be a Python literal") from None
        current = getattr(owner, name)
        if isinstance(current, (int, float)) and not isinstance(current, bool):
            value = type(current)(value) if isinstance(value, (int, float)) else value
        if type(value) is not type(current):
            raise ValueError(f"--set {text!r}: {name} is a {type(current).__name__}")
        changed = dataclasses.replace(owner, **{name: value})
        row = dataclasses.replace(row, splits=changed) if owner is row.splits else changed
    return row


def make_case(lens: list[int], seed: int = 0):
    """Query, fp8 cache and decode metadata for sequences of context ``lens`` (shuffled blocks)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per = [math.ceil(n / BS) for n in lens]
    cache = torch.randn((sum(per), 2, HKV, BS, D), device="cuda", generator=g).to(torch.float8_e4m3fn)
    perm = torch.randperm(sum(per), device="cuda", generator=g).to(torch.int32)
    tables = torch.zeros((len(lens), max(per)), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(per):
        tables[i, :n] = perm[used:used + n]
        used += n
    b = len(lens)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"), block_tables=tables,
        slot_mapping=torch.zeros(b, dtype=torch.int64, device="cuda"), max_query_len=1, max_seq_len=max(lens),
        block_size=BS,
    )
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, cache, meta


def shapes() -> dict[str, list[int]]:
    rng = torch.Generator().manual_seed(1)
    out = {"256 x U(100,1100)": torch.randint(100, 1101, (256,), generator=rng).tolist()}
    for b in (4, 8, 9, 12, 16, 24, 32, 48, 64, 96, 128, 256):
        for c in (1024, 4096, 16384):
            if b * c <= 1 << 21:
                out[f"{b} x {c}"] = [c] * b
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--row", choices=sorted(ROWS), default="gluon_fp8_warp1")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    attr, off, fields = ROWS[a.row]
    try:
        rows = {"table": getattr(paged, attr), "changed": changed_row(getattr(paged, attr), a.assignments, off, fields)}
    except ValueError as exc:
        p.error(str(exc))
    device = routing_device(torch.device("cuda", torch.cuda.current_device()))
    cp = copy_bandwidth()
    change = ", ".join(a.assignments) or "switched off"
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {cp / 1e12:.2f} TB/s; changed = {a.row} {change}")
    print("| batch x context | changed: kernel/splits | us | %cp | table: kernel/splits | us | %cp | changed / table "
          "| rel. L2 |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|")
    scale = 1 / math.sqrt(D)
    ones = torch.ones(HKV, device="cuda")
    try:
        for name, lens in shapes().items():
            q, cache, meta = make_case(lens)
            kv_bytes = sum(lens) * HKV * D * 2
            shape = paged.PagedShape(len(lens), HQ, HKV, D, 1, max(lens), "bfloat16", "fp8_e4m3")
            best, route, out = {}, {}, {}
            for _ in range(a.rounds):
                for side, row in rows.items():
                    setattr(paged, attr, row)
                    route[side] = paged.route(shape, device)
                    fn = functools.partial(paged_attention, q, cache, meta, ones, ones, scale)
                    out[side] = fn().float()
                    best[side] = min(best.get(side, math.inf), graph_bench(fn)[0])
            err = ((out["table"] - out["changed"]).norm() / out["changed"].norm()).item()
            cells = []
            for side in ("changed", "table"):
                r, t = route[side], best[side]
                cells.append(f"{r.kernel}/{r.splits} | {t:.1f} | {100 * kv_bytes / (t * 1e-6) / cp:.0f}")
            print(f"| {name} | {' | '.join(cells)} | {best['changed'] / best['table']:.2f} | {err:.1e} |", flush=True)
            del q, cache, meta
            torch.cuda.empty_cache()
    finally:
        setattr(paged, attr, rows["table"])


if __name__ == "__main__":
    main()

"""Print a short table from ``kvforge bench offline --out`` JSON files (CUDA runs with --profile-decode)."""

from __future__ import annotations

import json
import sys


def main(paths: list[str]) -> None:
    print("| KV | async | out tok/s | total tok/s | s | floor s | % of floor | % of compute-aware floor "
          "| decode step ms (graph) | floor ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path in paths:
        try:
            d = json.load(open(path))
        except (OSError, ValueError) as exc:
            print(f"| {path}: {exc} |")
            continue
        m, roof = d["median"], d.get("roofline", {})
        prof = d.get("decode_profile", {})
        floor_ms = prof.get("step_floor_ms")
        print(f"| {d['kv_cache_dtype']} | {d.get('async_scheduling', '?')} | {m['output_tokens_per_s']:.0f} | "
              f"{m['total_tokens_per_s']:.0f} | {m['seconds']:.2f} | {roof.get('floor_s', float('nan')):.2f} | "
              f"{100 * d.get('fraction_of_floor', float('nan')):.0f} | "
              f"{100 * d.get('fraction_of_compute_aware_floor', float('nan')):.0f} | "
              f"{prof.get('wall_ms_per_step_graph_timed', float('nan')):.2f} | "
              f"{floor_ms if floor_ms is None else round(floor_ms, 2)} |")
    for path in paths:
        try:
            d = json.load(open(path))
        except (OSError, ValueError):
            continue
        for p in d.get("decode_profile", {}).get("profiles", []):
            split = ", ".join(f"{k} {v:.2f}" for k, v in p["kernel_ms_per_step"].items())
            print(f"{d['kv_cache_dtype']} {p['mode']}: wall {p['wall_ms_per_step']:.2f} ms/step, kernels "
                  f"{p['gpu_kernel_ms_per_step']:.2f} ({split}), host {p['host_overhead_ms_per_step']:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])

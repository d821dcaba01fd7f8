"""Host time of the delta-rule prefill route over one engine step, on CPU.

    python benchmarks/bench_delta_rule_route_host.py [--prompt 2048] [--rows 255] [--layers 36]

A step of one prompt chunk beside ``--rows`` decode rows, over ``--layers`` state layers (Qwen3-Next-80B-A3B
has 36): "per layer" asks the route (kvforge/attention/routing/delta_rule.py ``prefill_form``) at every
layer's call, as a kernel call given only the step's lengths does; "per step" asks it through the step's
``SlotBatch.delta_rule_form``, once for all the layers (a fresh batch each step). Prints the median [min-max]
of 7 repetitions of 50 steps, us a step.
"""

from __future__ import annotations

import argparse
import statistics
import timeit

from kvforge.attention.linear_state import SlotBatch
from kvforge.attention.routing import delta_rule as route


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=255)
    parser.add_argument("--layers", type=int, default=36)
    args = parser.parse_args()
    lens = [args.prompt] + [1] * args.rows
    batch = SlotBatch.build(lens, list(range(len(lens))), [True] * len(lens), "cpu")
    fields = {name: getattr(batch, name) for name in batch.__dataclass_fields__}

    def per_layer():
        for _ in range(args.layers):
            route.prefill_form(len(lens), sum(lens), False, batch.host_query_lens)

    def per_step():
        step = SlotBatch(**fields)  # a new step's batch: nothing cached on it yet
        for _ in range(args.layers):
            step.delta_rule_form(False)

    print(f"{len(lens)} rows ({args.prompt} + {args.rows} x 1), {args.layers} state layers; us a step")
    for name, fn in (("per layer", per_layer), ("per step", per_step)):
        times = [timeit.timeit(fn, number=50) / 50 * 1e6 for _ in range(7)]
        print(f"{name:9s}: {statistics.median(times):8.0f} [{min(times):.0f}-{max(times):.0f}]")


if __name__ == "__main__":
    main()

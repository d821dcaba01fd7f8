"""Time the resolver in-process on 100-layer models (no torch imported).

python benchmarks/bench_plan.py            # prints median/min/max per case
"""

from __future__ import annotations

import statistics
import sys
import time

from kvforge.planner.inputs import CacheConfig, ParallelConfig
from kvforge.planner.resolver import resolve
from kvforge.spec.architectures import spec_from_hf_config
from kvforge.spec.presets import PRESETS

CASES = {
    "llama-100L fp8 TP8 80GiB": (dict(PRESETS["llama-3.1-70b"], num_hidden_layers=100), "fp8", 8),
    "gemma3-100L (5:1 sliding) fp8": (dict(PRESETS["gemma-3-27b"], num_hidden_layers=100), "fp8", 2),
    "qwen3-next-100L hybrid fp8": (dict(PRESETS["qwen3-next-80b-a3b"], num_hidden_layers=100), "fp8", 4),
    "csa-ring-100L fp8 TP8": (
        dict(PRESETS["csa-ring-test"], num_hidden_layers=100, max_position_embeddings=32768),
        "fp8",
        8,
    ),
}


def main() -> int:
    import logging

    logging.disable(logging.INFO)
    print(f"{'case':34s} {'median ms':>10s} {'min ms':>8s} {'max ms':>8s}  block")
    for name, (cfg, kv, tp) in CASES.items():
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            spec = spec_from_hf_config(cfg, name=name, source="bench")
            plan = resolve(
                spec,
                CacheConfig(kv_cache_dtype=kv, kv_cache_memory=80 * 2**30, max_model_len=32768),
                ParallelConfig(tp),
            )
            times.append((time.perf_counter() - t0) * 1e3)
        print(
            f"{name:34s} {statistics.median(times):10.2f} {min(times):8.2f} {max(times):8.2f}  {plan.block_size}"
        )
    assert "torch" not in sys.modules, "the planner must not import torch"
    return 0


if __name__ == "__main__":
    sys.exit(main())

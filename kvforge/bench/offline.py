"""``kvforge bench offline``: offline throughput with the engine in-process.

Requests have input and output lengths drawn uniformly from the given ranges
(seeded), random token ids, ignore_eos, greedy. Reports requests/s, output and
total tokens/s, and the engine's own counters; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def add_offline_args(p: argparse.ArgumentParser) -> None:
    from kvforge.config import EngineArgs

    EngineArgs.add_cli_args(p)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--out", default=None, help="write the JSON result here")


def offline_main(args: argparse.Namespace) -> int:
    from kvforge.config import EngineArgs
    from kvforge.engine.sampling_params import SamplingParams
    from kvforge.llm import LLM

    llm = LLM(**EngineArgs.from_cli_args(args).__dict__)
    print(llm.plan.summary())
    rng = random.Random(args.seed)
    vocab = llm.engine.spec.vocab_size
    prompts, params = [], []
    for _ in range(args.num_prompts):
        n_in = rng.randint(*args.input_len)
        n_out = rng.randint(*args.output_len)
        prompts.append({"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(n_in)]})
        params.append(SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))
    # warm-up (compiles kernels, captures graphs) on a couple of short requests
    llm.generate([{"prompt_token_ids": [11] * 16}] * 2, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_in = sum(len(p["prompt_token_ids"]) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "model": llm.engine.model_name, "kv_cache_dtype": llm.plan.kv_cache_dtype, "block_size": llm.plan.block_size,
        "num_prompts": args.num_prompts, "input_tokens": n_in, "output_tokens": n_out, "seconds": dt,
        "requests_per_s": args.num_prompts / dt, "output_tokens_per_s": n_out / dt,
        "total_tokens_per_s": (n_in + n_out) / dt, "capacity_tokens": llm.plan.capacity_tokens,
        "engine_stats": llm.engine.stats(), "device": str(llm.engine.device),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0

"""Decode throughput with and without structured outputs, side by side in one process.

The embedded SmolLM2-135M (or ``--model``) generates ``--num-prompts`` requests of ``--max-tokens`` tokens
each, greedy, three ways in one engine: free text (``ignore_eos``), every request under a regular expression
of lowercase letters, spaces and punctuation that is too long to complete within ``max_tokens`` (no token
holds more than 64 characters; so a request runs to ``max_tokens`` as the free ones do: the same rows every
step), and half of the requests under it. A small model makes the host's share of a step large, which is where structured outputs
cost the most: each step fills the constrained rows' masks on the host and, under async scheduling, waits for
the step in flight before it can. Prints output tok/s per mode (median [min-max] of ``--repetitions``) and the
ratio to free text.

    python benchmarks/bench_structured_outputs.py --device cuda [--async-scheduling] [--num-prompts 64]
    python benchmarks/bench_structured_outputs.py llama-3.1-8b --load-format dummy --tokenizer DIR --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvforge import LLM, SamplingParams

#: Characters per output token the pattern's length allows for (more than any token of the embedded model holds).
CHARS_PER_TOKEN = 64


def _params(kind: str, max_tokens: int, i: int) -> SamplingParams:
    constrained = kind == "all" or (kind == "half" and i % 2 == 0)
    if not constrained:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    pattern = f"[a-z ,.]{{{CHARS_PER_TOKEN * max_tokens}}}"
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs={"regex": pattern})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="a checkpoint or preset (default: the embedded SmolLM2)")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights of the model's architecture")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory, for a preset or dummy weights")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, async_scheduling=args.async_scheduling, progress=False,
              load_format=args.load_format, tokenizer=args.tokenizer, max_model_len=args.max_model_len)
    prompts = [f"Write {i % 7 + 3} sentences about the sea." for i in range(args.num_prompts)]
    rows = {}
    for kind in ("free", "all", "half"):
        params = [_params(kind, args.max_tokens, i) for i in range(args.num_prompts)]
        llm.generate(prompts[:4], params[:4], use_tqdm=False)  # compiles the grammar, warms the kernels
        rates = []
        for _ in range(args.repetitions):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rates.append(tokens / seconds)
        rows[kind] = rates
        short = sum(len(o.outputs[0].token_ids) < args.max_tokens for o in outs)
        if short:
            print(f"note: {short} {kind} request(s) ended before max_tokens: the modes ran different rows")
    free = statistics.median(rows["free"])
    print(f"device {llm.engine.device}, async scheduling {llm.engine.async_scheduling}, {args.num_prompts} requests "
          f"x {args.max_tokens} tokens")
    print("| requests constrained | output tok/s | / free text |")
    print("|---|---:|---:|")
    for kind, label in (("free", "none"), ("half", "half"), ("all", "all")):
        rates = rows[kind]
        med = statistics.median(rates)
        print(f"| {label} | {med:,.0f} [{min(rates):,.0f}-{max(rates):,.0f}] | {med / free:.3f} |")


if __name__ == "__main__":
    main()

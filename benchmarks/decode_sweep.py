"""Decode speed over small batches and long contexts, bf16 against fp8 KV, one engine per KV dtype.

    python benchmarks/decode_sweep.py [--model llama-3.1-8b] [--batches 1 2 4 8]
        [--contexts 128 2048 8192 32768] [--kv bfloat16 fp8] [--steps 32] [--out sweep.json]

For each (batch, context), ``--repeats`` times: ``batch`` random prompts of ``context`` tokens (dummy
weights, prefix caching off so no prompt reuses another's blocks), greedy, ``--steps`` new tokens each. A
step may hold ``max(contexts)`` tokens with no cap on a step's prefill, so every prompt is in within
``max(batches)`` steps. Where the batch's prompts take ``a`` steps to admit (``--max-num-batched-tokens``,
default ``max(8192, max(contexts))``), each request asks for ``steps + a - 1`` tokens, so the full batch
still decodes together for at least ``steps - 1`` steps (:func:`admission_steps` bounds ``a``). The engine's step record (``engine.step_log``) times every step; a repeat's decode speed
is ``batch`` over the median of its decode-only steps that ran all ``batch`` sequences (prefill steps
excluded). Prints the median over repeats with min and max, and the fp8 / bf16 ratio of the medians, and
writes the numbers as JSON.

A context of a power of two plus the new tokens replays the next CUDA-graph context bucket
(kvforge/engine/cuda_graphs.py: 4,096 + 32 tokens the 8,192-token one), whose split counts are pinned for
twice the context; a context a little below the power of two (4,000) stays in the bucket of that size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvforge import LLM, SamplingParams  # noqa: E402


def admission_steps(batch: int, context: int, budget: int) -> int:
    """At most the steps that take ``batch`` prompts of ``context`` tokens in at ``budget`` tokens a step
    (chunked: a prompt may start in one step and end in the next; while a prompt waits, at most
    ``batch - 1`` admitted sequences' decode tokens take budget tokens, so a step prefills at least
    ``budget - batch + 1``). Needs ``budget > batch``."""
    if budget <= batch:
        raise ValueError(f"a step budget of {budget} tokens must exceed the batch of {batch} sequences")
    if batch * context <= budget:
        return 1
    return -(-batch * context // (budget - batch + 1)) + 1


def sweep(model: str, kv: str, batches: list[int], contexts: list[int], steps: int, device: str = "cuda",
          repeats: int = 1, seed: int = 0, max_num_batched_tokens: int | None = None) -> dict:
    budget = max_num_batched_tokens or max(8192, max(contexts))
    if budget < max(contexts) or budget <= max(batches):
        raise ValueError(f"a step budget of {budget} tokens must hold one {max(contexts)}-token prompt and "
                         f"exceed the largest batch ({max(batches)})")
    admissions = {(b, c): admission_steps(b, c, budget) for b in batches for c in contexts}
    max_len = max(contexts) + steps + max(admissions.values()) + 8
    llm = LLM(model, load_format="dummy", device=device, kv_cache_dtype=kv, max_num_seqs=max(batches),
              max_model_len=max_len, enable_prefix_caching=False, skip_tokenizer_init=True, progress=False,
              max_num_batched_tokens=budget, long_prefill_token_threshold=0)
    engine, gen = llm.engine, torch.Generator().manual_seed(seed)
    vocab = engine.spec.vocab_size
    results = {}
    for context in contexts:
        for batch in batches:
            # a request admitted first decodes while the others' prompts run: it asks for as many more tokens
            # as there are admission steps after its own, so the whole batch shares ``steps - 1`` decode steps
            params = SamplingParams(temperature=0, max_tokens=steps + admissions[batch, context] - 1,
                                    ignore_eos=True)
            speeds, counts, wall = [], [], 0.0
            for _ in range(repeats):
                prompts = [{"prompt_token_ids": torch.randint(0, vocab, (context,), generator=gen).tolist()}
                           for _ in range(batch)]
                first = engine.step_log.total
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                wall += time.perf_counter() - t0
                decode = [r.seconds for r in engine.step_log.since(first)
                          if r.num_prefill_tokens == 0 and r.num_seqs == batch]
                speeds.append(batch / statistics.median(decode) if decode else float("nan"))
                counts.append(len(decode))
            tok_s = statistics.median(speeds)
            results[f"{batch}x{context}"] = dict(batch=batch, context=context, decode_steps=min(counts),
                                                 tok_s=tok_s, tok_s_min=min(speeds), tok_s_max=max(speeds),
                                                 repeats=speeds, wall_s=wall)
            print(f"{kv:9s} batch {batch} x context {context:6d}: {tok_s:8.1f} tok/s [{min(speeds):.1f}-"
                  f"{max(speeds):.1f}] ({min(counts)}+ decode steps a repeat)", flush=True)
    llm.shutdown()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 2048, 8192, 32768])
    ap.add_argument("--kv", nargs="+", default=["bfloat16", "fp8"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the step budget (default max(8192, max(contexts)))")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs = {kv: sweep(args.model, kv, args.batches, args.contexts, args.steps, args.device, args.repeats,
                      max_num_batched_tokens=args.max_num_batched_tokens)
            for kv in args.kv}
    base, other = args.kv[0], args.kv[-1]
    print(f"\n| batch x context | {' | '.join(args.kv)} | {other} / {base} |")
    print("|---|" + "---:|" * (len(args.kv) + 1))
    for key in runs[base]:
        cells = " | ".join(f"{runs[kv][key]['tok_s']:.1f} [{runs[kv][key]['tok_s_min']:.1f}-"
                           f"{runs[kv][key]['tok_s_max']:.1f}]" for kv in args.kv)
        print(f"| {key} | {cells} | {runs[other][key]['tok_s'] / runs[base][key]['tok_s']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(model=args.model, steps=args.steps, runs=runs,
                                                  device=torch.cuda.get_device_name() if args.device == "cuda"
                                                  else args.device), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

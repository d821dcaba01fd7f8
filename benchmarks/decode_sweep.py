"""Decode speed over small batches and long contexts, bf16 against fp8 KV, one engine per KV dtype.

    python benchmarks/decode_sweep.py [--model llama-3.1-8b] [--batches 1 2 4 8]
        [--contexts 128 2048 8192 32768] [--kv bfloat16 fp8] [--steps 32] [--out sweep.json]

For each (batch, context): ``batch`` random prompts of ``context`` tokens (dummy weights, prefix caching
off so no prompt reuses another's blocks), greedy, ``--steps`` new tokens each. The engine's step record
(``engine.step_log``) times every step; the decode speed is ``batch`` over the median of the decode-only
steps that ran all ``batch`` sequences (prefill steps excluded). Prints one table (tok/s per point and the
fp8 / bf16 ratio) and writes the numbers as JSON.
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


def sweep(model: str, kv: str, batches: list[int], contexts: list[int], steps: int, device: str = "cuda",
          seed: int = 0) -> dict:
    max_len = max(contexts) + steps + 8
    llm = LLM(model, load_format="dummy", device=device, kv_cache_dtype=kv, max_num_seqs=max(batches),
              max_model_len=max_len, enable_prefix_caching=False, skip_tokenizer_init=True, progress=False)
    engine, gen = llm.engine, torch.Generator().manual_seed(seed)
    vocab = engine.spec.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    results = {}
    for context in contexts:
        for batch in batches:
            prompts = [{"prompt_token_ids": torch.randint(0, vocab, (context,), generator=gen).tolist()}
                       for _ in range(batch)]
            first = engine.step_log.total
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            decode = [r.seconds for r in engine.step_log.since(first)
                      if r.num_prefill_tokens == 0 and r.num_seqs == batch]
            step = statistics.median(decode) if decode else float("nan")
            results[f"{batch}x{context}"] = dict(batch=batch, context=context, decode_steps=len(decode),
                                                 step_ms=step * 1e3, tok_s=batch / step, wall_s=wall)
            print(f"{kv:9s} batch {batch} x context {context:6d}: {batch / step:8.1f} tok/s "
                  f"({step * 1e3:.2f} ms a step, {len(decode)} steps)", flush=True)
    llm.shutdown()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 2048, 8192, 32768])
    ap.add_argument("--kv", nargs="+", default=["bfloat16", "fp8"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs = {kv: sweep(args.model, kv, args.batches, args.contexts, args.steps, args.device) for kv in args.kv}
    base, other = args.kv[0], args.kv[-1]
    print(f"\n| batch x context | {' | '.join(args.kv)} | {other} / {base} |")
    print("|---|" + "---:|" * (len(args.kv) + 1))
    for key in runs[base]:
        cells = " | ".join(f"{runs[kv][key]['tok_s']:.1f}" for kv in args.kv)
        print(f"| {key} | {cells} | {runs[other][key]['tok_s'] / runs[base][key]['tok_s']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(model=args.model, steps=args.steps, runs=runs,
                                                  device=torch.cuda.get_device_name() if args.device == "cuda"
                                                  else args.device), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

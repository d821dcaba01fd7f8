"""Prompt logprobs of one long prompt: the device memory a step takes above the engine's resting peak, and the
time, with the engine's slice length against other lengths (a length of at least the prompt scores every row
at once, as a head over all rows would).

    python benchmarks/bench_prompt_logprobs.py llama-3.1-8b --input-len 8192 --slice-rows 256 65536 \\
        --repeats 3 --out prompt_logprobs.json

One engine (dummy weights, eager, ``--max-num-batched-tokens`` the prompt length, so the prompt is one step); per
slice length, a warm-up request and then ``--repeats`` requests of ``--input-len`` random prompt tokens with
``prompt_logprobs`` (``--top``) and one output token, each timed from submission to its output, beside the
same request without prompt logprobs. The memory is ``torch.cuda.max_memory_allocated`` over the request
minus the allocation before it. Prints one row per slice length; ``--out`` keeps the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--input-len", type=int, default=8192)
    parser.add_argument("--slice-rows", type=int, nargs="+", default=[256, 1 << 16])
    parser.add_argument("--top", type=int, default=1, help="prompt_logprobs of each request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--device", default="cuda", help="cuda (memory measured) or cpu (time only)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    import torch

    import kvforge.engine.prompt_scoring as prompt_scoring
    from kvforge import LLM, SamplingParams

    llm = LLM(args.model, load_format="dummy", device=args.device, skip_tokenizer_init=True, progress=False,
              kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.input_len + 64,
              max_num_batched_tokens=args.input_len, enable_prefix_caching=False, enforce_eager=True)
    vocab = llm.engine.spec.vocab_size
    g = torch.Generator().manual_seed(0)

    def request(scored: bool) -> tuple[float, int]:
        prompt = torch.randint(0, vocab, (args.input_len,), generator=g).tolist()
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                prompt_logprobs=args.top if scored else None)
        cuda = args.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        start = time.perf_counter()
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        if scored:
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == args.input_len
        return seconds, (torch.cuda.max_memory_allocated() - before) if cuda else 0

    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{args.model}, {args.input_len}-token prompt, prompt_logprobs={args.top}, {gpu}")
    print(f"{'slice rows':>10} | {'ms, scored':>24} | {'ms, not scored':>24} | {'peak GiB scored':>15} | "
          f"{'peak GiB not':>12}", flush=True)

    def cell(xs):
        return f"{statistics.median(xs):8.1f} [{min(xs):.1f}-{max(xs):.1f}]"

    rows = []
    for slice_rows in args.slice_rows:
        prompt_scoring.SLICE_ROWS = slice_rows
        row = dict(slice_rows=slice_rows, input_len=args.input_len, top=args.top)
        try:
            request(True)  # warm-up: the head's shapes at this slice length
            request(False)
            scored = [request(True) for _ in range(args.repeats)]
            plain = [request(False) for _ in range(args.repeats)]
        except torch.cuda.OutOfMemoryError as e:
            row["out_of_memory"] = str(e).splitlines()[0]
            rows.append(row)
            print(f"{slice_rows:>10} | out of memory: {row['out_of_memory']}", flush=True)
            torch.cuda.empty_cache()
            continue
        row.update(scored_ms=[s * 1e3 for s, _ in scored], plain_ms=[s * 1e3 for s, _ in plain],
                   scored_peak_bytes=max(b for _, b in scored), plain_peak_bytes=max(b for _, b in plain))
        rows.append(row)
        print(f"{slice_rows:>10} | {cell(row['scored_ms']):>24} | {cell(row['plain_ms']):>24} | "
              f"{row['scored_peak_bytes'] / 2**30:>15.2f} | {row['plain_peak_bytes'] / 2**30:>12.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, gpu=gpu, rows=rows), f, indent=1)
    llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""n-gram speculative decoding on CPU with real weights (the embedded SmolLM2-135M-Instruct GGUF).

    python benchmarks/spec_ngram_cpu.py [--k 2 4] [--reps 3] [--max-tokens 64] [--threads 1] [--draft-model M]

``--draft-model M`` proposes with a draft model instead of prompt lookup (``M``: a path, or ``embedded``
for the embedded model as its own draft).

Workload: "repeat / lightly edit this paragraph" prompts (chat template), greedy, batch 1, where the
output copies its prompt and prompt lookup has something to find. One engine per setting, built once;
each repetition runs every prompt on every engine in turn (speculation off first), so the settings
share the machine's noise. Reports decode-phase tokens/s (generated tokens / wall time of the whole
request, prefill included) as median [min-max] over repetitions, the speed-up over speculation off,
the acceptance rate and mean accepted length, and checks that every output equals speculation off's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

PARAGRAPHS = [
    "The harbour town wakes early. Fishing boats leave before dawn, and by seven the market is full of "
    "crates of mackerel, crab and mussels. Tourists arrive later, when the cafes open their shutters and "
    "the smell of fresh bread drifts along the quay.",
    "To install the tool, download the archive, unpack it into a folder of your choice, and add that "
    "folder to your PATH. Then open a new terminal and run the command with the --version flag to check "
    "that the installation worked.",
    "Our quarterly results show revenue of 4.2 million, up 12 percent on the same quarter last year. "
    "Costs rose by 5 percent, mainly because of new hires in the support team. We expect growth to "
    "continue in the next quarter.",
]
TASKS = ["Repeat the following paragraph exactly, word for word:\n\n{}",
         "Rewrite the following paragraph, changing only the first sentence:\n\n{}"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", nargs="+", type=int, default=[2, 4], help="num_speculative_tokens settings")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft-model", default=None, help="propose with this draft model ('embedded': the target)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvforge import LLM, SamplingParams

    settings = [0] + args.k
    def speculation(k: int) -> dict:
        if not k:
            return {}
        if args.draft_model is None:
            return {"num_speculative_tokens": k}
        from kvforge.spec.embedded import embedded_model_path

        draft = str(embedded_model_path()) if args.draft_model == "embedded" else args.draft_model
        return {"speculative_config": {"method": "draft_model", "model": draft, "num_speculative_tokens": k}}

    llms = {k: LLM(progress=False, enable_prefix_caching=False, **speculation(k)) for k in settings}
    tok = llms[0].engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": t.format(p)}], add_generation_prompt=True)
               for t in TASKS for p in PARAGRAPHS]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rates = {k: [] for k in settings}
    outputs = {}
    for rep in range(args.reps):
        for k in settings:
            llm = llms[k]
            t0 = time.perf_counter()
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # batch 1
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[k].append(n / dt)
            outputs.setdefault(k, [o.outputs[0].token_ids for o in outs])
        print(f"rep {rep}: " + ", ".join(f"k={k} {rates[k][-1]:.1f} tok/s" for k in settings), flush=True)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {len(prompts)} prompts, "
          f"max_tokens {args.max_tokens}, {args.reps} reps")
    base = statistics.median(rates[0])
    for k in settings:
        xs = rates[k]
        line = f"k={k}: {statistics.median(xs):.1f} tok/s [{min(xs):.1f}-{max(xs):.1f}]"
        if k:
            spec = llms[k].engine.stats()["spec_decode"]
            rate = spec["num_accepted_tokens"] / max(1, spec["num_draft_tokens"])
            mal = 1 + spec["num_accepted_tokens"] / max(1, spec["num_drafts"])
            same = outputs[k] == outputs[0]
            line += (f", speed-up {statistics.median(xs) / base:.2f}x, acceptance {rate:.1%}, mean accepted length "
                     f"{mal:.2f}, outputs equal to k=0: {same}")
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

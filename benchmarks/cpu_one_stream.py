"""One stream on CPU: kvforge against Hugging Face transformers' eager ``generate``, side by side.

    python benchmarks/cpu_one_stream.py [--reps 5] [--gen 128] [--threads N] [--hf-attn eager|sdpa]

Both run the embedded SmolLM2-135M-Instruct (Q4_1 GGUF) dequantized to float32, the dtype kvforge
computes in on CPU: kvforge through ``LLM().engine`` (no model argument, greedy, ignore_eos, prefix cache
off so every repetition prefills), transformers through ``AutoModelForCausalLM.from_pretrained(...,
gguf_file=..., dtype=torch.float32)`` and ``generate(do_sample=False)`` with no EOS id in its generation config.
The same prompt token ids (the chat template around one fixed request, unless ``--raw``) go to both;
the two alternate for ``--reps`` repetitions after one untimed warm-up each, so load on a shared machine
hits both alike.

Per run: time to first token (prefill + first sample), decode tok/s = (gen - 1) / (time of the last
token - time of the first), and the process CPU time per decode token over the same span (all threads;
on a shared machine it shows how much of the wall time was spent waiting for a core). kvforge's token
times are taken after each ``engine.step()``; transformers' at each ``streamer.put`` (called once per
generated token). Repetitions alternate which engine runs first. Prints medians with [min-max], the
decode ratio kvforge / transformers (of the medians, and per repetition), and whether the greedy tokens
agree.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass(frozen=True)
class Run:
    """One timed request: time to first token, decode tok/s (wall), process CPU ms per decode token."""

    ttft_ms: float
    decode_tok_s: float
    cpu_ms_per_token: float
    tokens: list[int]


def _run(t0: float, wall: list[float], cpu: list[float], tokens: list[int]) -> Run:
    n = len(wall) - 1
    return Run((wall[0] - t0) * 1e3, n / (wall[-1] - wall[0]), (cpu[-1] - cpu[0]) / n * 1e3, tokens)


class _TokenClock:
    """A transformers streamer that records when each generated token arrives (the prompt's put is skipped)."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def end(self) -> None:
        pass


def run_kvforge(engine, prompt_ids: list[int], gen: int, run_id: str) -> Run:
    """One greedy request through the engine's step loop."""
    from kvforge.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(run_id, list(prompt_ids), params)
    wall, cpu, tokens = [], [], []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now, now_cpu = time.perf_counter(), time.process_time()
        for out in outs:
            if out.request_id == run_id:
                new = list(out.outputs[0].token_ids)
                wall.extend([now] * (len(new) - len(tokens)))
                cpu.extend([now_cpu] * (len(new) - len(tokens)))
                tokens = new
    if len(tokens) != gen:
        raise RuntimeError(f"kvforge produced {len(tokens)} tokens, expected {gen}")
    return _run(t0, wall, cpu, tokens)


def _greedy_config(model, gen: int):
    """The model's generation config, greedy for exactly ``gen`` tokens with no EOS id, so generate never
    stops early and never masks EOS (``min_new_tokens`` would mask it and change the greedy tokens; kvforge's
    ignore_eos does not)."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.pad_token_id = 0
    config.do_sample = False
    config.max_new_tokens = gen
    return config


def run_hf(model, prompt_ids: list[int], gen: int) -> Run:
    """One greedy ``generate``."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    clock = _TokenClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=_greedy_config(model, gen),
                             streamer=clock)
    if len(clock.wall) != gen:
        raise RuntimeError(f"transformers produced {len(clock.wall)} tokens, expected {gen}")
    return _run(t0, clock.wall, clock.cpu, out[0, len(prompt_ids):].tolist())


def fmt(xs: list[float], digits: int = 2) -> str:
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gen", type=int, default=128, help="output tokens per run")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--hf-attn", default="eager", choices=["eager", "sdpa"], help="transformers attn_implementation")
    ap.add_argument("--raw", action="store_true", help="send the prompt as plain text, not in the chat template")
    args = ap.parse_args()
    if args.gen < 2:
        ap.error("--gen must be at least 2 (decode speed needs two tokens)")
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers
    from transformers import AutoModelForCausalLM

    from kvforge import LLM
    from kvforge.spec.embedded import embedded_model_path

    engine = LLM(progress=False, enable_prefix_caching=False).engine
    if engine.plan.model_dtype != "float32":
        raise RuntimeError(f"kvforge runs the CPU model in {engine.plan.model_dtype}; this script compares float32")
    tok = engine.tokenizer
    if not args.raw:
        text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
        prompt_ids = tok.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tok.encode(PROMPT)
    gguf = Path(embedded_model_path())
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                              attn_implementation=args.hf_attn).eval()

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"torch.get_num_threads() = {torch.get_num_threads()}")
    print(f"kvforge: model dtype {engine.plan.model_dtype}, KV {engine.plan.layers[0].kv_dtype}, "
          f"backend {engine.plan.layers[0].backend}; transformers: float32, attn_implementation={args.hf_attn}")
    print(f"prompt {len(prompt_ids)} tokens, {args.gen} output tokens, {args.reps} repetitions (+1 warm-up each)")

    runs = {"kvforge": lambda rep: run_kvforge(engine, prompt_ids, args.gen, f"rep{rep}"),
            "transformers": lambda rep: run_hf(hf, prompt_ids, args.gen)}
    for run in runs.values():  # warm-up
        run(-1)
    results: dict[str, list[Run]] = {name: [] for name in runs}
    for rep in range(args.reps):
        order = list(runs) if rep % 2 == 0 else list(reversed(runs))  # neither always runs first
        for name in order:
            results[name].append(runs[name](rep))
        print(f"  rep {rep} ({order[0]} first): " + ", ".join(
            f"{name} {results[name][-1].decode_tok_s:.2f} tok/s (ttft {results[name][-1].ttft_ms:.0f} ms)"
            for name in runs), flush=True)

    print(f"{'':14s} {'decode tok/s':>22s} {'TTFT ms':>22s} {'CPU ms / decode token':>24s}")
    for name, rs in results.items():
        print(f"{name:14s} {fmt([r.decode_tok_s for r in rs]):>22s} {fmt([r.ttft_ms for r in rs], 0):>22s} "
              f"{fmt([r.cpu_ms_per_token for r in rs], 1):>24s}")
    kv, hf_runs = results["kvforge"], results["transformers"]
    ratios = [a.decode_tok_s / b.decode_tok_s for a, b in zip(kv, hf_runs)]
    print(f"decode speed kvforge / transformers: ratio of medians "
          f"{statistics.median(r.decode_tok_s for r in kv) / statistics.median(r.decode_tok_s for r in hf_runs):.3f}"
          f", per repetition {fmt(ratios, 3)}")
    agree = [next((i for i, (a, b) in enumerate(zip(x.tokens, y.tokens)) if a != b), args.gen)
             for x, y in zip(kv, hf_runs)]
    print(f"greedy tokens equal for the first {min(agree)} of {args.gen} in every repetition")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

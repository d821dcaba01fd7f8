"""One stream on CPU: kvforge against Hugging Face transformers' eager ``generate``, side by side.

    python benchmarks/cpu_one_stream.py [--reps 5] [--gen 128] [--threads N] [--hf-attn eager|sdpa]

Both run the embedded SmolLM2-135M-Instruct (Q4_1 GGUF) dequantized to float32, the dtype kvforge
computes in on CPU: kvforge through ``LLM().engine`` (no model argument, greedy, ignore_eos, prefix cache
off so every repetition prefills), transformers through ``AutoModelForCausalLM.from_pretrained(...,
gguf_file=..., dtype=torch.float32)`` and ``generate(do_sample=False)`` with no EOS id in its generation config.
The same prompt token ids go to both; the two alternate, kvforge first, for ``--reps`` repetitions
after one untimed warm-up each, so load on a shared machine hits both alike.

Per run: time to first token (prefill + first sample) and decode tok/s = (gen - 1) / (time of the last
token - time of the first). kvforge's token times are taken after each ``engine.step()``; transformers'
at each ``streamer.put`` (called once per generated token). Prints medians with [min-max] and the
decode ratio kvforge / transformers, and whether the greedy tokens agree.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


class _TokenClock:
    """A transformers streamer that records when each generated token arrives (the prompt's put is skipped)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_kvforge(engine, prompt_ids: list[int], gen: int, run_id: str) -> tuple[float, float, list[int]]:
    """(ttft s, decode tok/s, tokens) of one greedy request through the engine's step loop."""
    from kvforge.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(run_id, list(prompt_ids), params)
    times, tokens = [], []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id == run_id:
                new = list(out.outputs[0].token_ids)
                times.extend([now] * (len(new) - len(tokens)))
                tokens = new
    if len(tokens) != gen:
        raise RuntimeError(f"kvforge produced {len(tokens)} tokens, expected {gen}")
    return times[0] - t0, (gen - 1) / (times[-1] - times[0]), tokens


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


def run_hf(model, prompt_ids: list[int], gen: int) -> tuple[float, float, list[int]]:
    """(ttft s, decode tok/s, tokens) of one greedy ``generate``."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    clock = _TokenClock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=_greedy_config(model, gen),
                             streamer=clock)
    tokens = out[0, len(prompt_ids):].tolist()
    if len(clock.times) != gen:
        raise RuntimeError(f"transformers produced {len(clock.times)} tokens, expected {gen}")
    return clock.times[0] - t0, (gen - 1) / (clock.times[-1] - clock.times[0]), tokens


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

    run_kvforge(engine, prompt_ids, args.gen, "warmup")
    run_hf(hf, prompt_ids, args.gen)
    kv_ttft, kv_tps, hf_ttft, hf_tps = [], [], [], []
    agree = []
    for rep in range(args.reps):
        t, s, kv_tokens = run_kvforge(engine, prompt_ids, args.gen, f"rep{rep}")
        kv_ttft.append(t * 1e3)
        kv_tps.append(s)
        t, s, hf_tokens = run_hf(hf, prompt_ids, args.gen)
        hf_ttft.append(t * 1e3)
        hf_tps.append(s)
        same = next((i for i, (a, b) in enumerate(zip(kv_tokens, hf_tokens)) if a != b), len(kv_tokens))
        agree.append(same)
        print(f"  rep {rep}: kvforge {kv_tps[-1]:.2f} tok/s (ttft {kv_ttft[-1]:.0f} ms), "
              f"transformers {hf_tps[-1]:.2f} tok/s (ttft {hf_ttft[-1]:.0f} ms)", flush=True)

    print(f"{'':14s} {'decode tok/s':>22s} {'TTFT ms':>22s}")
    print(f"{'kvforge':14s} {fmt(kv_tps):>22s} {fmt(kv_ttft, 0):>22s}")
    print(f"{'transformers':14s} {fmt(hf_tps):>22s} {fmt(hf_ttft, 0):>22s}")
    ratios = [a / b for a, b in zip(kv_tps, hf_tps)]
    print(f"decode speed kvforge / transformers: median of medians "
          f"{statistics.median(kv_tps) / statistics.median(hf_tps):.3f}, per repetition {fmt(ratios, 3)}")
    print(f"greedy tokens equal for the first {min(agree)} of {args.gen} in every repetition")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

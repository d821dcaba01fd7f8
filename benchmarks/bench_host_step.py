"""Host time of one engine decode step, on CPU, with the model stubbed out.

Builds a real ``LLMEngine.step`` loop (real Scheduler, BlockManager, Sampler,
``ModelRunner.build_host`` / ``_to_device`` and detokenizer) but replaces the
model forward with a fixed random logits tensor ``[num_seqs, vocab]``. With
256 running sequences of ~600 tokens of context this is the Python work a
GPU decode step of Llama-3.1-8B at batch 256 does on the host (see
docs/GPU_ENGINE.md, "Where the time of a decode step goes").

    .venv/bin/python benchmarks/bench_host_step.py [--seqs 256] [--context 600] [--steps 50]
        [--group-windows 512,512,512,512,512,full]

``--group-windows`` lays the KV cache out in groups as a hybrid model's plan does (one entry a group:
a sliding window in tokens, or ``full``): Gemma-3's five sliding layers to one full layer above.

Prints median / min / max ms per step: "step" (the whole ``step()``),
"host" (step minus that step's sampler call) and per phase ("outputs" is the
rest: building RequestOutputs and the engine's own loop). ``--vocab`` defaults to 32768 so the CPU
argmax over the logits (GPU work in the real engine) does not dominate; the
"sample" phase is reported separately and "host" excludes it. ``--metrics`` adds "metrics": the hook
``LLM.generate`` runs on each step's outputs after the step (``ServerMetrics.on_output``), outside "host".
The outputs hold ``--warmup`` tokens and more: a long warm-up (``--warmup 500``) times steps of long outputs.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np
import torch

from kvforge.engine.block_manager import BlockManager
from kvforge.engine.block_table_cache import BlockTableCache
from kvforge.engine.gc_freeze import freeze_after_startup
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.model_runner import ModelRunner
from kvforge.engine.sampler import Sampler
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.scheduler import Scheduler
from kvforge.engine.sequence import Sequence
from kvforge.engine.step_log import StepLog


class StubRunner:
    """ModelRunner's host side (build_host + _to_device on CPU); the model returns fixed logits."""

    def __init__(self, block_size: int, vocab: int, max_seqs: int, seed: int, num_groups: int = 1):
        self._r = ModelRunner.__new__(ModelRunner)
        self._r.block_size = block_size
        self._r.num_groups = num_groups
        self._r._tables = BlockTableCache()
        self._r.device = torch.device("cpu")
        self._r._pin = False
        self.num_graph_steps = self.num_eager_steps = 0
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(max_seqs, vocab, generator=g)
        self.step_ring_slots = None
        self.times: dict[str, list[float]] | None = None

    def invalidate_block_tables(self) -> None:
        self._r.invalidate_block_tables()

    def run(self, chunks, logits_rows, placeholders=None, share_sampled=False, scoring=None):
        if scoring is not None:
            raise ValueError("the host-step benchmark's requests ask for no prompt logprobs")
        t0 = time.perf_counter()
        host = self._r.build_host(chunks, logits_rows)
        if logits_rows is not None and list(logits_rows) == list(range(host.ids.shape[0])):
            host.rows = None
        self._r._to_device(host)
        if self.times is not None:
            self.times["build_host"].append(time.perf_counter() - t0)
        n = host.ids.shape[0] if logits_rows is None else len(logits_rows)
        return self.logits[:n]


def make_engine(args) -> LLMEngine:
    eng = LLMEngine.__new__(LLMEngine)
    eng.tp = None
    eng.state_slots = None
    eng.pool = None
    bs = args.block_size
    blocks_per_seq = -(-(args.context + (args.steps + args.warmup) * 2 + 64) // bs)
    groups = args.group_windows
    eng.block_manager = BlockManager(len(groups) * args.seqs * blocks_per_seq + 16, bs, enable_prefix_caching=True,
                                     group_windows=groups)
    eng.max_model_len = args.context + 4 * (args.steps + args.warmup) + 1024
    tok = None
    if not args.no_tokenizer:
        from kvforge.spec.embedded import embedded_model_path
        from kvforge.tokenizer import load_tokenizer

        tok = load_tokenizer(str(embedded_model_path()))
    eng.tokenizer = tok
    eng.scheduler = Scheduler(eng.block_manager, args.seqs, 8192, eng.max_model_len, True,
                              eos_token_ids=(), tokenizer=tok)
    eng.runner = StubRunner(bs, args.vocab, args.seqs, args.seed, num_groups=len(groups))
    eng.sampler = Sampler()
    eng.generation_tokens_total = eng.num_steps = eng.prefill_tokens_computed = 0
    eng._shut_down, eng.proposer, eng.step_log = False, None, StepLog()
    eng.num_launches, eng.spec_backoff, eng._observes = 0, None, False
    eng.async_scheduling, eng._inflight = False, None  # the synchronous loop (no device to overlap with here)
    rng = np.random.default_rng(args.seed)
    vocab_for_prompt = min(args.vocab, 32000)
    for i in range(args.seqs):
        n = int(args.context + rng.integers(-16, 17))
        ids = rng.integers(100, vocab_for_prompt, size=n).tolist()
        eng.scheduler.add(Sequence(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=2 * (args.steps + args.warmup) + 16,
                                                                ignore_eos=True)))
    return eng


def run_phases(eng: LLMEngine, steps: int, metrics: bool = False) -> dict[str, list[float]]:
    """Time the phases of ``LLMEngine.step`` by wrapping its collaborators; with ``metrics``, also the
    metrics hook ``LLM.generate`` runs on each output after the step (``ServerMetrics.on_output``)."""
    times: dict[str, list[float]] = {k: [] for k in ("step", "host", "schedule", "build_host", "sample", "update",
                                                     "outputs")}
    hook = clocks = None
    if metrics:
        from kvforge.server.metrics import RequestTimes, ServerMetrics

        hook, clocks, times["metrics"] = ServerMetrics("bench"), {}, []
        hook.on_output(RequestTimes(arrival=0.0), eng.step()[0], 0.0)  # the hook's first call, untimed
    sched, sampler, runner = eng.scheduler, eng.sampler, eng.runner
    orig = (sched.schedule, sched.advance, sched.resolve, sampler.sample_sequences)
    update_parts: list[float] = []

    def timed(name, fn):
        def w(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
            (update_parts if name == "update" else times[name]).append(time.perf_counter() - t0)
            return r
        return w

    sched.schedule = timed("schedule", orig[0])
    sched.advance = timed("update", orig[1])  # "update" = advance + resolve (Scheduler.update)
    sched.resolve = timed("update", orig[2])
    sampler.sample_sequences = timed("sample", orig[3])
    runner.times = times
    try:
        for _ in range(steps):
            update_parts.clear()
            t0 = time.perf_counter()
            outs = eng.step()
            times["update"].append(sum(update_parts))
            total = time.perf_counter() - t0
            if hook is not None:
                t1 = time.perf_counter()
                for out in outs:
                    clock = clocks.get(out.request_id)
                    if clock is None:
                        clock = clocks[out.request_id] = RequestTimes(arrival=t1)
                    hook.on_output(clock, out, t1)
                times["metrics"].append(time.perf_counter() - t1)
            times["step"].append(total)
            times["host"].append(total - times["sample"][-1])
            known = sum(times[k][-1] for k in ("schedule", "build_host", "sample", "update"))
            times["outputs"].append(total - known)  # outputs + the engine's own loop
    finally:
        del sched.schedule, sched.advance, sched.resolve, sampler.sample_sequences
        runner.times = None
    return times


def fmt(xs: list[float]) -> str:
    ms = [x * 1e3 for x in xs]
    return f"median {statistics.median(ms):7.3f} ms  [min {min(ms):7.3f}, max {max(ms):7.3f}]"


def group_windows(text: str) -> tuple[int | None, ...]:
    """``512,full`` -> ``(512, None)``."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if part == "full":
            out.append(None)
        elif part.isdigit() and int(part) > 0:
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"{part!r} is neither a window in tokens (> 0) nor 'full'")
    return tuple(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-tokenizer", action="store_true", help="no detokenizer (token ids only)")
    ap.add_argument("--group-windows", type=group_windows, default=(None,), metavar="W,W,...",
                    help="KV-cache groups: a sliding window in tokens or 'full' each (default: one full group)")
    ap.add_argument("--metrics", action="store_true",
                    help="also time LLM.generate's metrics hook over each step's outputs (phase 'metrics', not in 'host')")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the stubbed sampler must not compete with the host thread

    eng = make_engine(args)
    freeze_after_startup()  # as the engine does at the end of its construction (kvforge/engine/gc_freeze.py)
    t0 = time.perf_counter()
    while eng.scheduler.num_waiting or any(s.num_output_tokens == 0 for s in eng.scheduler.running):
        eng.step()  # prefill (chunked by the 8192-token budget)
    prefill_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        eng.step()
    assert eng.scheduler.num_running == args.seqs, eng.scheduler.num_running

    assert len(eng.step()) == args.seqs
    gc.collect()  # start the timed steps without the setup's garbage (a full collection can take 100+ ms)
    phases = run_phases(eng, args.steps, args.metrics)

    layout = ",".join("full" if w is None else str(w) for w in args.group_windows)
    print(f"{args.seqs} seqs, context ~{args.context}, groups {layout}, block size {args.block_size}, vocab {args.vocab}, "
          f"tokenizer {'off' if args.no_tokenizer else 'on'}, {args.steps} steps after {args.warmup} "
          f"(prefill {prefill_s:.1f} s)")
    for k, v in phases.items():
        print(f"{'  ' if k not in ('step', 'host') else ''}{k:<18} {fmt(v)}")


if __name__ == "__main__":
    main()

"""``kvforge bench offline``: offline throughput with the engine in-process.

Requests have input and output lengths drawn uniformly from the given ranges
(seeded; the same lengths in every repetition, fresh random token ids each
time so the prefix cache cannot help), ignore_eos, greedy. Reports requests/s,
output and total tokens/s (each repetition and the median), the engine's own
counters over the timed runs (``engine_stats``; the warm-up's apart, ``engine_stats_warmup``; with
speculative decoding: acceptance rate and mean accepted length per run and over all
runs, ``spec_decode``), and on CUDA a memory roofline:

* decode floor: for every decode step of this exact workload (all requests
  admitted together, request ``r`` decoding for ``out_r`` steps), the bytes the
  step must read, ``weights read (all parameters but the input embedding) +
  KV of every context token of the running requests`` (of a sliding-window
  layer only the tokens inside its window; linear-attention state read and
  written once a step: ``roofline.StepKVBytes``), divided by the
  device-to-device copy bandwidth measured in the same run (bytes read and
  written per second, as in docs/KERNELS.md). Of a MoE model's routed experts
  a step reads those its running tokens pick, expected under uniform routing
  (``roofline.StepWeightBytes``: top_k / n_experts of them at batch 1, nearly
  all from a few dozen requests);
* prefill floor: ``2 x matmul parameters per token x prompt tokens`` FLOPs plus
  each prompt's causal attention FLOPs (``roofline.PrefillAttentionFlops``:
  scores and weighted values of every (query, key) pair, inside the window of
  sliding layers) at the measured bf16 GEMM rate (every parameter but the
  gathered input embedding; of a MoE layer's routed experts only
  ``top_k / n_experts``: the ones a token runs); a workload of one output token
  a request (``--output-len 1 1``) is all prefill, so its ``fraction_of_floor``
  is the prefill's fraction of the FLOP roofline;
* compute-aware decode floor (dense models): the GEMMs and the attention of
  a step are separate kernels that run one after the other, so each decode
  step takes at least ``max(weight bytes / copy bandwidth, 2 x weight
  elements x running requests / GEMM rate) + KV bytes / copy bandwidth``.
  At large batches the GEMMs are compute-bound (Llama-3.1-8B at 256
  requests: 4.8 ms of FLOPs vs 3.6 ms of weight bytes), so the byte-only
  floor is unreachable there; both are reported (``floor_s`` and
  ``floor_compute_aware_s``). MoE models skip it (their FLOPs per token are
  the active experts', not every parameter).

``--profile-decode`` then fills the engine with ``min(num_prompts,
max_num_seqs)`` requests of the mean input length, and times and profiles
steady decode steps (CUDA-graph and eager): kernel time by category (GEMM,
attention, KV write, MoE routing, linear attention, sampling, other), host
overhead = wall - GPU busy time, the longest kernels by name (``top_kernels``
in the JSON) and the torch.profiler table. ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from dataclasses import asdict

from kvforge.bench.roofline import (
    PrefillAttentionFlops,
    StepKVBytes,
    StepWeightBytes,
    dense_decode_flops_per_token,
    matmul_params_per_token,
    roofline,
    step_weight_bytes,
)
from kvforge.cli_args import model_argument, output_file
from kvforge.kernels.jit_compilations import JitCompilations
from kvforge.speculative.stats import spec_decode_summary


class LengthRange(argparse.Action):
    """``--input-len MIN MAX`` (lengths drawn uniformly from the range) or ``--input-len N`` (vLLM's form:
    every request N tokens), stored as ``[MIN, MAX]``."""

    def __call__(self, parser, namespace, values, option_string=None):
        if len(values) > 2:
            parser.error(f"argument {option_string}: expected N or MIN MAX, got {len(values)} values")
        setattr(namespace, self.dest, [values[0], values[-1]])


def add_offline_args(p: argparse.ArgumentParser) -> None:
    from kvforge.cli_args import non_negative_int, positive_int
    from kvforge.config import EngineArgs

    EngineArgs.add_cli_args(p)
    p.add_argument("--num-prompts", type=positive_int, default=256, help="requests per run (default %(default)s)")
    for flag, what in (("--input-len", "prompt"), ("--output-len", "output")):
        p.add_argument(flag, type=int, nargs="+", action=LengthRange, default=[100, 1024], metavar="N",
                       help=f"{what} tokens per request: N, or MIN MAX drawn uniformly (default 100 1024)")
    p.add_argument("--repetitions", type=positive_int, default=1,
                   help="timed runs; the median run is reported (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's sampling temperature (0: greedy, the default; > 0 runs the sampler's "
                        "random path, as most served requests do)")
    p.add_argument("--warmup-runs", type=non_negative_int, default=0,
                   help="untimed runs of the whole workload (other random prompts) before the timed ones: the "
                        "first timed run is then as fast as the next")
    p.add_argument("--profile-decode", action="store_true", help="CUDA: time and profile steady decode steps")
    p.add_argument("--out", type=output_file, default=None, help="write the JSON result here")


# ---- measurements on the device -------------------------------------------------------------------------------
def _copy_bandwidth(device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate, bytes read + written per second (median of 10)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def _gemm_rate(device) -> float:
    import torch

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        a @ b
    e.record()
    e.synchronize()
    return 10 * 2 * 8192**3 / (s.elapsed_time(e) / 1e3)


_CATEGORIES = [
    ("allreduce", re.compile(r"AllReduce", re.I)),  # NCCL all-reduce kernels (tensor parallelism)
    ("nccl_other", re.compile(r"nccl", re.I)),      # other NCCL kernels (e.g. the logits gather)
    ("attention", re.compile(r"_paged_attn_kernel|_gluon_fp8_decode|_mla_decode|_merge_splits")),
    ("kv_write", re.compile(r"_write_kv")),
    # a MoE layer's router choice and its rows grouped by expert and summed back
    ("moe_routing", re.compile(r"_router_|_group_rows|_combine_rows")),
    # linear-attention layers: the delta rule (recurrent and chunked), the short conv, the gates, the gated norm
    ("linear_attention", re.compile(r"_recurrent_kernel|_chunk_prep_kernel|_chunk_state_kernel|_conv1d_|_delta_gates|_gated_rms_norm")),
    # cuBLAS's kernels, the small-M Triton kernel and its split-K sum, the Triton expert kernel
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|splitKreduce|_small_m_linear|_sum_splits", re.I)),
    ("sampling", re.compile(r"argmax", re.I)),
]


def kernel_category(name: str) -> str:
    """The profile category (:data:`_CATEGORIES`, else ``other``) of a CUDA kernel named ``name``."""
    for category, rx in _CATEGORIES:
        if rx.search(name):
            return category
    return "other"


#: Kernels a profile lists by name (the longest first).
TOP_KERNELS = 25


def top_kernels(events, n_steps: int, limit: int = TOP_KERNELS) -> list[dict]:
    """The ``limit`` kernels of ``events`` (``(name, device microseconds, calls)`` over ``n_steps`` steps) that
    ran longest on the GPU: name, category, milliseconds and calls per step."""
    rows = sorted(((name, us, calls) for name, us, calls in events if us), key=lambda r: -r[1])[:limit]
    return [{"name": name, "category": kernel_category(name), "ms_per_step": us / 1e3 / n_steps,
             "calls_per_step": calls / n_steps} for name, us, calls in rows]


def _profile_steps(engine, n_steps: int, label: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n_steps):
            engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n_steps
    cats = {k: 0.0 for k, _ in _CATEGORIES}
    cats["other"] = 0.0
    kernels = []
    for evt in prof.key_averages():
        dev_t = getattr(evt, "self_device_time_total", None)
        if dev_t is None:
            dev_t = getattr(evt, "self_cuda_time_total", 0.0)
        if not dev_t or str(getattr(evt, "device_type", "")).split(".")[-1] != "CUDA":
            continue
        cats[kernel_category(evt.key)] += dev_t
        kernels.append((evt.key, dev_t, evt.count))
    per_step_ms = {k: v / 1e3 / n_steps for k, v in cats.items()}
    gpu = sum(per_step_ms.values())
    try:
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18)
    except Exception:  # noqa: BLE001 - older/newer column names
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=18)
    print(f"\n== decode step profile ({label}, {n_steps} steps) ==\n{table}", file=sys.stderr)
    return {"mode": label, "wall_ms_per_step": wall * 1e3, "gpu_kernel_ms_per_step": gpu,
            "host_overhead_ms_per_step": wall * 1e3 - gpu, "kernel_ms_per_step": per_step_ms,
            "top_kernels": top_kernels(kernels, n_steps)}


def profile_decode(llm, in_len: int, weights: StepWeightBytes, copy_bw: float | None) -> dict:
    """Steady decode at min(num_prompts, max_num_seqs) running requests of ``in_len`` tokens."""
    from kvforge.engine.sampling_params import SamplingParams

    engine = llm.engine
    batch = engine.args.max_num_seqs
    rng = random.Random(1234)
    vocab = engine.spec.vocab_size
    ids = [f"prof-{i}" for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, [rng.randrange(10, vocab - 10) for _ in range(in_len)], params)
    while True:  # until a step is pure decode of the whole batch
        outs = engine.step()
        if len(outs) == batch and all(len(o.outputs[0].token_ids) > 1 for o in outs):
            break
    for _ in range(3):
        engine.step()
    t0 = time.perf_counter()
    timed = 20
    for _ in range(timed):
        engine.step()
    wall_graph = (time.perf_counter() - t0) / timed
    ctx = in_len + 25
    kv_step = batch * ctx * engine.plan.bytes_per_token
    floor_ms = (weights.at_batch(batch) + kv_step) / copy_bw * 1e3 if copy_bw else None
    result = {"batch": batch, "context_tokens": ctx, "step_floor_ms": floor_ms,
              "wall_ms_per_step_graph_timed": wall_graph * 1e3, "profiles": []}
    result["profiles"].append(_profile_steps(engine, 5, "cudagraph" if engine.runner.graphs else "eager"))
    if engine.runner.graphs is not None:
        graphs, engine.runner.graphs = engine.runner.graphs, None
        try:
            engine.step()
            result["profiles"].append(_profile_steps(engine, 5, "eager"))
        finally:
            engine.runner.graphs = graphs
    for rid in ids:
        engine.abort_request(rid)
    return result


# ---- the workload ---------------------------------------------------------------------------------------------
def make_workload(num_prompts: int, input_len, output_len, rng: random.Random, temperature: float = 0.0):
    """Seeded input and output lengths (uniform in the inclusive ranges) and one SamplingParams per request
    (greedy, or sampled at ``temperature``)."""
    from kvforge.engine.sampling_params import SamplingParams

    in_lens = [rng.randint(*input_len) for _ in range(num_prompts)]
    out_lens = [rng.randint(*output_len) for _ in range(num_prompts)]
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in out_lens]
    return in_lens, out_lens, params


# engine.stats() keys that describe the engine's state now (gauges, flags), not a count since startup.
STATE_STATS = frozenset({"num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "async_scheduling"})


def stats_between(before: dict, after: dict) -> dict:
    """``engine.stats()`` over an interval: each counter's growth from ``before`` to ``after`` (nested in
    ``spec_decode``, and per position in its lists); the :data:`STATE_STATS` and anything not a number
    as they are in ``after``."""

    def grow(key, a, b):
        if key in STATE_STATS or isinstance(a, bool) or b is None:
            return a
        if isinstance(a, dict):
            return {k: grow(k, v, b.get(k)) for k, v in a.items()}
        if isinstance(a, list):
            return [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
        if isinstance(a, (int, float)):
            return a - b
        return a

    return {k: grow(k, v, before.get(k)) for k, v in after.items()}


def warm_up(llm, lengths=(16, 300, 700)) -> None:
    """Three short requests before the timed runs, unless the engine ran its own startup warm-up
    (kvforge/engine/warm_up.py; off on CPU). Prompts are cut to leave room for their 8 tokens, but keep at
    least one token (a short --max-model-len)."""
    from kvforge.engine.sampling_params import SamplingParams

    if llm.engine.warmed_up:
        return
    n_max = max(1, llm.engine.max_model_len - 9)
    warm = [{"prompt_token_ids": [11 + i] * min(n, n_max)} for i, n in enumerate(lengths)]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)


def step_seconds(records) -> dict | None:
    """Where a run's wall time went by kind of step, from its records in the engine's step log (each
    record's ``seconds``: the time the step had to itself): steps with prompt tokens and decode-only steps,
    their counts and seconds, and the first prompt step's seconds (the step a host that idled before the run
    slows most; docs/BENCHMARKS.md "Startup and first requests"). None without records."""
    if not records:
        return None
    prompt = [r.seconds for r in records if r.num_prefill_tokens]
    decode = [r.seconds for r in records if not r.num_prefill_tokens]
    return {"prompt_steps": len(prompt), "prompt_seconds": sum(prompt), "decode_steps": len(decode),
            "decode_seconds": sum(decode), "first_prompt_step_seconds": prompt[0] if prompt else None}


def timed_run(llm, in_lens, params, rng: random.Random, label: str = "run") -> dict:
    """One generate() over fresh random prompts of ``in_lens`` tokens; throughput, step counters, the
    Triton kernels compiled during the run (``kernel_compilations``, their names in
    ``kernel_compilation_names``; none once the engine has warmed up) and
    the run's time by kind of step (``step_seconds``: None where the step log no longer holds the run's
    first step)."""
    engine = llm.engine
    vocab = engine.spec.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(n)]} for n in in_lens]
    before = engine.stats()
    first_step = engine.step_log.total
    with JitCompilations() as compiled:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
    after = engine.stats()
    n_in = sum(in_lens)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    run = {"seconds": dt, "output_tokens": n_out, "input_tokens": n_in,
           "requests_per_s": len(in_lens) / dt, "output_tokens_per_s": n_out / dt,
           "total_tokens_per_s": (n_in + n_out) / dt,
           "steps": after["num_steps"] - before["num_steps"],
           "graph_steps": after["graph_steps"] - before["graph_steps"],
           "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
           "kernel_compilations": len(compiled.names), "kernel_compilation_names": sorted(compiled.names)}
    records = engine.step_log.since(first_step)
    run["step_seconds"] = step_seconds(records) if records and records[0].step == first_step else None
    spec = spec_decode_summary(before.get("spec_decode"), after.get("spec_decode"))
    accepted = ""
    if spec is not None:
        run["spec_decode"] = spec
        accepted = (f", acceptance {spec['acceptance_rate']:.1%}, mean accepted length "
                    f"{spec['mean_accepted_length']:.2f}")
    split = run["step_seconds"]
    where = ""
    if split is not None and split["prompt_steps"]:
        where = (f"; prompt steps {split['prompt_seconds']:.2f} s (the first {split['first_prompt_step_seconds'] * 1e3:.0f}"
                 f" ms), decode steps {split['decode_seconds']:.2f} s")
    print(f"{label}: {dt:.2f} s, output {n_out / dt:.0f} tok/s, total {(n_in + n_out) / dt:.0f} tok/s, "
          f"{run['steps']} steps ({run['graph_steps']} graph){accepted}"
          + (f", {len(compiled.names)} kernel compilations" if compiled.names else "") + where, file=sys.stderr,
          flush=True)
    return run


def check_lengths(input_len, output_len, max_model_len: int | None) -> None:
    """Refuse length ranges that cannot run (before any weight loads): each range is MIN <= MAX with
    MIN >= 1, and the longest request (input MAX + output MAX) fits --max-model-len when it is given."""
    from kvforge.errors import ConfigError

    for flag, (lo, hi) in (("--input-len", input_len), ("--output-len", output_len)):
        if not 1 <= lo <= hi:
            raise ConfigError(f"{flag} {lo} {hi}: need 1 <= MIN <= MAX")
    longest = input_len[1] + output_len[1]
    if max_model_len is not None and longest > max_model_len:
        raise ConfigError(f"the longest request is --input-len MAX {input_len[1]} + --output-len MAX {output_len[1]} "
                          f"= {longest} tokens, over --max-model-len {max_model_len}; fix: lower the MAX values "
                          f"(e.g. --input-len {min(input_len[0], max_model_len // 2)} {max_model_len // 2} "
                          f"--output-len {min(output_len[0], max_model_len // 2)} {max_model_len // 2}) "
                          f"or raise --max-model-len")


# ---- main -----------------------------------------------------------------------------------------------------
def offline_main(args: argparse.Namespace) -> int:
    import torch

    from kvforge.config import EngineArgs
    from kvforge.engine.sampling_params import SamplingParams
    from kvforge.llm import LLM
    from kvforge.planner.resolver import planned_max_model_len
    from kvforge.spec.load import load_model_spec

    # the model's config only (no weights yet): a workload longer than the context fails before loading
    check_lengths(args.input_len, args.output_len, planned_max_model_len(load_model_spec(model_argument(args)),
                                                                         args.max_model_len))
    SamplingParams(temperature=args.temperature)  # a bad --temperature fails before loading too
    t_start = time.perf_counter()
    llm = LLM(**EngineArgs.from_cli_args(args).__dict__)
    startup = time.perf_counter() - t_start
    engine = llm.engine
    check_lengths(args.input_len, args.output_len, engine.max_model_len)
    rng = random.Random(args.seed)
    in_lens, out_lens, params = make_workload(args.num_prompts, args.input_len, args.output_len, rng,
                                              args.temperature)
    at_start = engine.stats()
    warm_up(llm)
    warm_rng = random.Random(args.seed + 1)  # the timed runs' prompts do not depend on the warm-up runs
    for rep in range(args.warmup_runs):
        timed_run(llm, in_lens, params, warm_rng, f"warm-up run {rep}")
    warmed = engine.stats()
    runs = [timed_run(llm, in_lens, params, rng, f"run {rep}") for rep in range(args.repetitions)]
    timed = stats_between(warmed, engine.stats())
    median_run = median_run_of(runs)
    med = {k: median_run[k] for k in ("seconds", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s")}
    result = {
        "model": engine.model_name, "load_format": weights_source(engine),
        "kv_cache_dtype": llm.plan.kv_cache_dtype, "model_dtype": llm.plan.model_dtype,
        "block_size": llm.plan.block_size, "max_model_len": llm.plan.max_model_len,
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "input_tokens": sum(in_lens), "output_tokens": sum(out_lens), "temperature": args.temperature,
        "median": med, "runs": runs,
        "warmup_runs": args.warmup_runs,
        "capacity_tokens": llm.plan.capacity_tokens, "engine_stats": timed,
        "engine_stats_warmup": stats_between(at_start, warmed), "device": str(engine.device),
        "startup_seconds": startup, "enforce_eager": engine.args.enforce_eager,
        "async_scheduling": engine.async_scheduling,
        "speculative_config": asdict(engine.speculative) if engine.speculative is not None else None,
        "versions": {"torch": torch.__version__},
    }
    # Back-compat top-level keys (first consumers read these).
    result.update({"seconds": med["seconds"], "requests_per_s": med["requests_per_s"],
                   "output_tokens_per_s": med["output_tokens_per_s"], "total_tokens_per_s": med["total_tokens_per_s"]})
    if engine.speculative is not None:  # over the timed runs together
        spec = [r["spec_decode"] for r in runs]
        total = {k: sum(x[k] for x in spec) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        total["accepted_per_pos"] = [sum(col) for col in zip(*(x["accepted_per_pos"] for x in spec))]
        result["spec_decode"] = spec_decode_summary(None, total)
    if engine.device.type == "cuda":
        import triton

        graphs = engine.runner.graphs
        result["versions"]["triton"] = triton.__version__
        result["gpu"] = torch.cuda.get_device_name(engine.device)
        result["graph_capture_seconds"] = graphs.capture_seconds if graphs else None
        result["graph_sizes"] = graphs.sizes if graphs else None
        copy_bw = _copy_bandwidth(engine.device)
        gemm = _gemm_rate(engine.device)
        weights = step_weight_bytes(engine.model)
        kv = StepKVBytes.from_plan(llm.plan)
        attention = PrefillAttentionFlops.from_plan(engine.spec, llm.plan)
        roof = roofline(in_lens, out_lens, weights, kv, copy_bw, matmul_params_per_token(engine.model), gemm,
                        dense_decode_flops_per_token(engine.model), attention)
        result.update({"copy_bandwidth_Bps": copy_bw, "gemm_bf16_flops": gemm, "weights_read_bytes": weights.total,
                       "moe_routed_weight_bytes": weights.routed,
                       "kv_bytes_per_token": llm.plan.bytes_per_token, "kv_step_bytes": asdict(kv),
                       "prefill_attention_flops_per_pair": attention.per_pair,
                       "roofline": roof,
                       "fraction_of_floor": roof["floor_s"] / med["seconds"]})
        if "floor_compute_aware_s" in roof:
            result["fraction_of_compute_aware_floor"] = roof["floor_compute_aware_s"] / med["seconds"]
    if args.profile_decode:
        result["decode_profile"] = profile_decode(llm, round(sum(in_lens) / len(in_lens)),
                                                   step_weight_bytes(engine.model),
                                                   result.get("copy_bandwidth_Bps"))
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(summary_line(result), file=sys.stderr, flush=True)
    return 0


def weights_source(engine) -> str:
    """Where the engine's weights came from: dummy (random), gguf or safetensors."""
    if engine.load_format != "auto":
        return engine.load_format
    from kvforge.weights import detect_load_format

    return detect_load_format(engine.model_path)


def median_run_of(runs: list[dict]) -> dict:
    """The run at the median time (for an even count the slower of the two middle runs): every field of the
    reported median then comes from one run and agrees with the others."""
    ranked = sorted(runs, key=lambda r: r["seconds"])
    return ranked[len(ranked) // 2]


def summary_line(result: dict) -> str:
    """One line for a reader: the median run's rates, the weights' source and the fraction of the floor."""
    med, runs = result["median"], len(result["runs"])
    line = (f"throughput: {med['requests_per_s']:.2f} requests/s, {med['output_tokens_per_s']:,.1f} output tok/s, "
            f"{med['total_tokens_per_s']:,.1f} total tok/s ({'median of ' + str(runs) + ' runs' if runs > 1 else '1 run'}"
            f"; {result['model']}, {result['load_format']} weights, KV {result['kv_cache_dtype']})")
    if "fraction_of_floor" in result:
        line += f"; {result['fraction_of_floor']:.1%} of the floor"
    return line

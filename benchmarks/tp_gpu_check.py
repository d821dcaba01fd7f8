"""Tensor parallelism on two GPUs: one script, seven independent parts.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 benchmarks/tp_gpu_check.py --out tp.json [--parts a,b,c,d,e,f,g] [--tiny]

a. Llama-3.1-8B architecture, dummy weights, fp8 KV, no --block-size, TP=2 (CUDA graphs on): chosen block
   size, per-rank capacity, every rank's pool bytes == plan, graph sizes and graph/eager step counters of
   every rank; then TP=1: greedy-token agreement and max |logit difference| TP2 vs TP1 (same dummy model).
b. DeepSeek-V2-Lite architecture, dummy weights, fp8 KV, TP=2: the plan's MLA backend, block size,
   per-rank capacity, pool bytes == plan, generation (finite logits).
c. Offline throughput TP=1 vs TP=2 (Llama-3.1-8B arch, fp8 KV; kvforge/bench/offline.py's workload):
   CUDA graphs on, then eager on the same engine (rank 0 turns graphs off; the workers follow).
d. One decode step at TP=2 (batch 64, graphs and eager): torch.profiler on rank 0, NCCL all-reduce kernel
   time vs everything else (ms per step and %).
e. `kvforge serve --tensor-parallel-size 2` (subprocess, --skip-tokenizer-init): token-id completions
   (expect 200), a text prompt (expect 400: no tokenizer), /metrics, SIGTERM -> exit 0, worker gone.
f. `--async-scheduling` at TP=2 vs the synchronous TP=2 engine (same dummy weights): greedy tokens and a
   stop-token run identical, both ranks' graph/eager counters equal, every block freed.
g. Qwen3-Next-80B-A3B architecture (its bf16 weights need two H200s), dummy weights, TP=2: every rank's pool
   bytes and state-slot bytes per linear-attention layer == plan, generation (finite logits), graph counters.

Every part runs in its own process group with a timeout (killed with its TP workers when it runs over),
so a failure or hang is reported and the next part still runs; the JSON is rewritten after every part.
Execution order is a, c, d, e, b (DeepSeek last: slowest and newest); the table is printed in a..e order.
``--device cpu`` runs every part on tiny dummy configs with gloo (a smoke test of the code paths; CPU
"graph" steps use the static padded decode inputs without capture, the runners' static_decode_on_cpu).
``TP_CHECK_DTYPE=float32`` (or ``--dtype float32``): float32 weights and KV for part a's logits check.
``--tiny``: the tiny dummy configs on CUDA too (quick checks of code paths on GPUs, e.g. part f).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

os.environ["NCCL_NVLS_ENABLE"] = "0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PARTS = {
    "a": "Llama-3.1-8B TP=2: plan, pool bytes, graphs; TP2 vs TP1 tokens and logits",
    "b": "DeepSeek-V2-Lite TP=2: MLA backend, plan, pool bytes, generation",
    "c": "offline throughput TP=1 vs TP=2, graphs and eager",
    "d": "TP=2 decode step: all-reduce vs compute",
    "e": "kvforge serve -tp 2: completions, /metrics, shutdown",
    "f": "async scheduling at TP=2 vs synchronous TP=2",
    "g": "Qwen3-Next-80B TP=2: pool and state-slot bytes vs plan, generation",
}
ORDER = "acdefbg"
# Per-part limits: an 8B engine start + Triton compile + graph capture is ~20-60 s per engine, so the
# Llama parts need minutes; run one or two parts per command where a command's time is limited.
TIMEOUT_S = {"a": 300, "b": 200, "c": 420, "d": 240, "e": 240, "f": 300, "g": 420}
GIB = 2**30

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 255, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}
TINY_DEEPSEEK = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 64,
                 "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96,
                 "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
                 "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8,
                 "qk_nope_head_dim": 16, "v_head_dim": 16, "vocab_size": 255, "max_position_embeddings": 1024,
                 "rms_norm_eps": 1e-5, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                 "routed_scaling_factor": 1.0, "scoring_func": "softmax", "norm_topk_prob": False,
                 "torch_dtype": "float32"}
TINY_QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 64,
                   "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                   "intermediate_size": 96, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "num_experts": 6,
                   "num_experts_per_tok": 2, "vocab_size": 255, "max_position_embeddings": 1024,
                   "rms_norm_eps": 1e-6, "full_attention_interval": 4, "torch_dtype": "float32"}


# ---- settings ------------------------------------------------------------------------------------------------
def settings(o: argparse.Namespace) -> dict:
    gpu = o.device == "cuda" and not o.tiny  # the tiny configs hold 1024 positions: the CPU workload sizes
    s = {
        "device": o.device, "llama": o.llama, "deepseek": o.deepseek, "linear": o.linear,
        "dtype": o.dtype, "kv": "auto" if o.dtype == "float32" else o.kv_cache_dtype,
        "max_model_len": 4096 if gpu else 512, "kv_cache_memory": 16 * GIB if gpu else 32 * 2**20,
        "a_prompts": 4, "a_tokens": 24, "b_prompts": 2, "b_tokens": 16,
        "c_prompts": o.c_prompts or (256 if gpu else 16), "c_input": (100, 512) if gpu else (8, 48),
        "c_output": (64, 256) if gpu else (4, 16), "d_batch": 64 if gpu else 8, "d_input": 512 if gpu else 32,
        "e_requests": 4, "e_tokens": 16,
    }
    return s


def engine_kwargs(s: dict, model: str, **kw) -> dict:
    base = dict(model=model, load_format="dummy", device=s["device"], kv_cache_dtype=s["kv"], dtype=s["dtype"],
                skip_tokenizer_init=True, max_model_len=s["max_model_len"], kv_cache_memory=s["kv_cache_memory"],
                progress=False)
    base.update(kw)
    return base


def make_llm(s: dict, model: str, **kw):
    from kvforge import LLM

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(s, model, **kw))
    print(f"[engine] {model} tp={kw.get('tensor_parallel_size', 1)} started in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return llm, time.perf_counter() - t0


def free_memory() -> None:
    """After ``engine.shutdown()`` and dropping every reference to the LLM: release its GPU memory."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def plan_info(llm) -> dict:
    from kvforge.distributed.launcher import expected_pool_bytes

    plan, engine = llm.plan, llm.engine
    want = expected_pool_bytes(plan)
    reports = engine.tp.reports if engine.tp is not None else [{"rank": 0, "nbytes": engine.pool.nbytes}]
    info = {
        "tp": plan.tensor_parallel_size if hasattr(plan, "tensor_parallel_size") else len(reports),
        "backends": sorted({layer.backend for layer in plan.layers}),
        "kv_cache_dtype": plan.kv_cache_dtype, "model_dtype": plan.model_dtype,
        "block_size": plan.block_size, "block_size_reason": plan.block_size_reason,
        "kv_heads_per_rank": next(x for x in plan.layers if x.kind != "state").kv_heads_per_rank, "bytes_per_token_per_rank": plan.bytes_per_token,
        "num_blocks_per_rank": plan.num_blocks, "capacity_tokens_per_rank": plan.capacity_tokens,
        "weights_bytes_per_rank": plan.weights_bytes_per_rank, "pool_bytes_plan": want,
        "pool_bytes_per_rank": [r["nbytes"] for r in reports],
        "pool_bytes_equal_plan": all(r["nbytes"] == want for r in reports),
        "graph_sizes_per_rank": [r.get("graph_sizes") for r in reports] if engine.tp is not None
        else [engine.runner.graphs.sizes if engine.runner.graphs is not None else None],
        "graphs_off_reason": engine.runner.graphs_off_reason,
        "rank_reports": reports,
    }
    print(f"[plan] backends {info['backends']}, block size {info['block_size']} ({info['block_size_reason']}), "
          f"{info['kv_heads_per_rank']} KV heads/rank, {info['bytes_per_token_per_rank']} B/token/rank, "
          f"{info['num_blocks_per_rank']} blocks = {info['capacity_tokens_per_rank']} tokens per rank; pool bytes "
          f"per rank {info['pool_bytes_per_rank']} vs plan {want}: "
          f"{'EQUAL' if info['pool_bytes_equal_plan'] else 'DIFFERENT'}; graphs {info['graph_sizes_per_rank']} "
          f"(off: {info['graphs_off_reason']})", flush=True)
    return info


def counters(llm) -> list[dict]:
    c = llm.engine.rank_counters()
    print("[counters] " + "; ".join(f"rank {r['rank']}: {r['num_graph_steps']} graph / {r['num_eager_steps']} eager "
                                    f"steps" for r in c), flush=True)
    return c


def _prompts(n: int, vocab: int) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 13 * j) % (vocab - 100) + 50 for j in range(40 + 17 * i)]}
            for i in range(n)]


# ---- parts (each runs in its own child process) --------------------------------------------------------------
def part_a(s: dict) -> dict:
    from kvforge import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=s["a_tokens"], ignore_eos=True)
    out = {}
    for tp in (2, 1):
        llm, startup = make_llm(s, s["llama"], tensor_parallel_size=tp)
        try:
            r = {"startup_s": round(startup, 1), **plan_info(llm)}
            prompts = _prompts(s["a_prompts"], llm.engine.spec.vocab_size)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            r["generate_s"] = round(time.perf_counter() - t0, 2)
            r["tokens"] = [o.outputs[0].token_ids for o in outs]
            r["counters"] = counters(llm)
            r["logits"] = llm.engine.compute_prompt_logits(prompts[1]["prompt_token_ids"]).float().cpu()
        finally:
            llm.engine.shutdown()
            del llm
            free_memory()
        out[f"tp{tp}"] = r
    t1, t2 = out["tp1"], out["tp2"]
    match = sum(x == y for a, b in zip(t1["tokens"], t2["tokens"]) for x, y in zip(a, b))
    total = sum(len(a) for a in t1["tokens"])
    diff = (t1.pop("logits") - t2.pop("logits")).abs().max().item()
    out.update(token_agreement=f"{match}/{total}", identical_sequences=[a == b for a, b in zip(t1["tokens"],
                                                                                              t2["tokens"])],
               max_abs_logit_diff_tp1_vs_tp2=diff, dtype=s["dtype"], kv=s["kv"])
    g2 = t2["counters"]
    out["ok"] = bool(t2["pool_bytes_equal_plan"] and all(len(t) == s["a_tokens"] for t in t2["tokens"]))
    out["brief"] = (f"block {t2['block_size']}, {t2['capacity_tokens_per_rank']:,} tok/rank, pool==plan "
                    f"{t2['pool_bytes_equal_plan']}, graph steps/rank {[c['num_graph_steps'] for c in g2]}, "
                    f"TP2 vs TP1 tokens {match}/{total}, max|dlogit| {diff:.2g}")
    return out


def part_f(s: dict) -> dict:
    from kvforge import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=s["a_tokens"], ignore_eos=True)
    out, stop = {}, None
    for mode in ("sync", "async"):
        llm, startup = make_llm(s, s["llama"], tensor_parallel_size=2, async_scheduling=mode == "async")
        try:
            prompts = _prompts(s["a_prompts"], llm.engine.spec.vocab_size)
            r = {"startup_s": round(startup, 1), "async_scheduling": llm.engine.async_scheduling}
            t0 = time.perf_counter()
            r["tokens"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            r["generate_s"] = round(time.perf_counter() - t0, 2)
            if stop is None:  # a stop token the first (sync) run produces mid-way
                stop = SamplingParams(temperature=0, max_tokens=s["a_tokens"],
                                      stop_token_ids=[r["tokens"][1][len(r["tokens"][1]) // 2]])
            r["stop_tokens"] = [o.outputs[0].token_ids for o in llm.generate(prompts, stop, use_tqdm=False)]
            r["counters"] = counters(llm)
            r["kv_blocks_used"] = llm.engine.stats()["kv_blocks_used"]
        finally:
            llm.engine.shutdown()
            del llm
            free_memory()
        out[mode] = r
    a, b = out["sync"], out["async"]
    same = a["tokens"] == b["tokens"] and a["stop_tokens"] == b["stop_tokens"]
    c = b["counters"]
    ranks_agree = all((x["num_graph_steps"], x["num_eager_steps"]) == (c[0]["num_graph_steps"],
                                                                       c[0]["num_eager_steps"]) for x in c)
    out["ok"] = bool(same and ranks_agree and b["async_scheduling"] and b["kv_blocks_used"] == 0)
    out["brief"] = (f"async tokens == sync: {same} (stop run included), rank counters agree {ranks_agree} "
                    f"(graph steps {[x['num_graph_steps'] for x in c]}), blocks freed {b['kv_blocks_used'] == 0}, "
                    f"generate {a['generate_s']} s sync vs {b['generate_s']} s async")
    return out


def part_b(s: dict) -> dict:
    import torch

    from kvforge import SamplingParams

    llm, startup = make_llm(s, s["deepseek"], tensor_parallel_size=2)
    try:
        r = {"startup_s": round(startup, 1), **plan_info(llm)}
        prompts = _prompts(s["b_prompts"], llm.engine.spec.vocab_size)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=s["b_tokens"], ignore_eos=True),
                            use_tqdm=False)
        r["generate_s"] = round(time.perf_counter() - t0, 2)
        r["tokens"] = [o.outputs[0].token_ids for o in outs]
        r["counters"] = counters(llm)
        logits = llm.engine.compute_prompt_logits(prompts[0]["prompt_token_ids"])
        r["logits_finite"] = bool(torch.isfinite(logits).all().item())
    finally:
        llm.engine.shutdown()
        del llm
        free_memory()
    n = sum(len(t) for t in r["tokens"])
    r["ok"] = bool(r["pool_bytes_equal_plan"] and r["logits_finite"] and n == s["b_prompts"] * s["b_tokens"])
    r["brief"] = (f"backends {r['backends']}, block {r['block_size']}, {r['capacity_tokens_per_rank']:,} tok/rank, "
                  f"pool==plan {r['pool_bytes_equal_plan']}, {n} tokens in {r['generate_s']} s, finite logits "
                  f"{r['logits_finite']}, graphs {'off: ' + str(r['graphs_off_reason']) if not r['graph_sizes_per_rank'][0] else 'on'}")
    return r


def part_g(s: dict) -> dict:
    import torch

    from kvforge import SamplingParams
    from kvforge.distributed.launcher import expected_state_bytes

    llm, startup = make_llm(s, s["linear"], tensor_parallel_size=2)
    try:
        r = {"startup_s": round(startup, 1), **plan_info(llm)}
        want = expected_state_bytes(llm.plan)
        r["state_slots"] = llm.plan.capacity.state_slots
        r["state_bytes_per_slot_plan"] = want
        r["state_bytes_equal_plan"] = all(x["state_bytes"] == want for x in r["rank_reports"])
        prompts = _prompts(s["b_prompts"], llm.engine.spec.vocab_size)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=s["b_tokens"], ignore_eos=True),
                            use_tqdm=False)
        r["generate_s"] = round(time.perf_counter() - t0, 2)
        r["tokens"] = [o.outputs[0].token_ids for o in outs]
        r["counters"] = counters(llm)
        logits = llm.engine.compute_prompt_logits(prompts[0]["prompt_token_ids"])
        r["logits_finite"] = bool(torch.isfinite(logits).all().item())
    finally:
        llm.engine.shutdown()
        del llm
        free_memory()
    n = sum(len(t) for t in r["tokens"])
    r["ok"] = bool(r["pool_bytes_equal_plan"] and r["state_bytes_equal_plan"] and r["logits_finite"]
                   and n == s["b_prompts"] * s["b_tokens"])
    graph_steps = [c["num_graph_steps"] for c in r["counters"]]
    r["brief"] = (f"{r['state_slots']} state slots, state==plan {r['state_bytes_equal_plan']}, pool==plan "
                  f"{r['pool_bytes_equal_plan']}, weights {r['weights_bytes_per_rank'] / GIB:.1f} GiB/rank, {n} tokens "
                  f"in {r['generate_s']} s, finite logits {r['logits_finite']}, graph steps per rank {graph_steps} "
                  f"(off: {r['graphs_off_reason']}), startup {r['startup_s']} s")
    return r


def part_c(s: dict) -> dict:
    import random

    from kvforge.bench.offline import make_workload, timed_run, warm_up

    rng = random.Random(0)
    in_lens, out_lens, params = make_workload(s["c_prompts"], s["c_input"], s["c_output"], rng)
    out = {"num_prompts": s["c_prompts"], "input_len": s["c_input"], "output_len": s["c_output"],
           "input_tokens": sum(in_lens), "output_tokens": sum(out_lens)}
    print(f"[workload] {s['c_prompts']} requests, {sum(in_lens)} input + {sum(out_lens)} output tokens", flush=True)
    for tp in (2, 1):
        llm, startup = make_llm(s, s["llama"], tensor_parallel_size=tp)
        try:
            r = {"startup_s": round(startup, 1), "block_size": llm.plan.block_size,
                 "capacity_tokens_per_rank": llm.plan.capacity_tokens}
            warm_up(llm)
            runner = llm.engine.runner
            r["graphs_on"] = runner.graphs is not None
            wl = random.Random(1 + tp)  # fresh prompt ids (the prefix cache cannot help), same lengths
            r["graph"] = timed_run(llm, in_lens, params, wl, f"TP={tp} graphs" if r["graphs_on"] else f"TP={tp}")
            if r["graphs_on"]:
                graphs, runner.graphs = runner.graphs, None
                try:
                    r["eager"] = timed_run(llm, in_lens, params, wl, f"TP={tp} eager")
                finally:
                    runner.graphs = graphs
            r["counters"] = counters(llm)
        finally:
            llm.engine.shutdown()
            del llm
            free_memory()
        out[f"tp{tp}"] = r

    def fmt(r):
        return f"{r['output_tokens_per_s']:,.0f}/{r['total_tokens_per_s']:,.0f}"

    cells = []
    for tp in (1, 2):
        r = out[f"tp{tp}"]
        cells.append(f"TP{tp} {'graph' if r['graphs_on'] else 'eager'} {fmt(r['graph'])}")
        if "eager" in r:
            cells.append(f"TP{tp} eager {fmt(r['eager'])}")
    out["ok"] = True
    out["brief"] = "out/total tok/s: " + ", ".join(cells)
    return out


def part_d(s: dict) -> dict:
    from kvforge.bench.offline import profile_decode
    from kvforge.bench.roofline import StepWeightBytes, step_weight_bytes

    llm, startup = make_llm(s, s["llama"], tensor_parallel_size=2, max_num_seqs=s["d_batch"])
    try:
        try:
            weights = step_weight_bytes(llm.engine.model)
        except Exception:  # noqa: BLE001 - only used for a floor we do not print here
            weights = StepWeightBytes(dense=0)
        res = profile_decode(llm, s["d_input"], weights, None)
        res["counters"] = counters(llm)
    finally:
        llm.engine.shutdown()
        del llm
        free_memory()
    res["startup_s"] = round(startup, 1)
    cells = []
    for p in res["profiles"]:
        k = p["kernel_ms_per_step"]
        ar, other_nccl = k.get("allreduce", 0.0), k.get("nccl_other", 0.0)
        gpu = p["gpu_kernel_ms_per_step"]
        compute = gpu - ar - other_nccl
        p["split"] = {"allreduce_ms": ar, "nccl_other_ms": other_nccl, "compute_ms": compute, "gpu_ms": gpu,
                      "wall_ms": p["wall_ms_per_step"],
                      "allreduce_pct_of_gpu": 100 * ar / gpu if gpu else None,
                      "allreduce_pct_of_wall": 100 * ar / p["wall_ms_per_step"] if p["wall_ms_per_step"] else None}
        sp = p["split"]
        line = (f"{p['mode']}: wall {sp['wall_ms']:.2f} ms/step, GPU kernels {gpu:.2f} ms = compute {compute:.2f} "
                f"+ all-reduce {ar:.2f} ({sp['allreduce_pct_of_gpu'] or 0:.0f}% of GPU time) + other NCCL "
                f"{other_nccl:.2f}")
        print(f"[split] batch {res['batch']}, context ~{res['context_tokens']}: {line}", flush=True)
        cells.append(f"{p['mode']} {sp['wall_ms']:.1f} ms: AR {ar:.2f} ms ({sp['allreduce_pct_of_gpu'] or 0:.0f}%), "
                     f"compute {compute:.2f} ms")
    res["ok"] = True
    res["brief"] = f"batch {res['batch']}, timed {res['wall_ms_per_step_graph_timed']:.1f} ms/step; " + "; ".join(cells)
    return res


def _http(method: str, url: str, body=None, timeout: float = 120):
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def part_e(s: dict, deadline: float) -> dict:
    import socket
    from concurrent.futures import ThreadPoolExecutor

    from kvforge.server.metrics import metric_sum, parse_prometheus

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "kvforge.server.cli", s["llama"], "--load-format", "dummy", "--device", s["device"],
           "--tensor-parallel-size", "2", "--kv-cache-dtype", s["kv"], "--dtype", s["dtype"],
           "--skip-tokenizer-init", "--max-model-len", str(s["max_model_len"]),
           "--kv-cache-memory", str(s["kv_cache_memory"]), "--max-num-seqs", "64", "--no-progress",
           "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = tempfile.NamedTemporaryFile("w+", prefix="tp_serve_", suffix=".log", delete=False)
    print(f"[serve] {' '.join(cmd)} (log {log.name})", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    r: dict = {"cmd": cmd}
    workers: list[int] = []
    try:
        while True:
            try:
                if _http("GET", base + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
            if time.time() > deadline - 30:
                raise TimeoutError("server not healthy in time")
            time.sleep(0.5)
        r["startup_s"] = round(time.perf_counter() - t0, 1)
        children = f"/proc/{proc.pid}/task/{proc.pid}/children"
        if os.path.exists(children):
            workers = [int(x) for x in open(children).read().split()]
        name = _http("GET", base + "/v1/models")[1]["data"][0]["id"]
        from kvforge.spec.load import load_model_spec

        vocab_hi = min(1000, load_model_spec(s["llama"]).vocab_size - 10)

        def one(i):
            t = time.perf_counter()
            status, body = _http("POST", base + "/v1/completions",
                                 {"model": name, "prompt": [(37 * i + 11 * j) % vocab_hi + 5 for j in range(30 + i)],
                                  "max_tokens": s["e_tokens"], "temperature": 0, "ignore_eos": True})
            return status, body, time.perf_counter() - t

        with ThreadPoolExecutor(s["e_requests"]) as ex:
            results = list(ex.map(one, range(s["e_requests"])))
        r["statuses"] = [st for st, _, _ in results]
        r["first_error"] = next((b for st, b, _ in results if st != 200), None)
        r["latency_s"] = [round(t, 3) for _, _, t in results]
        r["completion_tokens"] = [b.get("usage", {}).get("completion_tokens") if isinstance(b, dict) else None
                                  for _, b, _ in results]
        r["text_prompt_status"] = _http("POST", base + "/v1/completions",
                                        {"model": name, "prompt": "no tokenizer here", "max_tokens": 2})[0]
        status, text = _http("GET", base + "/metrics")
        m = parse_prometheus(text) if status == 200 else {}
        r["metrics_status"] = status
        r["metrics_generation_tokens_total"] = metric_sum(m, "kvforge:generation_tokens_total") if m else None
        proc.send_signal(signal.SIGTERM)
        r["exit_code"] = proc.wait(timeout=60)
        time.sleep(1.0)
        r["workers_left"] = [p for p in workers if os.path.exists(f"/proc/{p}")
                             and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in workers:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        log.seek(0)
        tail = log.read().splitlines()[-15:]
        r["log_tail"] = tail
        print("[serve log tail]\n  " + "\n  ".join(tail), flush=True)
    ok200 = sum(st == 200 for st in r["statuses"])
    r["ok"] = bool(ok200 == s["e_requests"] and r["metrics_status"] == 200 and r["exit_code"] == 0
                   and not r["workers_left"] and r["text_prompt_status"] == 400)
    r["brief"] = (f"{ok200}/{s['e_requests']} x 200 ({s['e_tokens']} tokens each, max latency "
                  f"{max(r['latency_s']):.2f} s), text prompt -> {r['text_prompt_status']}, /metrics "
                  f"{r['metrics_status']} (generation tokens {r['metrics_generation_tokens_total']}), exit "
                  f"{r['exit_code']}, workers left {r['workers_left']}, startup {r['startup_s']} s")
    return r


# ---- orchestration -------------------------------------------------------------------------------------------
def child_main(o: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if o.device == "cpu":
        import torch

        from kvforge.distributed import launcher

        launcher.RUNNER_OPTIONS["static_decode_on_cpu"] = True  # exercise the graph decision path on every rank
        torch.set_num_threads(1)
    s = settings(o)
    part = o.child
    t0 = time.perf_counter()
    try:
        if part == "e":
            res = part_e(s, time.time() + o.child_timeout)
        else:
            res = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "f": part_f, "g": part_g}[part](s)
        res["status"] = "ok" if res.get("ok") else "check failed"
    except BaseException as e:  # noqa: BLE001 - reported, the next part still runs
        traceback.print_exc()
        res = {"status": "error", "error": f"{type(e).__name__}: {e}", "brief": f"{type(e).__name__}: {e}"[:200]}
    res["seconds"] = round(time.perf_counter() - t0, 1)
    with open(o.child_out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


def run_part(part: str, o: argparse.Namespace, timeout: float, tmpdir: str) -> dict:
    out_file = os.path.join(tmpdir, f"part_{part}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", part, "--child-out", out_file,
           "--child-timeout", str(timeout), "--device", o.device, "--llama", o.llama, "--deepseek", o.deepseek,
           "--linear", o.linear,
           "--dtype", o.dtype, "--kv-cache-dtype", o.kv_cache_dtype]
    if o.c_prompts:
        cmd += ["--c-prompts", str(o.c_prompts)]
    if o.tiny:
        cmd += ["--tiny"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "NCCL_NVLS_ENABLE": "0"}
    print(f"\n===== part {part}: {PARTS[part]} (timeout {timeout:.0f} s) =====", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # own process group: TP workers included
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return {"status": "timeout", "seconds": round(time.perf_counter() - t0, 1),
                "brief": f"killed after {timeout:.0f} s (with its TP workers)"}
    finally:
        _kill_group(proc)  # leftovers (e.g. a worker of a failed engine)
    try:
        with open(out_file) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"status": "error", "seconds": round(time.perf_counter() - t0, 1),
                "brief": f"part process exited with {proc.returncode} and no result"}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def write_tiny_models(tmpdir: str) -> tuple[str, str, str]:
    paths = []
    for name, cfg in (("tiny_llama", TINY_LLAMA), ("tiny_deepseek", TINY_DEEPSEEK),
                      ("tiny_qwen3_next", TINY_QWEN3_NEXT)):
        d = os.path.join(tmpdir, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        paths.append(d)
    return paths[0], paths[1], paths[2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the JSON result here (rewritten after every part)")
    p.add_argument("--parts", default="a,b,c,d,e,f", help="comma-separated subset of a,b,c,d,e,f,g")
    p.add_argument("--tiny", action="store_true",
                   help="tiny dummy configs on CUDA too, with the CPU run's sizes (512 positions, 32 MiB of KV), "
                        "also for an explicit --llama / --deepseek")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: tiny dummy configs over gloo (smoke test of the code paths)")
    p.add_argument("--llama", default=None, help="model for parts a, c, d, e (default llama-3.1-8b; cpu: tiny)")
    p.add_argument("--deepseek", default=None, help="model for part b (default deepseek-v2-lite; cpu: tiny)")
    p.add_argument("--linear", default=None, help="model for part g (default qwen3-next-80b-a3b; cpu: tiny)")
    p.add_argument("--dtype", default=os.environ.get("TP_CHECK_DTYPE", "auto"))
    p.add_argument("--kv-cache-dtype", default="fp8")
    p.add_argument("--c-prompts", type=int, default=0, help="requests in part c (default 256; cpu 16)")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every part's timeout")
    p.add_argument("--budget", type=float, default=560.0,
                   help="total seconds for all parts; a part's timeout is cut to what is left (default 560)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    o = p.parse_args()
    if o.child:
        return child_main(o)

    parts = [x.strip() for x in o.parts.split(",") if x.strip()]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"unknown part(s) {bad}; choose from {sorted(PARTS)}")
    t_start = time.perf_counter()
    tmpdir = tempfile.mkdtemp(prefix="tp_gpu_check_")
    if (o.device == "cpu" or o.tiny) and (o.llama is None or o.deepseek is None or o.linear is None):
        llama, deepseek, linear = write_tiny_models(tmpdir)
        o.llama, o.deepseek, o.linear = o.llama or llama, o.deepseek or deepseek, o.linear or linear
    o.llama = o.llama or "llama-3.1-8b"
    o.deepseek = o.deepseek or "deepseek-v2-lite"
    o.linear = o.linear or "qwen3-next-80b-a3b"
    env_info = {"device": o.device, "llama": o.llama, "deepseek": o.deepseek, "dtype": o.dtype,
                "kv_cache_dtype": o.kv_cache_dtype, "parts": parts}
    try:
        import torch

        env_info.update(torch=torch.__version__, gpus=torch.cuda.device_count(),
                        gpu_name=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except Exception as e:  # noqa: BLE001
        env_info["torch_error"] = repr(e)
    print("environment:", json.dumps(env_info), flush=True)
    results: dict = {}
    for part in [x for x in ORDER if x in parts]:
        left = o.budget - (time.perf_counter() - t_start)
        timeout = min(TIMEOUT_S[part] * o.timeout_scale, left - 5)
        if left - 5 < 20:
            results[part] = {"status": "skipped", "brief": f"budget spent ({left:.0f} s left)"}
        else:
            results[part] = run_part(part, o, timeout, tmpdir)
        print(f"[part {part}] {results[part]['status']} in {results[part].get('seconds', 0)} s: "
              f"{results[part].get('brief')}", flush=True)
        if o.out:
            with open(o.out, "w") as f:
                json.dump({"environment": env_info, "parts": results}, f, indent=1, default=str)
    rows = [(x, results[x]["status"], results[x].get("seconds", 0), results[x].get("brief", ""))
            for x in sorted(results)]
    print("\n===== SUMMARY (tp_gpu_check) =====")
    print(f"{'part':<5}{'status':<14}{'seconds':>8}  result")
    for part, status, secs, brief in rows:
        print(f"{part:<5}{status:<14}{secs:>8}  {PARTS[part]}\n{'':<27}  {brief}")
    print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)
    if o.out:
        with open(o.out, "w") as f:
            json.dump({"environment": env_info, "parts": results,
                       "summary": [dict(zip(("part", "status", "seconds", "result"), r)) for r in rows]},
                      f, indent=1, default=str)
    return 0 if all(r[1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Tensor parallelism on CPU (gloo, 2 processes): TP=2 against TP=1.

Tiny random Llama-family checkpoints (transformers ``save_pretrained``), float32,
one torch thread per process. TP=2 logits equal TP=1 logits within
``max |tp2 - tp1| <= 1e-5 * max(1, max |tp1|)`` (the all-reduces only change
the summation order; measured ~2e-7 absolute on logits of magnitude ~1), and
greedy tokens follow TP=1's until a near-tie of its logits (tests/greedy_agreement.py). Each rank's KV pool is the plan's
bytes; KV heads are split (4 heads / 2 KV heads) or replicated (1 KV head).
A killed or hung worker makes the engine raise DistributedError in bounded time.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from greedy_agreement import assert_outputs_agree

transformers = pytest.importorskip("transformers")

from kvforge import SamplingParams  # noqa: E402
from kvforge.distributed.group import DistributedError  # noqa: E402
from kvforge.distributed.launcher import expected_pool_bytes  # noqa: E402

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=256, rms_norm_eps=1e-5)
CASES = {
    # KV heads split 2 -> 1 per rank; vocab 255 is padded to 2 x 128 rows; llama3 rope
    "llama_split": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, vocab_size=255, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    # 1 KV head replicated on both ranks; q/k/v/o and MLP biases (row-parallel bias added once)
    "llama_replicated_bias": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1, vocab_size=256,
                                                                    attention_bias=True, mlp_bias=True)),
    # per-head q/k norm, tied embeddings (vocab-parallel LM head = embedding slice)
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, vocab_size=256, head_dim=32,
                                                          tie_word_embeddings=True)),
}
ENGINE = dict(dtype="float32", kv_cache_dtype="auto", block_size=4, skip_tokenizer_init=True,
              kv_cache_memory=1 << 21, progress=False, device="cpu", max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def _save(tmp_path, case):
    cfg_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**BASE, **extra)
    model = getattr(transformers, model_cls)(cfg).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return cfg


def _close(a, b):
    assert a.shape == b.shape
    return (a - b).abs().max().item() <= 1e-5 * max(1.0, a.abs().max().item())


def _prompts(vocab):
    g = torch.Generator().manual_seed(1)
    long = torch.randint(0, vocab, (45,), generator=g).tolist()  # > max_num_batched_tokens: chunked prefill
    return [long, long[:7], long[:20] + [1, 2, 3], torch.randint(0, vocab, (13,), generator=g).tolist()]


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_matches_tp1(tmp_path, engines, case):
    cfg = _save(tmp_path, case)
    tp1 = engines(tmp_path)
    assert tp1.engine.tp is None and not torch.distributed.is_initialized()  # TP=1: no workers, no process group
    tp2 = engines(tmp_path, tensor_parallel_size=2)
    prompts = _prompts(cfg.vocab_size)

    # Teacher-forced logits through the paged cache (45 tokens in chunks of 32).
    a = tp1.engine.compute_prompt_logits(prompts[0])
    b = tp2.engine.compute_prompt_logits(prompts[0])
    assert b.shape == (45, cfg.vocab_size)
    assert _close(a, b), (a - b).abs().max().item()

    # Greedy through the scheduler: batched, chunked prefill, shared prefixes (prefix cache).
    reqs = [{"prompt_token_ids": p} for p in prompts]
    assert_outputs_agree(tp2.generate(reqs, GREEDY, use_tqdm=False), tp1.generate(reqs, GREEDY, use_tqdm=False))

    # Every rank allocated exactly the plan's per-rank KV bytes and KV heads.
    plan1, plan2 = tp1.plan, tp2.plan
    kv = cfg.num_key_value_heads
    assert all(lp.kv_heads_per_rank == max(kv // 2, 1) for lp in plan2.layers)
    reports = tp2.engine.tp.reports
    assert [r["rank"] for r in reports] == [0, 1]
    want = expected_pool_bytes(plan2)
    assert want == plan2.num_blocks * plan2.group_size * plan2.groups[0].page_bytes
    assert tp2.engine.pool.nbytes == want
    for r in reports:
        assert r["nbytes"] == want and r["kv_heads"] == [lp.kv_heads_per_rank for lp in plan2.layers]
        assert r["heads"] == 2
    # Rank r holds KV head r * kv // tp when replicating, the slice [r * kv/tp, ...) when splitting.
    assert [r["kv_start"] for r in reports] == [r * kv // 2 for r in range(2)]
    per_token_1 = plan1.bytes_per_token
    assert plan2.bytes_per_token == (per_token_1 // 2 if kv % 2 == 0 else per_token_1)


def _write_gguf(path, cfg, model):
    """F32 GGUF the way llama.cpp writes a llama model (Q/K rows permuted)."""
    gguf = pytest.importorskip("gguf")
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(256)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.hidden_size // heads)
    w.add_vocab_size(cfg.vocab_size)
    for name, p in model.state_dict().items():
        arr = p.numpy().astype("float32")
        if name in top:
            w.add_tensor(top[name], arr)
            continue
        layer, rest = name[len("model.layers."):].split(".", 1)
        mod, kind = rest.rsplit(".", 1)
        if mod in ("self_attn.q_proj", "self_attn.k_proj"):
            n = heads if mod == "self_attn.q_proj" else kv
            arr = arr.reshape(n, 2, arr.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(arr.shape).copy()
        w.add_tensor(f"blk.{layer}.{names[mod]}.{kind}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tp2_gguf_matches_tp1_workers_ignore_stop_signals_then_killed_worker_gives_clear_error(tmp_path, engines):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**BASE, num_key_value_heads=2, vocab_size=256, rope_theta=10000.0)
    _write_gguf(tmp_path / "m.gguf", cfg, transformers.LlamaForCausalLM(cfg).float().eval())
    tp1 = engines(tmp_path / "m.gguf")
    tp2 = engines(tmp_path / "m.gguf", tensor_parallel_size=2)
    prompt = _prompts(cfg.vocab_size)[3]
    a = tp1.engine.compute_prompt_logits(prompt)
    b = tp2.engine.compute_prompt_logits(prompt)
    assert _close(a, b), (a - b).abs().max().item()

    pid = tp2.engine.tp.reports[1]["pid"]
    # a Ctrl-C or a stop signal to the process group reaches the workers too: they leave it to rank 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        os.kill(pid, sig)
    time.sleep(0.5)
    assert torch.equal(tp2.engine.compute_prompt_logits(prompt), b)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        tp2.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    with pytest.raises(DistributedError, match="rank 1"):  # stays failed
        tp2.engine.compute_prompt_logits(prompt)
    assert time.monotonic() - t0 < 15


def test_tp2_dummy_weights_match_tp1_then_hung_worker_times_out(tmp_path, engines):
    # Dummy weights: each rank draws the TP=1 tensors and keeps its part, so TP=1 and TP=2 agree.
    cfg = _save(tmp_path, "llama_replicated_bias")
    tp1 = engines(tmp_path, load_format="dummy", seed=3)
    tp2 = engines(tmp_path, load_format="dummy", seed=3, tensor_parallel_size=2, distributed_timeout_s=4)
    prompt = _prompts(cfg.vocab_size)[3]
    a = tp1.engine.compute_prompt_logits(prompt)
    b = tp2.engine.compute_prompt_logits(prompt)
    assert _close(a, b), (a - b).abs().max().item()

    pid = tp2.engine.tp.reports[1]["pid"]
    os.kill(pid, signal.SIGSTOP)  # alive but unresponsive: only the collective timeout can catch it
    try:
        t0 = time.monotonic()
        with pytest.raises(DistributedError, match="timed out"):
            tp2.engine.compute_prompt_logits(prompt)
        assert time.monotonic() - t0 < 20
    finally:
        os.kill(pid, signal.SIGKILL)


def test_tp_architecture_check():
    # DeepSeek MLA runs at TP > 1 (tests/test_tp_deepseek.py); other architectures are refused before any
    # worker starts.
    from kvforge.distributed.tp_models import check_tp_architecture
    from kvforge.errors import ConfigError

    assert check_tp_architecture({"architectures": ["DeepseekV3ForCausalLM"]}) == "DeepseekV3ForCausalLM"
    with pytest.raises(ConfigError, match="Llama family"):
        check_tp_architecture({"architectures": ["CsaRingTestForCausalLM"]})


def test_tp2_static_decode_path_follows_rank0(tmp_path, engines, monkeypatch):
    """The CUDA-graph decode path at TP=2, exercised on CPU: with ``static_decode_on_cpu`` every rank's runner
    runs decode steps through DecodeGraphs' static, padded inputs (no capture on CPU). Rank 0 decides graph
    or eager per step and the workers follow (their counters match rank 0's); tokens equal TP=1 eager. Every
    rank captures the sizes ``--cuda-graph-sizes`` names."""
    from kvforge.distributed import launcher

    cfg = _save(tmp_path, "llama_split")
    prompts = [{"prompt_token_ids": p} for p in _prompts(cfg.vocab_size)[1:]]  # 3 sequences: padded to 4
    want = engines(tmp_path).generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.setattr(launcher, "RUNNER_OPTIONS", {"static_decode_on_cpu": True})  # sent to every rank
    tp2 = engines(tmp_path, tensor_parallel_size=2, cuda_graph_sizes=[4, 1])
    assert [r["graph_sizes"] for r in tp2.engine.tp.reports] == [[1, 4]] * 2 == [tp2.engine.runner.graphs.sizes] * 2
    assert_outputs_agree(tp2.generate(prompts, GREEDY, use_tqdm=False), want)
    c0, c1 = tp2.engine.rank_counters()
    assert c0["num_graph_steps"] >= 5 and c0["num_eager_steps"] >= 1
    assert (c1["rank"], c1["num_graph_steps"], c1["num_eager_steps"]) == (1, c0["num_graph_steps"],
                                                                          c0["num_eager_steps"])
    # Rank 0 turns graphs off (as `kvforge bench offline --profile-decode` does): the worker follows.
    tp2.engine.runner.graphs = None
    assert_outputs_agree(tp2.generate(prompts, GREEDY, use_tqdm=False), want)
    d0, d1 = tp2.engine.rank_counters()
    assert d0["num_graph_steps"] == d1["num_graph_steps"] == c0["num_graph_steps"]
    assert d1["num_eager_steps"] == d0["num_eager_steps"] > c0["num_eager_steps"]


@pytest.mark.parametrize("static_decode", [False, True], ids=["eager", "static-decode"])
def test_tp2_async_scheduling_matches_tp1(tmp_path, engines, monkeypatch, static_decode):
    """--async-scheduling at TP=2: rank 0 broadcasts each step's sampled tokens after sampling and the worker
    gathers its next in-flight input ids from them (also into the graph path's static buffers). Greedy
    tokens (batched, chunked prefill, shared prefixes) and a stop token follow the synchronous TP=1
    engine's (near-tie rule)."""
    from kvforge.distributed import launcher

    cfg = _save(tmp_path, "llama_split")
    reqs = [{"prompt_token_ids": p} for p in _prompts(cfg.vocab_size)]
    tp1 = engines(tmp_path)
    want = tp1.generate(reqs, GREEDY, use_tqdm=False)
    stop_at = want[1].outputs[0].token_ids[3]
    stop = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at], logprobs=2)
    want_stop = tp1.generate(reqs, stop, use_tqdm=False)
    assert want_stop[1].outputs[0].finish_reason == "stop"
    if static_decode:
        monkeypatch.setattr(launcher, "RUNNER_OPTIONS", {"static_decode_on_cpu": True})  # sent to every rank
    tp2 = engines(tmp_path, tensor_parallel_size=2, async_scheduling=True)
    assert tp2.engine.async_scheduling
    assert_outputs_agree(tp2.generate(reqs, GREEDY, use_tqdm=False), want)
    assert_outputs_agree(tp2.generate(reqs, stop, use_tqdm=False), want_stop)
    c0, c1 = tp2.engine.rank_counters()
    assert (c1["num_graph_steps"], c1["num_eager_steps"]) == (c0["num_graph_steps"], c0["num_eager_steps"])
    if static_decode:
        assert c0["num_graph_steps"] >= 5
    assert tp2.engine.stats()["kv_blocks_used"] == 0


def test_tp2_warm_up_leaves_no_trace_on_any_rank(tmp_path, engines, monkeypatch):
    """``--warm-up`` at TP=2: its steps run on both ranks like any others (graph and eager), then every
    rank's step counters read zero and the engine's stats equal those of a TP=2 engine that never warmed
    up. The same requests then take the same steps on both engines with the same all-reduce order, so the
    greedy tokens are equal, not merely in agreement, and so are every rank's counters afterwards."""
    from kvforge.distributed import launcher
    from kvforge.engine import warm_up as warm_up_module

    cfg = _save(tmp_path, "llama_split")
    reqs = [{"prompt_token_ids": p} for p in _prompts(cfg.vocab_size)]
    monkeypatch.setattr(launcher, "RUNNER_OPTIONS", {"static_decode_on_cpu": True})  # sent to every rank
    steps = []
    run = warm_up_module.run_warm_up
    monkeypatch.setattr(warm_up_module, "run_warm_up", lambda engine: steps.append(run(engine)) or steps[-1])
    results = {}
    for warm in (False, True):  # one tensor-parallel engine at a time in a process
        llm = engines(tmp_path, tensor_parallel_size=2, warm_up=warm)
        try:
            fresh = (llm.engine.stats(), llm.engine.rank_counters())
            outs = llm.generate(reqs, GREEDY, use_tqdm=False)
            results[warm] = (fresh, [o.outputs[0].token_ids for o in outs], llm.engine.rank_counters())
        finally:
            llm.engine.shutdown()
    assert len(steps) == 1 and steps[0] >= 8  # the warm-up ran once, on the warmed engine only
    (cold_fresh, cold_tokens, cold_after), (warm_fresh, warm_tokens, warm_after) = results[False], results[True]
    assert [(c["num_graph_steps"], c["num_eager_steps"]) for c in warm_fresh[1]] == [(0, 0), (0, 0)]
    assert warm_fresh[0] == cold_fresh[0]
    assert warm_tokens == cold_tokens

    def steps(counters):
        return [(c["num_graph_steps"], c["num_eager_steps"]) for c in counters]

    assert steps(warm_after) == steps(cold_after) and warm_after[0]["num_graph_steps"] >= 5


def test_a_second_engine_is_refused_before_it_starts_and_the_first_keeps_serving(tmp_path, engines):
    """One tensor-parallel engine per process: a second is refused before any worker starts, and the
    refusal leaves the first engine's process group (and so the first engine) as it was."""
    cfg = _save(tmp_path, "llama_split")
    first = engines(tmp_path, load_format="dummy", seed=3, tensor_parallel_size=2)
    prompt = _prompts(cfg.vocab_size)[1]
    want = first.engine.compute_prompt_logits(prompt)
    with pytest.raises(DistributedError, match="one tensor-parallel engine per process"):
        engines(tmp_path, load_format="dummy", seed=3, tensor_parallel_size=2)
    assert torch.equal(first.engine.compute_prompt_logits(prompt), want)  # same ranks, same reductions


def test_ranks_on_cpu_share_the_processs_threads(tmp_path, engines):
    """On CPU every rank runs at once on the same cores: each takes its share of the process's intra-op
    threads (at least one), and rank 0 gives its own back when the engine shuts down."""
    from kvforge.distributed.launcher import rank_threads

    assert [rank_threads(8, n, "gloo") for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    assert rank_threads(8, 2, "nccl") == 8
    _save(tmp_path, "llama_split")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tp2 = engines(tmp_path, load_format="dummy", tensor_parallel_size=2)
        assert torch.get_num_threads() == 1
        tp2.engine.shutdown()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_an_engine_dropped_without_shutdown_takes_its_workers_and_group_with_it(tmp_path):
    """Without ``shutdown()``, dropping the last reference to a tensor-parallel engine ends its worker
    processes and leaves the process group once its objects are collected: at the latest when the next
    engine starts (an engine freezes the garbage collector's view of what lives at its startup,
    kvforge/engine/gc_freeze.py), so another tensor-parallel engine can start in the same process."""
    import torch.distributed as dist

    from kvforge import LLM

    cfg = _save(tmp_path, "llama_split")
    prompt = _prompts(cfg.vocab_size)[1]
    llm = LLM(str(tmp_path), **{**ENGINE, "load_format": "dummy", "seed": 3, "tensor_parallel_size": 2})
    want = llm.engine.compute_prompt_logits(prompt)
    workers = list(llm.engine.tp.procs)
    assert workers and all(p.poll() is None for p in workers) and dist.is_initialized()
    del llm
    again = LLM(str(tmp_path), **{**ENGINE, "load_format": "dummy", "seed": 3, "tensor_parallel_size": 2})
    try:
        assert all(p.poll() is not None for p in workers)
        assert _close(again.engine.compute_prompt_logits(prompt), want)
    finally:
        again.shutdown()

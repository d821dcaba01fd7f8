"""Qwen3-Next and Kimi-Linear through the whole engine (plan -> KV pool with state slots -> scheduler ->
runner -> sampler) against transformers, float32 on CPU.

Tiny random checkpoints written by transformers (tests/tiny_checkpoints.py), blocks of 4 tokens, prefill chunks of 16 tokens (every prompt but the shortest
crosses several steps, so states are carried through slots between steps). Teacher-forced logits:
max |ours - hf| <= 1e-4 * max(1, max |hf|). Greedy tokens of a batch of prompts of different lengths
follow transformers' greedy stream until a near-tie within that tolerance (tests/greedy_agreement.py):
batch composition and chunking change the summation order. Also: the decode steps on the CUDA-graph
path's static slot buffers (run eagerly on CPU), preemption and recompute under memory pressure (a
recomputed sequence's first chunk must not read its slot), a repeated batch (prefix-cache hits resume
from state snapshots: still transformers' tokens), the admitted concurrency equal to the plan's, the
fp8 latent cache of Kimi-Linear's MLA layers with the state in the model dtype, and asynchronous
scheduling (stops, slot reuse and preemption with a step in flight).
"""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import assert_greedy_agrees, top2_margins
from linear_attention_setup import CASES, ENGINE, one_torch_thread  # noqa: F401 (autouse fixture)

transformers = pytest.importorskip("transformers")

from tiny_checkpoints import LINEAR_VOCAB as VOCAB  # noqa: E402
from tiny_checkpoints import make_checkpoint  # noqa: E402

from kvforge import SamplingParams  # noqa: E402
from kvforge.engine.scheduler import Scheduler  # noqa: E402
from kvforge.engine.sequence import Sequence  # noqa: E402

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (37, 21, 1, 9)]


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        run = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    return run.sequences[0, len(prompt):].tolist(), top2_margins(torch.cat(run.logits))


def _tolerance(hf, prompts) -> float:
    with torch.no_grad():
        return 1e-4 * max(1.0, max(hf(torch.tensor([p])).logits.abs().max().item() for p in prompts))


def _static_decode_runner(engine):
    """A runner whose decode steps take the CUDA-graph path's static, padded inputs and slot buffers."""
    from kvforge.engine.model_runner import ModelRunner

    return ModelRunner(engine.model, engine.pool, engine.plan, engine.device, enforce_eager=False,
                       max_num_seqs=engine.scheduler.max_num_seqs, static_decode_on_cpu=True)


def _generate(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("decode_path", ["eager", "static"])
@pytest.mark.parametrize("case", CASES)
def test_engine_matches_transformers(case, decode_path, tmp_path, engines):
    hf, _ = make_checkpoint(case, tmp_path)
    llm = engines(tmp_path)
    engine = llm.engine
    assert engine.block_manager.enable_prefix_caching and "snapshot" in engine.plan.prefix_caching_reason
    if decode_path == "static":
        engine.runner = _static_decode_runner(engine)
        assert engine.runner.graphs is not None and engine.runner.graphs.has_slots
    prompts = _prompts()
    tol = _tolerance(hf, prompts)

    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0]])).logits[0]
    ours = engine.compute_prompt_logits(prompts[0])  # three runs of 16, 16 and 5 tokens, one state slot
    assert ours.shape == ref.shape and (ours - ref).abs().max().item() <= tol

    expected = [_hf_greedy(hf, p) for p in prompts]
    first = _generate(llm, prompts)
    for k, (got, (want, margins)) in enumerate(zip(first, expected)):
        assert_greedy_agrees(got, want, margins, tol, what=f"{case} {decode_path} prompt {k}")
    if decode_path == "static":
        assert engine.runner.num_graph_steps > 0  # decode steps took the static path

    # The same batch again: every prompt of more than one block resumes at its last block boundary before
    # its last token (36, 20 and 8 tokens; blocks of 4) from the state snapshot its first run left there.
    hits = engine.stats()["prefix_cache_hits"]
    again = _generate(llm, prompts)
    for k, (got, (want, margins)) in enumerate(zip(again, expected)):
        assert_greedy_agrees(got, want, margins, tol, what=f"{case} {decode_path} prompt {k} from the cache")
    assert engine.stats()["prefix_cache_hits"] - hits == 36 + 20 + 8
    assert engine.state_slots.num_free == engine.state_slots.num_slots  # every slot back after finishing


@pytest.mark.parametrize("route", ["as_routed", "split"])
@pytest.mark.parametrize("case", CASES)
def test_state_kernels_over_the_pool_slots_in_the_engine(case, route, tmp_path, engines, monkeypatch):
    """The state operations on the Triton kernels (Triton's CPU interpreter here; the gpu-marked test below
    compiles them) over the pool's slot views: prefill kernels for the chunks, decode kernels for the CUDA-graph
    path's static slot buffers, where three sequences fill a batch of four with a padding row at slot -1; the
    batch again resumes from snapshots, one of them stored by the prefill kernels inside a chunk. ``split``: the
    delta-rule route lowered so a step's long prompt chunk runs chunked and its short ones token by token beside
    it (at these lengths the engine's route runs every call token by token)."""
    device = pytest.importorskip("triton_kernel_device")
    if not device.INTERPRETED:
        pytest.skip("the engine runs on CPU here: kernels run on CPU tensors only in Triton's interpreter")
    device.skip_unless_loaded_loop_bounds_work()
    from kvforge.attention import linear_state
    from kvforge.attention.routing import delta_rule

    splits = []
    if route == "split":
        monkeypatch.setattr(delta_rule, "CHUNKED_MIN_TOKENS", 4)  # a step of [4, 6, 1] tokens splits
        monkeypatch.setattr(delta_rule, "CHUNKED_TOKENS_PER_SHORT", 1)
        real_chunked_from = delta_rule.chunked_from
        monkeypatch.setattr(delta_rule, "chunked_from", lambda lengths: splits.append(real_chunked_from(lengths))
                            or splits[-1])
    monkeypatch.setattr(linear_state, "KERNEL_DEVICES", ("cuda", "cpu"))
    assert linear_state._use_kernels(torch.zeros(1))
    hf, _ = make_checkpoint(case, tmp_path)
    llm = engines(tmp_path, max_num_seqs=4)
    engine = llm.engine
    engine.runner = _static_decode_runner(engine)
    assert engine.runner.graphs.sizes == [1, 2, 4]
    prompts = [p[:n] for p, n in zip(_prompts(), (20, 6, 1))]
    tol = _tolerance(hf, prompts)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    got = _generate(llm, prompts, params)
    assert engine.runner.num_graph_steps > 0
    # Again: the 20-token prompt resumes at 16 (its first chunk's end, a copy after the step), the 6-token one
    # at 4, a snapshot its chunk's kernels stored inside the step.
    hits = engine.stats()["prefix_cache_hits"]
    again = _generate(llm, prompts, params)
    assert engine.stats()["prefix_cache_hits"] - hits == 16 + 4
    for k, (tokens, p) in enumerate(zip(got + again, prompts * 2)):
        want, margins = _hf_greedy(hf, p)
        assert_greedy_agrees(tokens, want[:3], margins, tol, what=f"{case} kernels prompt {k}")
    if route == "split":
        assert 4 in splits  # some step ran its long chunks chunked beside a short sequence token by token


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("case", CASES)
def test_preempted_sequences_recompute_their_state(case, policy, tmp_path, engines, monkeypatch):
    """Memory pressure (most blocks held by a request outside the scheduler) preempts running sequences;
    each gives its state slot back and recomputes from its prompt, its first chunk from a zero state. Under
    the priority policy (the later prompts more urgent) the victims differ; the outputs do not."""
    monkeypatch.setattr(Scheduler, "admit_whole_prompts", False)  # admitted by first chunk (vLLM's rule), prompts outgrow the pool
    hf, _ = make_checkpoint(case, tmp_path)
    llm = engines(tmp_path, scheduling_policy=policy)
    engine = llm.engine
    bm = engine.block_manager
    hog = Sequence("hog", [1] * (4 * (bm.num_free_blocks - 18)), SamplingParams(max_tokens=1))
    assert bm.allocate(hog, cached_blocks=[]) and bm.num_free_blocks == 18  # 72 tokens left for 100
    prompts = _prompts()
    tol = _tolerance(hf, prompts)
    released = []
    slots = engine.state_slots
    release = slots.release

    def record(request_id):
        released.append(request_id)
        return release(request_id)

    slots.release = record
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    priority = [-k for k in range(len(prompts))] if policy == "priority" else None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, priority=priority)
    got = [o.outputs[0].token_ids for o in outs]
    assert engine.stats()["num_preemptions"] > 0
    for k, (tokens, p) in enumerate(zip(got, prompts)):
        want, margins = _hf_greedy(hf, p)
        assert_greedy_agrees(tokens, want, margins, tol, what=f"{case} preempted prompt {k}")
    assert len(released) >= len(prompts) + engine.stats()["num_preemptions"]  # finishes and preemptions
    assert slots.num_free == slots.num_slots


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
@pytest.mark.parametrize("case", CASES)
def test_a_lone_sequence_preempted_in_an_empty_step_gives_its_slot_back(case, prefix_caching, tmp_path, engines):
    """The only running sequence cannot get a block: the scheduler preempts it and the step schedules
    nothing. Its state slot goes back to the pool in that step, as it does where the step runs others, so
    the sequence resumes (from a prefix-cache snapshot where there is one) with a slot of its own and still
    follows transformers."""
    hf, _ = make_checkpoint(case, tmp_path)
    engine = engines(tmp_path, enable_prefix_caching=prefix_caching).engine
    bm = engine.block_manager
    prompt = list(range(3, 13))
    engine.add_request("a", prompt, GREEDY)
    for _ in range(3):  # the prompt's 10 tokens in one chunk, then two decode steps: 12 tokens in 3 blocks
        engine.step()
    hog = Sequence("hog", [1] * (4 * bm.num_free_blocks), SamplingParams(max_tokens=1))
    assert bm.allocate(hog, cached_blocks=[]) and bm.num_free_blocks == 0
    assert engine.step() == [] and engine.stats()["num_preemptions"] == 1
    assert engine.scheduler.num_running == 0 and engine.state_slots.held == {}
    bm.free(hog)
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    want, margins = _hf_greedy(hf, prompt)
    assert_greedy_agrees(tokens, want, margins, _tolerance(hf, [prompt]), what=f"{case} preempted alone")
    assert engine.state_slots.num_free == engine.state_slots.num_slots and bm.num_used_blocks == 0


def test_the_engine_admits_exactly_the_planned_concurrency(tmp_path, engines):
    """Every running sequence holds a state slot and its blocks: the pool has ``int(max_concurrency)`` slots
    beside the blocks of that many sequences of max-model-len, and the scheduler runs that many at once."""
    make_checkpoint("qwen3-next", tmp_path)
    llm = engines(tmp_path, kv_cache_memory=120_000, max_model_len=64)
    engine, plan = llm.engine, llm.engine.plan
    slots = plan.capacity.state_slots
    assert slots == int(plan.max_concurrency) >= 2 and plan.max_concurrency - slots > 0.05  # not a whole number
    per_slot = sum(plan.layers[i].state_bytes for i in engine.pool.linear_states.conv)
    states = [*engine.pool.linear_states.conv.values(), *engine.pool.linear_states.recurrent.values()]
    assert all(t.shape[0] == slots and t.dtype == torch.float32 for t in states)
    assert sum(t.numel() * t.element_size() for t in states) == slots * per_slot == slots * plan.state_bytes_per_sequence
    # The blocks of `slots` sequences of max-model-len fit: the plan's block count covers them.
    blocks_per_seq = -(-plan.max_model_len // plan.block_size)
    assert plan.num_blocks >= slots * blocks_per_seq
    assert engine.pool.nbytes <= plan.capacity.kv_cache_memory
    assert engine.scheduler.max_num_seqs == slots

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (20,), generator=g).tolist() for _ in range(slots + 3)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, engine.scheduler.num_running)
        assert engine.state_slots.num_slots - engine.state_slots.num_free == engine.scheduler.num_running
        if engine.num_steps == 6:  # an aborted running request gives its slot back
            held = engine.state_slots.num_free
            engine.abort_request("0")
            assert engine.state_slots.num_free == held + 1
    assert most == slots
    assert engine.stats()["num_preemptions"] == 0  # the planned concurrency fits at full length


def test_kimi_linear_fp8_latent_cache_gain_equals_the_plan(tmp_path, engines):
    """fp8 latent cache on the MLA layers, the state in the model dtype (bfloat16): the pool's bytes per
    sequence (block pages of max-model-len tokens plus one state slot) give exactly the plan's gain, below 2x."""
    make_checkpoint("kimi-linear", tmp_path)
    kw = dict(dtype="bfloat16", state_dtype="model", kv_cache_memory=1 << 20, max_model_len=64)
    bf16, fp8 = engines(tmp_path, **kw), engines(tmp_path, kv_cache_dtype="fp8", **kw)

    def pool_bytes_per_sequence(llm):
        pool, plan = llm.engine.pool, llm.engine.plan
        block = sum(c.numel() * c.element_size() for c in pool.kv_caches if c is not None) // pool.num_blocks
        states = [*pool.linear_states.conv.values(), *pool.linear_states.recurrent.values()]
        assert {t.dtype for t in states} == {torch.bfloat16}  # the state is never quantized
        slot = sum(t.numel() * t.element_size() for t in states) // pool.state_slots
        return -(-plan.max_model_len // plan.block_size) * block + slot

    p8 = fp8.engine.plan
    assert {x.kv_dtype for x in p8.layers if x.kind == "mla"} == {"fp8_e4m3"}
    assert p8.state_dtype == "bfloat16" and "--state-dtype model" in p8.state_dtype_reason
    assert all(x.query_dtype_reason for x in p8.layers)
    measured = pool_bytes_per_sequence(bf16) / pool_bytes_per_sequence(fp8)
    assert measured == p8.concurrency_gain() and 1 < measured < 2
    assert fp8.engine.state_slots.num_slots == p8.capacity.state_slots > bf16.engine.state_slots.num_slots
    got = _generate(fp8, _prompts()[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(t) for t in got] == [4, 4]


@pytest.mark.parametrize("decode_path", ["eager", "static"])
@pytest.mark.parametrize("case", CASES)
def test_async_scheduling_follows_transformers(case, decode_path, tmp_path, engines):
    """``--async-scheduling`` (the CUDA default, forced here on CPU): the host schedules step N+1 while step N runs, so a
    sequence that stops in step N has already been scheduled into N+1 (a wasted row that writes its state
    slot) and gives its slot back only when N resolves; two sequences at a time make later prompts take
    freed slots, whose first chunks must ignore what the wasted rows wrote. Sequences stop at different
    lengths and one on a stop token; every stream follows transformers' greedy one."""
    hf, _ = make_checkpoint(case, tmp_path)
    llm = engines(tmp_path, async_scheduling=True, max_num_seqs=2)
    engine = llm.engine
    assert engine.async_scheduling
    if decode_path == "static":  # decode steps on the CUDA-graph path's static slot buffers
        engine.runner = _static_decode_runner(engine)
    prompts = _prompts() + [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(6)).tolist()
                            for n in (13, 30)]
    tol = _tolerance(hf, prompts)
    expected = [_hf_greedy(hf, p) for p in prompts]
    stop_at = expected[1][0][2]  # prompt 1 stops on its third greedy token (and any earlier occurrence)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 8, 3, 6, 1, 5)]
    params[1] = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_at])
    got = _generate(llm, prompts, params)
    for k, (tokens, (want, margins), p) in enumerate(zip(got, expected, params)):
        want = want[:p.max_tokens]
        if p.stop_token_ids:
            want = want[:want.index(stop_at) + 1]
        assert_greedy_agrees(tokens, want, margins, tol, what=f"{case} async prompt {k}")
        assert len(tokens) == len(want)
    assert engine.state_slots.num_free == engine.state_slots.num_slots
    if decode_path == "static":
        assert engine.runner.num_graph_steps > 0


@pytest.mark.parametrize("case", CASES)
def test_async_scheduling_under_preemption(case, tmp_path, engines, monkeypatch):
    """The preemption test's memory pressure with the host a step ahead: a preempted sequence may have a
    token in flight, gives its slot back at once and recomputes from a zero state."""
    monkeypatch.setattr(Scheduler, "admit_whole_prompts", False)  # admitted by first chunk (vLLM's rule), prompts outgrow the pool
    hf, _ = make_checkpoint(case, tmp_path)
    llm = engines(tmp_path, async_scheduling=True)
    engine = llm.engine
    bm = engine.block_manager
    hog = Sequence("hog", [1] * (4 * (bm.num_free_blocks - 18)), SamplingParams(max_tokens=1))
    assert bm.allocate(hog, cached_blocks=[]) and bm.num_free_blocks == 18
    prompts = _prompts()
    tol = _tolerance(hf, prompts)
    got = _generate(llm, prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert engine.stats()["num_preemptions"] > 0
    for k, (tokens, p) in enumerate(zip(got, prompts)):
        want, margins = _hf_greedy(hf, p)
        assert_greedy_agrees(tokens, want, margins, tol, what=f"{case} async preempted prompt {k}")
    assert engine.state_slots.num_free == engine.state_slots.num_slots


def test_linear_attention_engines_on_cpu_schedule_synchronously_by_default(tmp_path, engines):
    """Overlap pays only where the device runs apart from the host: off on CPU, as for every model."""
    make_checkpoint("qwen3-next", tmp_path)
    assert not engines(tmp_path).engine.async_scheduling


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cudagraph"])
@pytest.mark.parametrize("case", CASES)
def test_engine_matches_transformers_on_cuda(case, eager, tmp_path, engines):
    """float32 on CUDA: the state slots on the Triton kernels (prefill and decode), full layers on the Triton
    paged backend, MLA layers on their planned backend. Dense-MLP variants (MoE decode needs grouped GEMMs to be
    captured), so decode steps replay CUDA graphs whose slot ids and has_initial_state are static buffers; one
    sequence stops early, so later decode batches of 3 replay the graph of 4 with a padding row at slot -1.
    Scheduling is asynchronous (the CUDA default): the early stop is found with the next step in flight.
    Greedy tokens follow transformers' float32 greedy on CUDA until a near-tie within 1e-4 * max |logit|, and
    again when the batch comes a second time and resumes from state snapshots."""
    # Head size 32 and blocks of 16: shapes the Triton paged backend declares.
    dense = {"qwen3-next": dict(num_experts=0, head_dim=32), "kimi-linear": dict(mlp_layer_types=["dense"] * 4)}[case]
    hf, _ = make_checkpoint(case, tmp_path, **dense)
    hf = hf.cuda()
    llm = engines(tmp_path, device="cuda", enforce_eager=eager, max_num_seqs=8, block_size=16)
    runner = llm.engine.runner
    assert llm.engine.async_scheduling
    attention = {x.backend for x in llm.plan.layers if x.kind != "state"}
    assert attention == {"triton_paged" if case == "qwen3-next" else "triton_mla"}
    if not eager:
        assert runner.graphs is not None and runner.graphs.has_slots, runner.graphs_off_reason
    prompts = _prompts()
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0]], device="cuda")).logits[0].float().cpu()
        tol = 1e-4 * max(1.0, max(hf(torch.tensor([p], device="cuda")).logits.abs().max().item() for p in prompts))
    ours = llm.engine.compute_prompt_logits(prompts[0]).cpu()
    assert (ours - ref).abs().max().item() <= tol
    lengths = [NEW_TOKENS, 5, NEW_TOKENS, NEW_TOKENS]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    expected = []
    for p, n in zip(prompts, lengths):
        with torch.no_grad():
            run = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        expected.append((run.sequences[0, len(p):].tolist(), top2_margins(torch.cat(run.logits).cpu())))
    # The batch twice: the second time the prompts of 37 and 21 tokens resume at 32 and 16 from the state
    # snapshots their first run left (copied on the device, in stream order with the steps in flight).
    for run_index in range(2):
        hits = llm.engine.stats()["prefix_cache_hits"]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for k, (out, (want, margins)) in enumerate(zip(outs, expected)):
            assert_greedy_agrees(out.outputs[0].token_ids, want, margins, tol,
                                 what=f"{case} cuda {'eager' if eager else 'graphs'} run {run_index} prompt {k}")
    assert llm.engine.stats()["prefix_cache_hits"] - hits == 32 + 16
    if not eager:
        assert runner.num_graph_steps > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_qwen3_next_moe_decode_graphs_follow_eager_in_bfloat16(tmp_path, engines):
    """Qwen3-Next with its MoE in bfloat16: the experts run as grouped GEMMs, so the model allows capture and
    decode steps replay CUDA graphs over the state slots. Greedy tokens follow the eager engine's until a
    near-tie of its logprobs within 0.05 (bf16 rounding of logits of magnitude ~3 differs by ~0.01 between a
    decode batch and its padded graph size; a wrong slot or a stale state moves them by far more)."""
    from greedy_agreement import margins_from_logprobs

    make_checkpoint("qwen3-next", tmp_path, head_dim=32)
    kw = dict(device="cuda", dtype="bfloat16", block_size=16, max_num_seqs=8)
    prompts = _prompts()
    lengths = [NEW_TOKENS, 5, NEW_TOKENS, NEW_TOKENS]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in lengths]
    eager = engines(tmp_path, enforce_eager=True, **kw)
    ref = eager.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    eager.engine.shutdown()
    graphs = engines(tmp_path, enforce_eager=False, **kw)
    runner = graphs.engine.runner
    assert runner.model.cuda_graph_unsupported_reason is None
    assert runner.graphs is not None and runner.graphs.has_slots, runner.graphs_off_reason
    outs = graphs.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for k, (out, want) in enumerate(zip(outs, ref)):
        w = want.outputs[0]
        assert_greedy_agrees(out.outputs[0].token_ids, w.token_ids, margins_from_logprobs(w.logprobs), 0.05,
                             what=f"qwen3-next bf16 graphs prompt {k}")
    assert runner.num_graph_steps > 0

"""Speculative decoding of Qwen3-Next and Kimi-Linear: greedy output equal to speculation off, token for token.

Tiny random checkpoints (tests/tiny_checkpoints.py), float32 on CPU, prefill chunks of 16 tokens (the longer
prompts cross steps, and verify steps share steps with other sequences' prefill chunks). Speculation off is
the reference (that path is checked against transformers in tests/test_linear_attention_engine_vs_hf.py).
Proposers: n-gram (prompts that repeat a pattern, so some proposals are accepted), one that proposes random
tokens (nearly every proposal rejected: every step rolls the state back), and an oracle that proposes the
reference's own next tokens (every proposal accepted: the replay covers all 1 + k rows). Exact token equality
holds because verification keeps exactly the target's argmax tokens; only the float summation order of the
verify rows differs from one-token decode steps, which could flip a near-tie (none occurs for these fixed
prompts and weights). A slot whose state kept a rejected row would change the following logits and tokens.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from linear_attention_setup import CASES, ENGINE, one_torch_thread  # noqa: F401 (autouse fixture)

transformers = pytest.importorskip("transformers")

from tiny_checkpoints import LINEAR_VOCAB as VOCAB  # noqa: E402
from tiny_checkpoints import make_checkpoint  # noqa: E402

from kvforge import SamplingParams  # noqa: E402
from kvforge.attention import linear_state  # noqa: E402
from kvforge.attention.routing import delta_rule as delta_rule_route  # noqa: E402
from kvforge.engine.scheduler import Scheduler  # noqa: E402
from kvforge.engine.sequence import Sequence  # noqa: E402

NEW_TOKENS = 16


def _prompts(n: int = 4) -> list[list[int]]:
    """Random prompts, each ending in a pattern repeated a few times."""
    g = torch.Generator().manual_seed(7)
    out = []
    for head, pattern, times in ((21, 5, 3), (3, 4, 2), (30, 3, 4), (1, 6, 2))[:n]:
        rep = torch.randint(3, VOCAB, (pattern,), generator=g).tolist()
        out.append(torch.randint(3, VOCAB, (head,), generator=g).tolist() + rep * times)
    return out


def _every_step(k: int, **config) -> dict:
    """A speculative config (n-gram unless ``method`` says otherwise) whose sequences get proposals at every
    decode step (no back-off after rejections: every step verifies and rolls back)."""
    return {"method": "ngram", "num_speculative_tokens": k, "backoff": False, **config}


class GarbageProposer:
    """Proposes uniformly random token ids (seeded): nearly every proposal is rejected."""

    def __init__(self, num_speculative_tokens: int, seed: int = 0):
        self.num_speculative_tokens = num_speculative_tokens
        self.rng = random.Random(seed)

    def propose(self, seqs):
        return [[self.rng.randrange(VOCAB) for _ in range(self.num_speculative_tokens)] for _ in seqs]


class OracleProposer:
    """Proposes the tokens the non-speculative run generated next: every proposal is accepted. With
    ``partly``, each proposal list is right only up to a random position (seeded) and wrong from there,
    so some steps keep part of their rows."""

    def __init__(self, num_speculative_tokens: int, prompts, outputs, partly: bool = False):
        self.num_speculative_tokens = num_speculative_tokens
        self.reference = {tuple(p): out for p, out in zip(prompts, outputs)}
        self.rng = random.Random(3) if partly else None

    def propose(self, seqs):
        proposals = []
        for seq in seqs:
            done = seq.all_token_ids[seq.num_prompt_tokens:]
            want = list(self.reference[tuple(seq.prompt_token_ids)][len(done):len(done) + self.num_speculative_tokens])
            right = len(want) if self.rng is None else self.rng.randint(0, len(want))
            want[right:] = [(tok + 1) % VOCAB for tok in want[right:]]
            proposals.append(want)
        return proposals



def _generate(engine, prompts, params):
    """Step to the end; after every step no slot is held by a finished request. Outputs in prompt order."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), list(p), params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        running = {seq.request_id for seq in engine.scheduler.running}
        assert set(engine.state_slots.held) <= running
    assert engine.state_slots.num_free == engine.state_slots.num_slots
    return [final[str(i)] for i in range(len(prompts))]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _greedy(n=NEW_TOKENS):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


#: The checkpoints of the tests that run the state operations in Triton's interpreter: the last linear-attention
#: layer dropped (the interpreter's cost grows with the linear layers; two still keep per-layer state apart).
KERNEL_TEST_LAYERS = {
    "qwen3-next": dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "kimi-linear": dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "dense"]),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(case, kernel_test=False)``: the case's tiny checkpoint directory (with KERNEL_TEST_LAYERS
    for ``kernel_test``), written once per module (make_checkpoint seeds its weights)."""
    paths = {}

    def get(case, kernel_test=False):
        key = (case, kernel_test)
        if key not in paths:
            paths[key] = tmp_path_factory.mktemp(case)
            make_checkpoint(case, paths[key], **(KERNEL_TEST_LAYERS[case] if kernel_test else {}))
        return paths[key]

    return get


@pytest.fixture(scope="module")
def reference(checkpoint):
    """``reference(case, prompts, n, kernel_test=False)``: speculation off's greedy tokens (ENGINE's settings),
    computed once per module for each checkpoint, prompt list and length."""
    from kvforge import LLM

    done = {}

    def get(case, prompts, n=NEW_TOKENS, kernel_test=False):
        key = (case, tuple(map(tuple, prompts)), n, kernel_test)
        if key not in done:
            llm = LLM(str(checkpoint(case, kernel_test)), **ENGINE)
            try:
                done[key] = _tokens(_generate(llm.engine, prompts, _greedy(n)))
            finally:
                llm.engine.shutdown()
        return done[key]

    return get


def _acceptance(outs) -> tuple[int, int]:
    return (sum(o.speculative.num_accepted_tokens for o in outs), sum(o.speculative.num_draft_tokens for o in outs))


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_greedy_equal_with_every_proposer(case, k, checkpoint, reference, engines):
    path = checkpoint(case)
    prompts = _prompts()
    want = reference(case, prompts)

    # A one-token suffix finds earlier matches in random text (the model does not continue the prompts' patterns).
    ngram = engines(path, speculative_config=_every_step(k, prompt_lookup_min=1, prompt_lookup_max=5))
    assert ngram.engine.plan.verify_replay_bytes_per_sequence() > 0
    outs = _generate(ngram.engine, prompts, _greedy())
    assert _tokens(outs) == want
    assert _acceptance(outs)[1] > 0  # n-gram proposals were verified (the random model seldom accepts one)

    garbage = engines(path, speculative_config=_every_step(k))
    garbage.engine.proposer = GarbageProposer(k)
    outs = _generate(garbage.engine, prompts, _greedy())
    assert _tokens(outs) == want
    accepted, proposed = _acceptance(outs)
    assert proposed >= len(prompts) * (NEW_TOKENS // 2) and accepted <= proposed // 10

    oracle = engines(path, speculative_config=_every_step(k))
    oracle.engine.proposer = OracleProposer(k, prompts, want)
    outs = _generate(oracle.engine, prompts, _greedy())
    assert _tokens(outs) == want
    accepted, proposed = _acceptance(outs)
    assert proposed > 0 and accepted == proposed
    assert oracle.engine.num_steps < garbage.engine.num_steps  # k + 1 tokens per verify step

    partly = engines(path, speculative_config=_every_step(k))
    partly.engine.proposer = OracleProposer(k, prompts, want, partly=True)
    outs = _generate(partly.engine, prompts, _greedy())
    assert _tokens(outs) == want
    accepted, proposed = _acceptance(outs)
    assert 0 < accepted < proposed  # steps that keep some rows and roll the others back


def test_seeded_sampling_with_rollbacks_is_reproducible(checkpoint, reference, engines):
    """Sampled requests verify through the rejection sampler (unchanged) and roll their states back through the
    same replay: proposals are both accepted and rejected, and two runs with the same seeds give the same tokens
    (the pool is uninitialized memory on CPU: a replay reading rows no step wrote would not repeat). The oracle
    proposes the greedy run's tokens, so a low temperature keeps the samples near it, where some are accepted."""
    path = checkpoint("qwen3-next")
    prompts = _prompts(3)
    want = reference("qwen3-next", prompts)
    runs = []
    for _ in range(2):
        engine = engines(path, speculative_config=_every_step(3)).engine
        engine.proposer = OracleProposer(3, prompts, want, partly=True)
        params = SamplingParams(temperature=0.3, top_k=8, max_tokens=NEW_TOKENS, ignore_eos=True, seed=11)
        outs = _generate(engine, prompts, params)
        accepted, proposed = _acceptance(outs)
        assert 0 < accepted < proposed
        runs.append(_tokens(outs))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("case", CASES)
def test_async_scheduling_between_verification_steps(case, checkpoint, reference, engines):
    """With --async-scheduling and the back-off on, rejected proposals pause a sequence's proposals, and
    the steps without a verification overlap (the host a step ahead); verification steps resolve at once.
    Greedy output equals speculation off, and every state slot comes back."""
    prompts = _prompts()
    want = reference(case, prompts)
    engine = engines(checkpoint(case), speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                     async_scheduling=True).engine
    assert engine.async_scheduling and engine.spec_backoff is not None
    engine.proposer = GarbageProposer(3, seed=2)
    overlapped, step = [], engine.step

    def step_and_record():
        outs = step()
        overlapped.append(engine._inflight is not None)  # a step launched and left running
        return outs

    engine.step = step_and_record
    outs = _generate(engine, prompts, _greedy())
    assert _tokens(outs) == want
    accepted, proposed = _acceptance(outs)
    assert proposed > 0 and any(overlapped)
    assert engine.state_slots.num_free == engine.state_slots.num_slots


@pytest.mark.parametrize("case", CASES)
def test_preempted_sequences_recompute_under_speculation(case, checkpoint, reference, engines, monkeypatch):
    """Memory pressure preempts verifying sequences; each recomputes from its prompt, its first chunk from a
    zero state, and the output still equals speculation off."""
    monkeypatch.setattr(Scheduler, "admit_whole_prompts", False)  # admitted by first chunk (vLLM's rule), prompts outgrow the pool
    prompts = _prompts()
    want = reference(case, prompts)
    llm = engines(checkpoint(case), speculative_config=_every_step(3))
    engine = llm.engine
    engine.proposer = GarbageProposer(3, seed=1)
    bm = engine.block_manager
    hog = Sequence("hog", [1] * (4 * (bm.num_free_blocks - 22)), SamplingParams(max_tokens=1))
    assert bm.allocate(hog, cached_blocks=[]) and bm.num_free_blocks == 22  # 88 tokens for 130 + 64 + proposals
    outs = _generate(engine, prompts, _greedy())
    assert engine.stats()["num_preemptions"] > 0
    assert _tokens(outs) == want


@pytest.mark.parametrize("case", CASES)
def test_draft_model_proposals(case, tmp_path, checkpoint, reference, engines):
    """A tiny random model of the same vocabulary and special tokens drafts for the linear-attention target (a
    draft keeps no linear state, so only the target's slots roll back); the output equals speculation off. The
    draft's layers join the target's attention group, so they have its KV geometry: a Llama's 2 KV heads of 16
    for Qwen3-Next, a DeepSeek's MLA latent of 32 + 8 for Kimi-Linear."""
    from test_speculative_engine import DEEPSEEK, LLAMA, save_tiny

    target = checkpoint(case)
    base = LLAMA if case == "qwen3-next" else (DEEPSEEK[0], DEEPSEEK[1], dict(DEEPSEEK[2], num_hidden_layers=1))
    draft = save_tiny(tmp_path / "draft", (base[0], base[1], dict(base[2], vocab_size=VOCAB, pad_token_id=0,
                                                                    bos_token_id=1, eos_token_id=2)))
    prompts = _prompts()
    want = reference(case, prompts)
    engine = engines(target, speculative_config=_every_step(3, method="draft_model", model=draft)).engine
    assert engine.plan.draft is not None and engine.plan.verify_replay_bytes_per_sequence() > 0
    assert [g.kind for g in engine.plan.groups if g.draft_layers] == ["full" if case == "qwen3-next" else "mla"]
    outs = _generate(engine, prompts, _greedy())
    assert _tokens(outs) == want
    assert _acceptance(outs)[1] > 0


def _recording(run, replayed: list):
    """``run`` (DecodeGraphs.run) that first notes each replayed step's (sequences, query length)."""
    def recorded(host):
        replayed.append((host.num_seqs, host.max_query_len))
        return run(host)
    return recorded


@pytest.mark.parametrize("path", ["reference", "kernels"])
@pytest.mark.parametrize("case", CASES)
def test_verify_steps_on_the_graph_path_static_buffers(case, path, checkpoint, reference, engines, monkeypatch):
    """Verify steps where every sequence verifies k proposals take the CUDA-graph path's static, padded inputs
    (run eagerly on CPU): static slot ids, no state stored, verify rows through static source and destination
    buffers whose padding rows repeat the first real row. Batches of 3 pad to 4. ``kernels``: the state
    operations on the Triton kernels (Triton's interpreter), shorter runs on KERNEL_TEST_LAYERS."""
    from kvforge.engine.model_runner import ModelRunner

    prompts, n = _prompts(3), NEW_TOKENS
    proposers = ("garbage", "oracle")
    if path == "kernels":
        device = pytest.importorskip("triton_kernel_device")
        if not device.INTERPRETED:
            pytest.skip("the engine runs on CPU here: kernels run on CPU tensors only in Triton's interpreter")
        device.skip_unless_loaded_loop_bounds_work()
        prompts, n, proposers = [p[:m] for p, m in zip(prompts, (12, 5, 9))], 6, ("garbage",)
    kernel_test = path == "kernels"
    want = reference(case, prompts, n, kernel_test)
    if kernel_test:
        monkeypatch.setattr(linear_state, "KERNEL_DEVICES", ("cuda", "cpu"))
    for proposer in proposers:
        engine = engines(checkpoint(case, kernel_test), speculative_config=_every_step(3), max_num_seqs=4).engine
        engine.runner = ModelRunner(engine.model, engine.pool, engine.plan, engine.device, enforce_eager=False,
                                    max_num_seqs=4, static_decode_on_cpu=True, verify_query_len=4)
        graphs = engine.runner.graphs
        assert graphs.query_lens == (1, 4) and graphs.sizes == [1, 2, 4]
        replayed = []
        graphs.run = _recording(graphs.run, replayed)
        engine.proposer = GarbageProposer(3) if proposer == "garbage" else OracleProposer(3, prompts, want)
        outs = _generate(engine, prompts, _greedy(n))
        assert _tokens(outs) == want, proposer
        assert any(q == 4 for _, q in replayed), replayed
        if proposer == "garbage":  # the three sequences verify in step; an oracle's finish at other steps
            assert (3, 4) in replayed, replayed  # three sequences verifying 3 proposals each, padded to 4



def _noting(replay, counts: list):
    """``replay(slots, num_rows)`` that first notes ``num_rows``."""
    def noted(slots, num_rows):
        counts.append(list(num_rows))
        return replay(slots, num_rows)
    return noted


@pytest.mark.parametrize("case", CASES)
def test_replays_of_accepted_rows_on_the_graph_path_static_buffers(case, checkpoint, reference, engines, monkeypatch):
    """The replay of accepted verify rows through the replay graphs' static, padded inputs
    (kvforge/engine/replay_graphs.py; run eagerly on CPU, kernels in Triton's interpreter): where every
    verifying sequence keeps the same count (all rejected, all accepted) the static path runs, three sequences
    padded to four with slot -1; mixed counts (proposals right up to a random position) replay eagerly. Greedy
    output equals speculation off, so every replayed state is the state of the accepted tokens."""
    from kvforge.engine.model_runner import ModelRunner

    device = pytest.importorskip("triton_kernel_device")
    if not device.INTERPRETED:
        pytest.skip("the engine runs on CPU here: kernels run on CPU tensors only in Triton's interpreter")
    device.skip_unless_loaded_loop_bounds_work()
    prompts = [p[:m] for p, m in zip(_prompts(3), (12, 5, 9))]
    want = reference(case, prompts, 6, kernel_test=True)
    monkeypatch.setattr(linear_state, "KERNEL_DEVICES", ("cuda", "cpu"))
    for proposer in ("garbage", "oracle", "partly"):
        engine = engines(checkpoint(case, kernel_test=True), speculative_config=_every_step(3), max_num_seqs=4,
                         enable_prefix_caching=False).engine
        engine.runner = ModelRunner(engine.model, engine.pool, engine.plan, engine.device, enforce_eager=False,
                                    max_num_seqs=4, static_decode_on_cpu=True, verify_query_len=4)
        graphs = engine.runner.replay_graphs
        assert graphs is not None and graphs.sizes == [1, 2, 4] and graphs.rows == 4
        replayed, eager = [], []
        run, keep = graphs.run, engine.runner.linear_states.keep_verified
        graphs.run = _noting(run, replayed)
        engine.runner.linear_states.keep_verified = _noting(keep, eager)
        engine.proposer = (GarbageProposer(3) if proposer == "garbage"
                           else OracleProposer(3, prompts, want, partly=proposer == "partly"))
        assert _tokens(_generate(engine, prompts, _greedy(6))) == want, proposer
        assert engine.runner.num_graph_replays == len(replayed) > 0, proposer
        assert all(len(set(rows)) == 1 for rows in replayed) and all(len(set(rows)) > 1 for rows in eager)
        if proposer == "garbage":
            assert [1, 1, 1] in replayed, replayed  # three sequences, padded to the graph of four
        if proposer == "oracle":
            assert any(rows[0] == 4 for rows in replayed), replayed
        if proposer == "partly":
            assert eager, (replayed, eager)


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_ranks_roll_back_their_heads(case, checkpoint, engines):
    """TP 2 on gloo (2 processes): each rank keeps its heads' verify rows and replays the accepted ones (rank 0
    sends the replays with the next step); the output equals TP 2 without speculation (the same all-reduces).
    One speculating engine serves both proposers in turn (prefix caching off, so the second pass prefills
    and verifies from scratch as the first did)."""
    path = checkpoint(case)
    prompts = _prompts()
    off = engines(path, tensor_parallel_size=2, enable_prefix_caching=False).engine
    want = _tokens(_generate(off, prompts, _greedy()))
    off.shutdown()  # one tensor-parallel engine per process at a time
    engine = engines(path, tensor_parallel_size=2, speculative_config=_every_step(3),
                     enable_prefix_caching=False).engine
    for proposer in ("garbage", "partly right"):
        engine.proposer = (GarbageProposer(3) if proposer == "garbage"
                           else OracleProposer(3, prompts, want, partly=True))
        outs = _generate(engine, prompts, _greedy())
        assert _tokens(outs) == want, proposer
        assert _acceptance(outs)[1] > 0
    engine.shutdown()



@pytest.mark.parametrize("bound", ["default", "0 bytes"])
@pytest.mark.parametrize("case", CASES)
def test_verify_rows_of_every_layer_share_one_table(case, bound, checkpoint, reference, engines, monkeypatch):
    """The pool keeps every state layer's verify rows side by side in one table (columns disjoint, covering
    it), and a replay of the accepted rows gathers that table once for all layers, or each layer's own
    columns once where one gather would pass ``KEPT_GATHER_BYTES`` (set to 0 here); greedy output still
    equals speculation off, with proposals partly accepted."""
    prompts = _prompts()
    want = reference(case, prompts)
    if bound == "0 bytes":
        monkeypatch.setattr(linear_state, "KEPT_GATHER_BYTES", 0)
    llm = engines(checkpoint(case), speculative_config=_every_step(3))
    verify = llm.engine.pool.linear_states.verify
    tables = {id(rows.table): rows.table for rows in verify.values()}
    assert len(verify) > 1 and len(tables) == 1
    table = next(iter(tables.values()))
    spans = sorted((start, start + math.prod(shape)) for rows in verify.values()
                   for start, shape in rows.columns.values())
    assert spans[0][0] == 0 and spans[-1][1] == table.shape[1]
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    gathers, replays = [], []
    index_select, keep_verified = torch.Tensor.index_select, linear_state.LinearStates.keep_verified

    def counted(self, dim, index):
        if self.untyped_storage().data_ptr() == table.untyped_storage().data_ptr():  # the table or a view of it
            gathers[-1] += 1
        return index_select(self, dim, index)

    def replay(self, slots, num_rows):
        gathers.append(0)
        replays.append(list(num_rows))
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "index_select", counted)
            keep_verified(self, slots, num_rows)

    monkeypatch.setattr(linear_state.LinearStates, "keep_verified", replay)
    llm.engine.proposer = OracleProposer(3, prompts, want, partly=True)
    assert _tokens(_generate(llm.engine, prompts, _greedy())) == want
    assert len(gathers) > 5 and set(gathers) == {1 if bound == "default" else len(verify)}, gathers
    assert {n for rows in replays for n in rows} >= {1, 4}, replays  # none and all of the 3 proposals kept


@pytest.mark.parametrize("case", CASES)
def test_triton_kernels_in_the_engine(case, checkpoint, reference, engines, monkeypatch):
    """The state operations on the Triton kernels (Triton's interpreter on CPU here; the gpu-marked test below
    compiles them): verify steps through the prefill kernels with kept slots, and the replay kernels (on
    KERNEL_TEST_LAYERS)."""
    device = pytest.importorskip("triton_kernel_device")
    if not device.INTERPRETED:
        pytest.skip("the engine runs on CPU here: kernels run on CPU tensors only in Triton's interpreter")
    device.skip_unless_loaded_loop_bounds_work()
    prompts = [p[:n] for p, n in zip(_prompts(2), (18, 7))]
    want = reference(case, prompts, 6, kernel_test=True)
    monkeypatch.setattr(linear_state, "KERNEL_DEVICES", ("cuda", "cpu"))
    assert linear_state._use_kernels(torch.zeros(1))
    llm = engines(checkpoint(case, kernel_test=True), speculative_config=_every_step(3), enable_prefix_caching=False)
    asked, replays = [], []  # the route's answers inside replays: once a replay for both state layers
    prefill_form, keep_verified = delta_rule_route.prefill_form, linear_state.LinearStates.keep_verified

    def counted_form(*a, **kw):
        asked.append(a)
        return prefill_form(*a, **kw)

    def replay(self, slots, num_rows):
        replays.append(len(asked))
        keep_verified(self, slots, num_rows)
        replays[-1] = len(asked) - replays[-1]

    monkeypatch.setattr(delta_rule_route, "prefill_form", counted_form)
    monkeypatch.setattr(linear_state.LinearStates, "keep_verified", replay)
    for proposer in ("garbage", "oracle"):  # one engine, the proposers in turn (nothing cached between them)
        llm.engine.proposer = (GarbageProposer(3) if proposer == "garbage"
                               else OracleProposer(3, prompts, want))
        outs = _generate(llm.engine, prompts, _greedy(6))
        assert _tokens(outs) == want, proposer
    assert replays and set(replays) == {1}, replays


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_gpu_greedy_equal_on_the_kernels(case, k, tmp_path, engines):
    """float32 on CUDA: the compiled Triton kernels (verify steps through the prefill kernels with kept slots,
    the replay kernels, captured where every sequence keeps the same count), decode steps and uniform verify
    steps replaying CUDA graphs over the state slots
    (dense-MLP variants, head size 32 and blocks of 16 as in tests/test_linear_attention_engine_vs_hf.py).
    n-gram, random, oracle and partly right proposals follow speculation off's greedy tokens, up to a near-tie
    of its logits within 1e-3 (the verify rows go through other kernels than the graphs' decode steps, so the
    last bits may differ)."""
    from greedy_agreement import FP32_LOGIT_TOL, assert_greedy_agrees, margins_from_logprobs

    dense = {"qwen3-next": dict(num_experts=0, head_dim=32), "kimi-linear": dict(mlp_layer_types=["dense"] * 4)}[case]
    make_checkpoint(case, tmp_path, **dense)
    prompts = _prompts()
    gpu = dict(device="cuda", kv_cache_memory=1 << 24, block_size=16, max_num_seqs=8, enforce_eager=False)
    reference = engines(tmp_path, **gpu).engine
    assert reference.runner.graphs is not None and reference.runner.graphs.has_slots
    ref = _generate(reference, prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                       logprobs=2))
    want = _tokens(ref)
    for proposer in ("ngram", "garbage", "oracle", "partly right"):
        engine = engines(tmp_path, speculative_config=_every_step(k, prompt_lookup_min=1, prompt_lookup_max=5), **gpu).engine
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.query_lens == (1, k + 1), engine.runner.graphs_off_reason
        replayed = []
        graphs.run = _recording(graphs.run, replayed)
        if proposer == "garbage":
            engine.proposer = GarbageProposer(k)
        elif proposer != "ngram":
            engine.proposer = OracleProposer(k, prompts, want, partly=proposer == "partly right")
        outs = _generate(engine, prompts, _greedy())
        for i, (got, r) in enumerate(zip(_tokens(outs), ref)):
            assert_greedy_agrees(got, r.outputs[0].token_ids, margins_from_logprobs(r.outputs[0].logprobs),
                                 FP32_LOGIT_TOL, what=f"{case} k={k} {proposer} prompt {i}")
        assert _acceptance(outs)[1] > 0, proposer
        if proposer == "garbage":  # every decoding sequence verifies k proposals: verification graphs replay
            assert any(q == k + 1 for _, q in replayed), replayed
            # and every one keeps one row: the captured replay of accepted rows serves them
            assert engine.runner.replay_graphs is not None and engine.runner.num_graph_replays > 0

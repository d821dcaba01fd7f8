"""Speculative decoding with a draft model (kvforge/speculative/draft_model.py).

Greedy output must equal speculation off token for token (the reference: speculation off, itself checked
against transformers in tests/test_engine_vs_hf.py); equality is exact because verification keeps exactly
the target's argmax tokens, whatever the draft proposes (the verify rows only change the batch's float
summation order, which flips no near-tie for these fixed prompts and seeds). The draft's layers live in the
target's groups and pool: after every step the one block manager's free blocks are exactly those no running
sequence holds, each decoding sequence holds the blocks of its computed tokens (target and draft layers
alike), and the draft's KV covers every position the target computed with the sequence's own tokens.
"""

from __future__ import annotations

import pytest
import torch
from proposer_reads import count_propose_reads
from test_speculative_engine import (
    DEEPSEEK,
    LLAMA,
    REPEAT,
    TINY_PROMPTS,
    check_rollback_invariants,
    save_tiny,
)

from kvforge import LLM, SamplingParams
from kvforge.engine.sequence import Sequence
from kvforge.spec.embedded import embedded_model_path
from kvforge.speculative.draft_model import DraftModelProposer


def check_draft_invariants(engine) -> None:
    proposer, bm = engine.proposer, engine.block_manager
    assert proposer.block_manager is bm  # no block manager of the draft's own
    running = list(engine.scheduler.running)
    held = {b for seq in running for g, t in enumerate(seq.block_tables) for b in t[seq.num_skipped_blocks[g]:]}
    assert bm.num_free_blocks == bm.num_blocks - len(held), "blocks held by no running sequence"
    ids = {seq.request_id for seq in running}
    for state in proposer._states.values():
        assert state.request_id in ids, f"{state.request_id}: draft state kept after it stopped running"
        seq = state.seq
        assert state.num_real <= seq.num_tokens + seq.num_pending
        valid = state.num_real
        for token in state.fed:
            if valid >= seq.num_tokens or seq.all_token_ids[valid] != token:
                break
            valid += 1
        assert valid >= seq.num_computed_tokens, f"{seq}: the draft's KV stops at {valid}"


def generate(llm, prompts, params):
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), list(p) if not isinstance(p, str) else p, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        check_rollback_invariants(engine)
        if engine.speculative is not None and engine.speculative.method == "draft_model":
            check_draft_invariants(engine)
    assert engine.block_manager.num_used_blocks == 0  # every finished request freed its blocks, draft's too
    return [final[str(i)] for i in range(len(prompts))]


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def draft_config(model, k):
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def off():
    """The speculation-off reference engine of the embedded SmolLM2, shared by the tests of this module;
    without prefix caching every reference run computes its prompts in full, exactly as a fresh engine."""
    return LLM(device="cpu", progress=False, enable_prefix_caching=False)


def test_embedded_model_as_its_own_draft(off):
    prompts = [REPEAT, "Write a short note about the sea.", "Count: one, two, three, four, five, six,"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = token_ids(generate(off, prompts, params))
    on = LLM(device="cpu", progress=False, speculative_config=draft_config(embedded_model_path(), 3))
    assert isinstance(on.engine.proposer, DraftModelProposer)
    outs = generate(on, prompts, params)
    assert token_ids(outs) == ref
    counters = on.engine.stats()["spec_decode"]
    # The draft is the target: it proposes the target's argmax (up to float summation order).
    assert counters["num_accepted_tokens"] / counters["num_draft_tokens"] > 0.9
    assert on.engine.stats()["num_steps"] < 16 * 3 / 2


@pytest.mark.parametrize("kv_heads, layers, groups", [
    # The target's KV geometry (2 KV heads of 16): the draft's layer joins the target's group, a block id
    # spans 3 pages (2 target + 1 draft layer).
    (2, 1, [((0, 1), (0,), 1)]),
    # 1 KV head of 16: half the pool's page, both draft layers share one page slot; group size 1 (types of
    # 2 and 1 slots), so 3 groups of one slot each.
    (1, 2, [((0,), (), 1), ((1,), (), 1), ((), (0, 1), 2)]),
])
def test_different_draft_with_fp8_chunked_prefill_and_preemption(tmp_path, kv_heads, layers, groups):
    target = save_tiny(tmp_path / "target", LLAMA)
    torch.manual_seed(1)
    draft_case = (LLAMA[0], LLAMA[1], dict(LLAMA[2], num_hidden_layers=layers, hidden_size=32, num_attention_heads=2,
                                           num_key_value_heads=kv_heads, intermediate_size=48))
    draft = save_tiny(tmp_path / "draft", draft_case)
    prompts = TINY_PROMPTS + [list(range(100, 140)), [7] * 20]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # A 12-token step budget chunks the prompts (the draft follows each chunk); 16 blocks of 4 tokens for
    # five requests of up to 64 tokens preempt by recompute.
    kw = dict(dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_dtype="fp8", progress=False,
              device="cpu", max_model_len=64, max_num_batched_tokens=12)
    page = 2 * 2 * 16 * 4  # K,V x KV heads x head size x block, one byte each: one target layer's page
    blocks = 16
    ref = token_ids(generate(LLM(target, kv_cache_memory=blocks * 2 * page, **kw), prompts, params))
    # The same 16 blocks of every group cost 3 page slots per block position. Back-off off: a random draft's
    # proposals fail, and this test wants them verified every step.
    on = LLM(target, kv_cache_memory=blocks * 3 * page, speculative_config={**draft_config(draft, 3), "backoff": False},
             **kw)
    plan = on.engine.plan
    assert [(g.layers, g.draft_layers, g.draft_layers_per_slot) for g in plan.groups] == groups
    assert plan.num_blocks * plan.group_size == blocks * 3 and on.engine.pool.nbytes == blocks * 3 * page
    assert all(layer.kv_dtype == "fp8_e4m3" for layer in plan.draft.layers)
    outs = generate(on, prompts, params)
    assert token_ids(outs) == ref
    stats = on.engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["spec_decode"]["num_draft_tokens"] > 50  # a random draft: acceptance is low, output unchanged


def test_deepseek_target_with_mla_draft(tmp_path):
    target = save_tiny(tmp_path / "target", DEEPSEEK)
    torch.manual_seed(2)
    draft = save_tiny(tmp_path / "draft", (DEEPSEEK[0], DEEPSEEK[1], dict(DEEPSEEK[2], num_hidden_layers=1)))
    kw = dict(dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False,
              device="cpu")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = token_ids(generate(LLM(target, **kw), TINY_PROMPTS, params))
    on = LLM(target, speculative_config=draft_config(draft, 2), **kw)
    assert [(g.kind, g.layers, g.draft_layers) for g in on.engine.plan.groups] == [("mla", (0, 1, 2), (0,))]
    assert token_ids(generate(on, TINY_PROMPTS, params)) == ref
    assert on.engine.stats()["spec_decode"]["num_draft_tokens"] > 0


def test_seeded_sampling_with_a_draft_is_reproducible():
    cfg = draft_config(embedded_model_path(), 3)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    a = generate(LLM(device="cpu", progress=False, speculative_config=cfg), [REPEAT], params)
    b = generate(LLM(device="cpu", progress=False, speculative_config=cfg), [REPEAT], params)
    assert token_ids(a) == token_ids(b) and len(token_ids(a)[0]) == 16
    assert a[0].speculative.num_accepted_tokens > 0  # the draft's q equals the target's p: most are accepted


class FixedLogitsRunner:
    """Every row's logits are ``logits`` (a draft model that always predicts the same distribution)."""

    def __init__(self, logits):
        self.logits = logits

    def run(self, chunks, rows):
        return self.logits.expand(len(rows), -1).clone()

    def run_picked(self, chunks, rows, tokens):
        return self.run(chunks, rows)


def test_sampled_proposals_follow_q_and_q_is_handed_over():
    from test_rejection_sampling import P_VALUE_THRESHOLD, chi_square_p_value

    from kvforge.engine.block_manager import BlockManager

    logits = torch.tensor([1.0, 0.2, -0.5, 0.7, 0.0, -1.0])
    params = SamplingParams(temperature=0.7, max_tokens=100)
    q = torch.softmax(logits.double() / 0.7, dim=-1)  # the independent reference for q
    bm = BlockManager(4096, 4, False)
    proposer = DraftModelProposer(2, FixedLogitsRunner(logits), bm, 64, 64)
    counts = torch.zeros(6, dtype=torch.long)
    for i in range(3000):
        seq = Sequence(f"r{i}", [1, 2, 3], params)
        assert bm.allocate(seq, 2)
        seq.num_computed_tokens = 2  # a decoding sequence: its last token is fed with the proposals
        proposals = proposer.propose([seq])[0]
        assert len(seq.block_tables[0]) == 2  # positions 2 .. 4 (the last token, 2 proposals) have blocks
        assert len(proposals) == 2
        counts[proposals[0]] += 1
        handed = proposer.proposal_probs(seq, 2)
        torch.testing.assert_close(handed, q.float().expand(2, -1), rtol=1e-5, atol=1e-6)
        proposer.discard(seq.request_id)
        bm.free(seq)
    assert chi_square_p_value(counts, q) > P_VALUE_THRESHOLD
    assert bm.num_used_blocks == 0


def test_sliding_window_model_as_its_own_draft(tmp_path):
    """The draft's sliding-window groups free what leaves the window while its proposals are rolled back
    (a 16-token window over blocks of 4); the invariants above check every step."""
    from tiny_checkpoints import make_checkpoint

    make_checkpoint("gemma3", tmp_path)
    kw = dict(dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False,
              device="cpu")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = token_ids(generate(LLM(str(tmp_path), **kw), TINY_PROMPTS, params))
    on = LLM(str(tmp_path), speculative_config=draft_config(tmp_path, 3), **kw)
    assert "sliding" in {g.kind for g in on.engine.plan.groups if g.draft_layers}
    assert token_ids(generate(on, TINY_PROMPTS, params)) == ref
    counters = on.engine.stats()["spec_decode"]
    assert counters["num_accepted_tokens"] / counters["num_draft_tokens"] > 0.9


def test_prefix_cached_blocks_carry_the_draft_kv(off):
    """The draft follows every target chunk, so a block the prefix cache registers holds the draft's KV of
    its tokens too. With the model as its own draft, each draft layer's page equals the same target layer's
    in every cached block (the same weights over the same tokens; float32, batch shapes only change the
    summation order, hence the tolerance); a second request over the same prompt resumes from those blocks
    for both models and still gets the target's output with nearly every proposal accepted."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = token_ids(generate(off, [REPEAT], params))
    on = LLM(device="cpu", progress=False, speculative_config=draft_config(embedded_model_path(), 3))
    engine = on.engine
    assert token_ids(generate(on, [REPEAT], params)) == ref
    bm, pool = engine.block_manager, engine.pool
    cached = sorted(bm._hash_to_block.values())
    assert len(cached) >= 2
    assert len(pool.draft_kv_caches) == len(pool.kv_caches) == 30
    for layer in range(30):
        torch.testing.assert_close(pool.draft_kv_caches[layer][cached], pool.kv_caches[layer][cached],
                                   rtol=1e-3, atol=1e-3)
    hits = bm.prefix_cache_hits
    engine.add_request("again", REPEAT, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
        check_rollback_invariants(engine)
        check_draft_invariants(engine)
    assert bm.prefix_cache_hits - hits >= len(cached) * bm.block_size - bm.block_size
    assert final.outputs[0].token_ids == ref[0]
    assert final.speculative.num_accepted_tokens / final.speculative.num_draft_tokens > 0.9


def test_draft_layers_own_the_page_slots_after_the_target_layers():
    """KVPool: in a group of n target and d draft layers, draft layer j owns page slot n + j, a page of its own
    (no view of a draft layer aliases a target layer's), and the buffer holds exactly the plan's bytes."""
    from kvforge.engine.kv_pool import KVPool
    from kvforge.planner.inputs import CacheConfig
    from kvforge.planner.resolver import resolve
    from kvforge.spec.architectures import spec_from_hf_config

    target = spec_from_hf_config(dict(LLAMA[2], architectures=["LlamaForCausalLM"], model_type="llama"),
                                 name="t", source="test")
    draft = spec_from_hf_config(dict(LLAMA[2], num_hidden_layers=3, architectures=["LlamaForCausalLM"],
                                     model_type="llama"), name="d", source="test")
    page = 4 * 2 * 2 * 16 * 4  # block 4 x K,V x 2 KV heads x head size 16 x float32
    plan = resolve(target, CacheConfig(kv_cache_dtype="float32", block_size=4, max_model_len=64,
                                       kv_cache_memory=20 * 5 * page), draft_spec=draft)
    assert [(g.layers, g.draft_layers) for g in plan.groups] == [((0, 1), (0, 1, 2))] and plan.num_blocks == 20
    pool = KVPool(plan, torch.device("cpu"))
    assert pool.nbytes == 20 * 5 * page
    view = pool.draft_view()
    starts = [c.data_ptr() for c in pool.kv_caches] + [c.data_ptr() for c in view.kv_caches]
    assert starts == [pool.pages[slot].data_ptr() for slot in range(5)]
    assert view.layer_group == [0, 0, 0] and view.num_groups == 1 and view.block_size == 4
    pool.buffer.zero_()
    view.kv_caches[2].fill_(1.0)
    assert all(not c.any() for c in pool.kv_caches + view.kv_caches[:2])
    assert bool((pool.pages[4].view(torch.float32) == 1.0).all())


def test_async_steps_hold_exactly_the_blocks_of_their_computed_tokens(tmp_path):
    """Async scheduling with a draft probed every third step: the steps between overlap, the draft follows
    them, and after every step (in flight or not) each running sequence holds exactly the blocks of its
    computed tokens in every group, the draft's included: blocks taken for proposals a step did not verify
    are returned, and none leaks."""
    path = save_tiny(tmp_path, LLAMA)
    kw = dict(dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 20, progress=False,
              device="cpu", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = token_ids(generate(LLM(path, **kw), TINY_PROMPTS, params))
    on = LLM(path, async_scheduling=True, speculative_config=draft_config(path, 3), **kw)
    engine = on.engine
    engine.spec_backoff.due = lambda request_id, step: step % 3 == 0
    bm = engine.block_manager
    for i, p in enumerate(TINY_PROMPTS):
        engine.add_request(str(i), list(p), params)
    final = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        ids = [out.request_id for out in outs]
        assert len(ids) == len(set(ids)), ids  # one output per request and step, also when two steps resolve
        for out in outs:
            final[out.request_id] = out
        running = list(engine.scheduler.running)
        bm.check_invariants(running + list(engine.scheduler.waiting))
        for seq in running:
            assert len(seq.block_tables[0]) == bm.blocks_needed(seq.num_computed_tokens), seq
        check_draft_invariants(engine)
    assert [final[str(i)].outputs[0].token_ids for i in range(len(TINY_PROMPTS))] == ref
    assert bm.num_used_blocks == 0 and engine.stats()["spec_decode"]["num_drafts"] > 0


def test_a_propose_call_reads_its_proposals_once(tmp_path, monkeypatch):
    """Each draft pass takes the previous pass's proposals as its ids on the device; a propose call with
    three passes reads them to the host once (one ``tolist`` of the proposer), and the output still equals
    speculation off (the draft's fed tokens are the proposals read: the invariants after every step)."""
    target = save_tiny(tmp_path / "target", LLAMA)
    kw = dict(dtype="float32", block_size=4, skip_tokenizer_init=True, progress=False, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = token_ids(generate(LLM(target, **kw), TINY_PROMPTS, params))
    on = LLM(target, speculative_config={**draft_config(target, 3), "backoff": False}, **kw)
    reads, made = count_propose_reads(on.engine.proposer, monkeypatch, ("draft_model.py", "pick.py"))
    assert token_ids(generate(on, TINY_PROMPTS, params)) == ref
    assert max(made) == 3 and {n for n, m in zip(reads, made) if m} == {1}, (reads, made)

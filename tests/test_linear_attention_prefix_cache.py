"""Prefix caching for linear-attention hybrids (Qwen3-Next, Kimi-Linear): a hit resumes the paged layers from
cached blocks and the state layers from a snapshot of their state (kvforge/engine/state_prefix.py).

The slot bookkeeping (``StateSlots``) is checked alone: least-recently-used eviction, a request restoring from
a snapshot into another slot or, with no other slot left, taking the snapshot's own, and the invariant
``num_free + len(held) == num_slots``. Through the engine (tiny random checkpoints written by transformers,
float32 on CPU, blocks of 4 tokens, prefill chunks of 16): every request's greedy tokens follow transformers'
greedy stream (tests/greedy_agreement.py, bound ``1e-4 * max(1, max |logits|)`` as in
tests/test_linear_attention_engine_vs_hf.py), and the prompt tokens served from the cache are exactly those up
to the last block with a snapshot: a follow-up turn, a second copy of a prompt, prompts sharing a cached
prefix admitted together (one of them taking the snapshot's slot), a snapshot evicted (its blocks still
cached, no hit), asynchronous scheduling, and n-gram speculative decoding.
"""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import assert_greedy_agrees, top2_margins
from linear_attention_setup import CASES, ENGINE, one_torch_thread  # noqa: F401 (autouse fixture)

from kvforge.engine.state_slots import StateSlots
from kvforge.server.metrics import ServerMetrics, parse_prometheus

transformers = pytest.importorskip("transformers")

from tiny_checkpoints import LINEAR_VOCAB as VOCAB  # noqa: E402
from tiny_checkpoints import make_checkpoint  # noqa: E402

from kvforge import SamplingParams  # noqa: E402
from kvforge.engine.sequence import Sequence  # noqa: E402

NEW_TOKENS = 6
#: KV-cache memory (max-model-len 64) for which the plan gives exactly two (three) state slots.
TWO_SLOTS = {"qwen3-next": 83_000, "kimi-linear": 73_000}
THREE_SLOTS = {"qwen3-next": 110_000, "kimi-linear": 100_000}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


# ---- the slot bookkeeping ------------------------------------------------------------------------------
def _invariant(slots: StateSlots) -> None:
    assert slots.num_free + len(slots.held) == slots.num_slots


def test_snapshots_are_evicted_least_recently_used_first():
    slots = StateSlots(3)
    slots.acquire("a")
    assert slots.snapshot_slot(b"x") is not None and slots.snapshot_slot(b"y") is not None
    assert slots.snapshot_slot(b"x") is None  # kept already: now the most recently used
    _invariant(slots)
    assert slots.num_free == 2 and slots.num_snapshots == 2
    z = slots.snapshot_slot(b"z")  # no empty slot: evicts y, the least recently used
    assert z is not None and slots.has_snapshot(b"x") and not slots.has_snapshot(b"y") and slots.has_snapshot(b"z")
    slots.acquire("b")  # a request evicts a snapshot (x, the least recently used now)
    assert not slots.has_snapshot(b"x") and slots.has_snapshot(b"z")
    slots.acquire("c")
    assert slots.num_snapshots == 0 and slots.num_free == 0
    assert slots.snapshot_slot(b"w") is None  # every slot held by a request: no snapshot
    with pytest.raises(RuntimeError, match="all held"):
        slots.acquire("d")
    _invariant(slots)


def test_a_restore_copies_into_another_slot_or_takes_the_snapshots_own():
    slots = StateSlots(3)
    slots.acquire("running")
    kept = slots.snapshot_slot(b"p")
    slot, source = slots.acquire_from("q1", b"p")  # an empty slot is left: copy the snapshot into it
    assert source == kept and slot != kept and slots.has_snapshot(b"p")
    slot2, source2 = slots.acquire_from("q2", b"p")  # none left but the snapshot's: take it, nothing to copy
    assert slot2 == kept and source2 is None and not slots.has_snapshot(b"p")
    _invariant(slots)
    with pytest.raises(KeyError):
        slots.acquire_from("q3", b"p")
    slots.release("q1")
    assert slots.drop_snapshots() == 0 and slots.num_free == 1


def test_a_restore_keeps_its_snapshot_over_older_ones():
    slots = StateSlots(3)
    slots.snapshot_slot(b"old")
    slots.snapshot_slot(b"p")
    slots.snapshot_slot(b"newer")
    slot, source = slots.acquire_from("q", b"p")  # evicts "old" (least recently used), never "p"
    assert source is not None and slots.has_snapshot(b"p") and not slots.has_snapshot(b"old")
    slot, source = slots.acquire_from("r", b"p")  # "p" was used last: "newer" goes
    assert source is not None and not slots.has_snapshot(b"newer")
    _invariant(slots)


def test_snapshots_of_one_step_never_evict_each_other():
    slots = StateSlots(3)
    slots.acquire("a")
    slots.acquire("b")
    first = slots.snapshot_slot(b"x")
    assert first is not None
    assert slots.snapshot_slot(b"y", protected={b"x"}) is None  # the only other slot holds x, made this step
    assert slots.has_snapshot(b"x") and not slots.has_snapshot(b"y")
    assert slots.snapshot_slot(b"y") == first  # unprotected, x is the least recently used
    _invariant(slots)


def test_a_step_plans_the_snapshots_its_chunks_pass():
    """``plan_snapshots``: a chunk gets a snapshot at its sequence's branch point and snapshot boundary where
    they lie strictly inside it (offset: the token before the point), a point at a chunk's start or end none (a
    chunk's end is a copy after the step); two sequences of one step passing the same prefix share one
    snapshot; one already kept is not taken again; and ``take_snapshots`` after the step never evicts a
    snapshot the step stored inside its chunks."""
    from kvforge.engine.block_manager import BlockManager
    from kvforge.engine.state_prefix import StatePrefixCache

    bm = BlockManager(num_blocks=32, block_size=4)
    slots = StateSlots(6)
    copies = []
    cache = StatePrefixCache(slots, bm, copies.extend)
    shared = _tokens(12, 50)
    a = Sequence("a", shared + _tokens(11, 51), GREEDY)  # 23 tokens: snapshot boundary 20
    a.state_branch_point = 12
    b = Sequence("b", shared + _tokens(3, 52), GREEDY)  # 15 tokens: boundary 12, the same prefix as a's 12
    c = Sequence("c", _tokens(9, 53), GREEDY)  # 9 tokens: boundary 8, its chunk ends there
    for seq in (a, b, c):
        slots.acquire(seq.request_id)
    planned = cache.plan_snapshots([(a, 4, 19), (b, 0, 15), (c, 0, 8)])
    free = set(range(6)) - set(slots.held.values())
    assert [(i, offset) for i, offset, _ in planned] == [(0, 7), (0, 15)]  # a at 12 and 20; b shares a's 12
    assert {dest for *_, dest in planned} <= free and len({dest for *_, dest in planned}) == 2
    assert cache.counters()["taken"] == 2
    cache.take_snapshots([(a, 4, 19), (b, 0, 15), (c, 0, 8)])  # c's chunk ends on its boundary: a copy
    assert len(copies) == 1 and copies[0][0] == slots.held["c"]
    assert slots.num_snapshots == 3  # the step's two and c's
    assert cache.plan_snapshots([(b, 4, 11)]) == []  # b's 12 is kept already
    _invariant(slots)


def test_cadence_points_fill_what_the_boundary_and_branch_point_leave():
    """With an interval, a chunk also gets a snapshot at every multiple of the interval strictly inside it and
    before its snapshot boundary, at most SNAPSHOTS_PER_SEQUENCE in all: the boundary and branch point first,
    then the cadence points, spread over the chunk from its first where more pass. An interval is rounded up
    to whole blocks; 0 takes none."""
    from kvforge.attention.linear_state import SNAPSHOTS_PER_SEQUENCE
    from kvforge.engine.block_manager import BlockManager
    from kvforge.engine.state_prefix import StatePrefixCache

    assert SNAPSHOTS_PER_SEQUENCE == 4  # the cap the cases below count on
    slots = StateSlots(12)
    cache = StatePrefixCache(slots, BlockManager(num_blocks=64, block_size=4), [].extend, interval=15)
    assert cache.interval == 16
    seq = Sequence("a", _tokens(101, 60), GREEDY)  # snapshot boundary 100
    slots.acquire("a")
    offsets = [offset for _, offset, _ in cache.plan_snapshots([(seq, 0, 101)])]
    assert offsets == [p - 1 for p in (16, 48, 80, 100)]  # three of 16, 32, ..., 96, spread
    cache = StatePrefixCache(StateSlots(12), BlockManager(num_blocks=64, block_size=4), [].extend, interval=16)
    seq.state_branch_point = 40
    cache.slots.acquire("a")
    offsets = [offset for _, offset, _ in cache.plan_snapshots([(seq, 20, 60)])]  # tokens 20..80
    assert offsets == [p - 20 - 1 for p in (32, 40, 48, 64)]  # boundary 100 past the chunk; 80 is its end
    plain = StatePrefixCache(StateSlots(12), BlockManager(num_blocks=64, block_size=4), [].extend)
    plain.slots.acquire("a")
    assert [o for _, o, _ in plain.plan_snapshots([(seq, 20, 60)])] == [40 - 20 - 1]


def test_the_interval_flag_is_checked_before_anything_loads():
    import argparse

    from kvforge.config import EngineArgs
    from kvforge.errors import ConfigError

    with pytest.raises(ConfigError, match="--state-snapshot-interval must be >= 0"):
        EngineArgs(state_snapshot_interval=-1)
    with pytest.raises(ConfigError, match="--state-snapshot-interval must be an integer"):
        EngineArgs(state_snapshot_interval=2.5)
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--state-snapshot-interval", "0"])).state_snapshot_interval == 0
    assert EngineArgs.from_cli_args(parser.parse_args([])).state_snapshot_interval is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--state-snapshot-interval", "-8"])


def test_workers_apply_copies_in_rank_0s_order():
    """A restore that reads the snapshot the copy before it wrote (two calls on rank 0, one message to the
    other ranks): the operations apply as rank 0 applied them, one call after the other."""
    from kvforge.attention.linear_state import LinearStates
    from kvforge.distributed.runner import STATE_COPY, apply_state_ops

    conv = {0: torch.arange(4.0).reshape(4, 1, 1)}
    rec = {0: torch.arange(4.0).reshape(4, 1, 1, 1) * 10}
    states = LinearStates(conv, rec)
    apply_state_ops(states, [(STATE_COPY, 0, 1), (STATE_COPY, 1, 2), (STATE_COPY, 3, 0)])
    # In order: slot 1 <- 0, slot 2 <- 1 (now 0's), slot 0 <- 3.
    assert conv[0].flatten().tolist() == [3.0, 0.0, 0.0, 3.0]
    assert rec[0].flatten().tolist() == [30.0, 0.0, 0.0, 30.0]


# ---- through the engine ---------------------------------------------------------------------------------
@pytest.fixture
def model(tmp_path, request):
    """(transformers model, checkpoint path, greedy reference function, tolerance function) of ``case``."""
    hf, _ = make_checkpoint(request.param, tmp_path)

    def greedy(prompt, n=NEW_TOKENS):
        with torch.no_grad():
            ids = torch.tensor([prompt])  # the mask given: an answer may hold token 0, the pad id
            run = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True)
        return run.sequences[0, len(prompt):].tolist(), top2_margins(torch.cat(run.logits))

    def tolerance(prompts):
        with torch.no_grad():
            return 1e-4 * max(1.0, max(hf(torch.tensor([p])).logits.abs().max().item() for p in prompts))

    return request.param, tmp_path, greedy, tolerance


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine, prompts, params=GREEDY) -> list[list[int]]:
    """Submit ``prompts`` together, step to the end; their token lists in order."""
    ids = [f"r{engine.num_steps}-{k}" for k in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[rid] for rid in ids]


def _hits(engine) -> int:
    return engine.stats()["prefix_cache_hits"]


def _check(greedy, tol, prompts, outputs, what):
    for k, (p, got) in enumerate(zip(prompts, outputs)):
        want, margins = greedy(p, len(got))
        assert_greedy_agrees(got, want, margins, tol, what=f"{what} prompt {k}")


@pytest.mark.parametrize("model", CASES, indirect=True)
def test_follow_up_turns_resume_at_the_last_snapshot(model, engines):
    """A 30-token prompt leaves snapshots at 16 (its first chunk's end) and 28 (inside its second chunk). The
    next turn (prompt, answer, 5 new tokens) finds 8 full blocks cached but resumes at 28, the last block with
    a snapshot, and leaves one at 40; a second copy of the first prompt resumes at 28 too."""
    case, path, greedy, tolerance = model
    engine = engines(path).engine
    first = _tokens(30, 1)
    (answer,) = _run(engine, [first])
    assert engine.stats()["state_snapshots"] == {"kept": 2, "taken": 2, "restored": 0}
    follow_up = first + answer + _tokens(5, 2)
    again = list(first)
    before = _hits(engine)
    outs = _run(engine, [follow_up])
    assert _hits(engine) - before == 28
    outs += _run(engine, [again])
    assert _hits(engine) - before == 28 + 28
    counters = engine.stats()["state_snapshots"]
    assert counters == {"kept": 3, "taken": 3, "restored": 2}
    parsed = parse_prometheus(ServerMetrics("m").render(engine.stats(), in_flight=0).decode())
    assert parsed['kvforge:state_snapshots{model_name="m"}'] == 3
    assert parsed['kvforge:state_snapshots_taken_total{model_name="m"}'] == 3
    assert parsed['kvforge:state_snapshots_restored_total{model_name="m"}'] == 2
    prompts = [first, follow_up, again]
    _check(greedy, tolerance(prompts), prompts, [answer, *outs], f"{case} turns")
    assert engine.state_slots.num_free == engine.state_slots.num_slots


@pytest.mark.parametrize("model", CASES, indirect=True)
def test_a_shared_prefix_is_a_hit_from_the_third_request_on(model, engines):
    """One 22-token system prompt, three different messages after it, one request after another. The first
    leaves snapshots at 16 (a chunk's end) and 28, none where the messages part (20). The second finds five
    blocks cached (20 tokens) but resumes at 16; another cached request went on from 20 with other tokens,
    so 20 is its branch point: its chunk 16 -> 27 leaves snapshots at 20 and 24 inside the step. The third
    resumes at 20."""
    case, path, greedy, tolerance = model
    engine = engines(path).engine
    system = _tokens(22, 30)
    prompts = [system + _tokens(7, 31), system + _tokens(5, 32), system + _tokens(6, 33)]
    hits, outs = [], []
    for p in prompts:
        before = _hits(engine)
        outs += _run(engine, [p])
        hits.append(_hits(engine) - before)
    assert hits == [0, 16, 20]
    assert engine.stats()["state_snapshots"]["taken"] == 2 + 2 + 1  # the third: its own boundary at 24
    _check(greedy, tolerance(prompts), prompts, outs, f"{case} system prompt")


@pytest.mark.parametrize("model", CASES, indirect=True)
@pytest.mark.parametrize("interval", [8, 0])
def test_a_request_sharing_part_of_a_prompt_resumes_at_a_cadence_snapshot(model, engines, interval):
    """A 40-token prompt in chunks of 16 keeps its state at 16 and 32 (chunk ends) and 36 (its boundary),
    and with --state-snapshot-interval 8 also at 8 and 24 (inside its chunks). A second request sharing its
    first 30 tokens finds 28 tokens of blocks cached and resumes at the last with a snapshot: 24 with the
    interval, 16 without."""
    case, path, greedy, tolerance = model
    engine = engines(path, state_snapshot_interval=interval).engine
    shared = _tokens(30, 70)
    prompts = [shared + _tokens(10, 71), shared + _tokens(6, 72)]
    hits, outs = [], []
    for p in prompts:
        before = _hits(engine)
        outs += _run(engine, [p])
        hits.append(_hits(engine) - before)
    assert hits == [0, 24 if interval else 16]
    taken = engine.stats()["state_snapshots"]["taken"]
    assert taken == (5 if interval else 3) + 2  # the second: its branch point 28 and boundary 32
    _check(greedy, tolerance(prompts), prompts, outs, f"{case} interval {interval}")


def test_a_branch_point_needs_another_continuation_in_the_cache():
    """``has_other_continuation``: a prefix a cached request went on from with other tokens is a branch
    point; one it stopped at (a chat's previous turn), or went on from with the same tokens, is not; an
    evicted continuation no longer counts. The counts behind it stay consistent (``check_invariants``)."""
    from kvforge.engine.block_manager import BlockManager

    bm = BlockManager(num_blocks=6, block_size=4)

    def computed(tokens, rid):
        seq = Sequence(rid, tokens, GREEDY)
        assert bm.allocate(seq, len(tokens))
        seq.num_computed_tokens = len(tokens)
        bm.cache_full_blocks(seq)
        bm.free(seq)
        bm.check_invariants()

    prefix = list(range(3, 11))  # two blocks
    computed(prefix + [50, 51, 52, 53], "a")  # three blocks: went on from the prefix with 50..53
    assert bm.has_other_continuation(Sequence("b", prefix + [60, 61, 62, 63, 64]), 2)
    assert not bm.has_other_continuation(Sequence("c", prefix + [50, 51, 52, 53, 9]), 2)  # a's own tokens
    assert not bm.has_other_continuation(Sequence("d", prefix + [50, 51, 52, 53, 54, 55]), 3)  # a stopped at 3
    computed([70 + i for i in range(12)], "e")  # the last three never-used blocks
    computed([90 + i for i in range(4)], "f")  # evicts the least recently freed: a's third block
    assert not bm.has_other_continuation(Sequence("b", prefix + [60, 61, 62, 63, 64]), 2)
    bm.reset_prefix_cache()
    bm.check_invariants()


@pytest.mark.parametrize("model", CASES, indirect=True)
def test_snapshots_inside_a_chunk_cost_no_step(model, engines):
    """A 30-token prompt in chunks of 16 gets its first token in its second step (16 + 14 tokens), and keeps
    snapshots at 16 and 28, the one at 28 taken inside the second chunk; a second copy resumes at 28 and gets
    its first token in one step."""
    case, path, greedy, tolerance = model
    engine = engines(path).engine
    prompt = _tokens(30, 1)

    def steps_to_first_token(rid):
        engine.add_request(rid, prompt, GREEDY)
        for steps in range(1, 10):
            if any(o.request_id == rid and o.outputs[0].token_ids for o in engine.step()):
                return steps
        raise AssertionError("no first token in 9 steps")

    assert steps_to_first_token("a") == 2
    assert engine.stats()["state_snapshots"] == {"kept": 2, "taken": 2, "restored": 0}
    while engine.has_unfinished_requests():
        engine.step()
    before = _hits(engine)
    assert steps_to_first_token("b") == 1
    assert _hits(engine) - before == 28
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("model", CASES, indirect=True)
def test_prompts_admitted_together_share_one_snapshot(model, engines):
    """Two slots: after a 20-token prompt one holds its snapshot (at 16). Two prompts extending it arrive
    together: the first copies the snapshot into the empty slot, the second (no other slot left) takes the
    snapshot's own slot. Both resume at 16; neither can keep a snapshot of its own (both slots held)."""
    case, path, greedy, tolerance = model
    engine = engines(path, kv_cache_memory=TWO_SLOTS[case], max_model_len=64).engine
    assert engine.state_slots.num_slots == 2
    base = _tokens(20, 3)
    outs = _run(engine, [base])
    before = _hits(engine)
    pair = [base + _tokens(7, 4), base + _tokens(3, 5)]
    outs += _run(engine, pair)
    assert _hits(engine) - before == 16 + 16
    assert engine.stats()["state_snapshots"] == {"kept": 0, "taken": 1, "restored": 2}
    prompts = [base, *pair]
    _check(greedy, tolerance(prompts), prompts, outs, f"{case} shared")


@pytest.mark.parametrize("model", CASES, indirect=True)
def test_more_snapshots_in_a_step_than_free_slots(model, engines):
    """Three slots, two 7-token prompts together: both pass their snapshot boundary (4) in one step, whose one
    spare slot keeps one snapshot (the other is not taken); both prompts again resume, the one with a snapshot
    at 4 and the other computed whole, with transformers' tokens throughout."""
    case, path, greedy, tolerance = model
    engine = engines(path, kv_cache_memory=THREE_SLOTS[case], max_model_len=64).engine
    assert engine.state_slots.num_slots == 3
    prompts = [_tokens(7, 20), _tokens(7, 21)]
    outs = _run(engine, prompts)
    assert engine.stats()["state_snapshots"] == {"kept": 1, "taken": 1, "restored": 0}
    before = _hits(engine)
    outs += _run(engine, prompts)
    assert _hits(engine) - before == 4
    _check(greedy, tolerance(prompts), prompts * 2, outs, f"{case} crowded")


@pytest.mark.parametrize("model", CASES, indirect=True)
def test_an_evicted_snapshot_gives_no_hit(model, engines):
    """Two slots, two 14-token prompts one after another: while the second runs (holding one slot) its
    snapshot at 12 evicts the first's, the least recently used. The second prompt again resumes at 12; the
    first again finds its blocks cached but no snapshot: no hit, computed from a zero state, the same
    tokens."""
    case, path, greedy, tolerance = model
    engine = engines(path, kv_cache_memory=TWO_SLOTS[case], max_model_len=64).engine
    assert engine.state_slots.num_slots == 2
    prompts = [_tokens(14, 10 + k) for k in range(2)]
    outs = [_run(engine, [p])[0] for p in prompts]
    assert engine.stats()["state_snapshots"] == {"kept": 1, "taken": 2, "restored": 0}
    before = _hits(engine)
    again = _run(engine, [prompts[1]])
    assert _hits(engine) - before == 12
    probe = Sequence("probe", prompts[0], GREEDY)
    assert len(engine.block_manager.lookup_prefix(probe)) == 3  # its blocks are still cached
    again += _run(engine, [prompts[0]])
    assert _hits(engine) - before == 12
    _check(greedy, tolerance(prompts), prompts + prompts[::-1], outs + again, f"{case} evicted")


@pytest.mark.parametrize("model", CASES, indirect=True)
def test_hits_under_async_scheduling_and_speculation(model, engines):
    """A step in flight while the next is scheduled (snapshots and restores are stream-ordered with it), and
    n-gram proposals verified over restored states: still transformers' tokens, and the hits are taken."""
    case, path, greedy, tolerance = model
    base = _tokens(24, 6) * 2  # a repeated run: the n-gram proposer finds matches
    prompts = [base, base + _tokens(6, 7), base[:33]]
    tol = tolerance(prompts)
    for kw in (dict(async_scheduling=True),
               dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2})):
        engine = engines(path, **kw).engine
        outs = _run(engine, prompts[:1])
        outs += _run(engine, prompts[1:])
        assert _hits(engine) == 44 + 32, kw
        _check(greedy, tol, prompts, outs, f"{case} {kw}")
        engine.shutdown()


@pytest.mark.parametrize("model", CASES[:1], indirect=True)
def test_reset_prefix_cache_drops_the_snapshots_too(model, engines):
    """After ``reset_prefix_cache`` a prompt sent again finds neither blocks nor a snapshot, and the slots
    the snapshots held are free again."""
    case, path, greedy, tolerance = model
    engine = engines(path).engine
    prompt = _tokens(30, 1)
    (first,) = _run(engine, [prompt])
    assert engine.state_slots.num_snapshots > 0
    assert engine.reset_prefix_cache() is True
    assert engine.state_slots.num_snapshots == 0 and engine.state_slots.num_free == engine.state_slots.num_slots
    before = _hits(engine)
    assert _run(engine, [prompt]) == [first] and _hits(engine) == before

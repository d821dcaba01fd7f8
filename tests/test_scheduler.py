"""Scheduler (continuous batching, chunked prefill, preemption, prefix cache) and detokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge.engine.block_manager import BlockManager
from kvforge.engine.detokenizer import IncrementalDetokenizer, detokenize_incrementally
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.scheduler import Scheduler
from kvforge.engine.sequence import Sequence, SequenceStatus
from kvforge.errors import ConfigError, InvalidRequestError

VOCAB = 50


class FakeRunner:
    """Plays the model over a paged "KV cache" that stores token ids.

    Every step it checks that each scheduled sequence's context (positions
    before ``start_pos``) reads back its own tokens through its block table,
    writes the new tokens, and "samples" a token that depends only on the
    sequence's token history, so outputs must not depend on batching,
    chunking, prefix hits or preemption.
    """

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.kv: dict[int, int] = {}
        self.steps = 0

    def slot(self, seq, p):
        B = self.bm.block_size
        return seq.block_table[p // B] * B + p % B

    @staticmethod
    def next_token(tokens):
        return (sum(tokens[-3:]) * 7 + len(tokens)) % VOCAB

    def execute(self, out):
        B = self.bm.block_size
        for src, dst in out.blocks_to_copy:
            for o in range(B):
                if src * B + o in self.kv:
                    self.kv[dst * B + o] = self.kv[src * B + o]
        sampled = {}
        for s in out.scheduled:
            seq = s.seq
            toks = seq.all_token_ids
            assert s.start_pos == seq.num_computed_tokens
            assert s.token_ids == toks[s.start_pos : s.start_pos + s.num_new_tokens]
            assert len(seq.block_table) * B >= s.context_len
            for p in range(s.start_pos):
                assert self.kv.get(self.slot(seq, p)) == toks[p], (
                    f"{seq.request_id} context pos {p} corrupted"
                )
            for p in range(s.start_pos, s.context_len):
                self.kv[self.slot(seq, p)] = toks[p]
            assert s.do_sample == (s.context_len == seq.num_tokens)
            if s.do_sample:
                sampled[seq.request_id] = (self.next_token(toks), None)
        self.steps += 1
        return sampled


def run_all(sched: Scheduler, runner: FakeRunner, max_steps=10_000, on_step=None):
    finished = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        if on_step:
            on_step(out)
        for seq in sched.update(out, runner.execute(out)):
            finished[seq.request_id] = seq
    else:
        raise AssertionError("requests did not finish")
    return finished


def expected_output(prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(FakeRunner.next_token(toks))
    return toks[len(prompt) :]


def make_sched(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=128, **kw):
    bm = BlockManager(num_blocks, block_size, kw.pop("enable_prefix_caching", True))
    return Scheduler(bm, max_num_seqs, budget, max_model_len, **kw), bm


def prompt_of(i, n):
    return [(i * 13 + j * 5) % VOCAB for j in range(n)]


# ---- batching, budget, chunked prefill ----------------------------------------


def test_token_budget_and_decode_first():
    sched, bm = make_sched(budget=10)
    for i in range(4):
        sched.add(Sequence(f"r{i}", prompt_of(i, 6), SamplingParams(max_tokens=5, ignore_eos=True)))
    runner = FakeRunner(bm)
    seen_decode_first = []

    def check(out):
        kinds = [s.start_pos >= s.seq.num_prompt_tokens for s in out.scheduled]
        # decodes (running sequences) come before new prefills in the batch
        seen_decode_first.append(kinds == sorted(kinds, reverse=True))

    done = run_all(sched, runner, on_step=check)
    assert all(seen_decode_first)
    for i in range(4):
        assert done[f"r{i}"].output_token_ids == expected_output(prompt_of(i, 6), 5)
        assert done[f"r{i}"].finish_reason == "length"
    assert bm.num_used_blocks == 0


def test_chunked_prefill_splits_long_prompt():
    sched, bm = make_sched(budget=16, max_model_len=128)
    sched.add(Sequence("long", prompt_of(1, 50), SamplingParams(max_tokens=3, ignore_eos=True)))
    runner = FakeRunner(bm)
    steps = []
    done = run_all(
        sched,
        runner,
        on_step=lambda o: steps.append([(s.start_pos, s.num_new_tokens, s.do_sample) for s in o.scheduled]),
    )
    assert steps[:4] == [[(0, 16, False)], [(16, 16, False)], [(32, 16, False)], [(48, 2, True)]]
    assert steps[4:] == [[(50, 1, True)], [(51, 1, True)]]
    assert done["long"].output_token_ids == expected_output(prompt_of(1, 50), 3)


def test_chunked_prefill_shares_budget_with_decodes():
    sched, bm = make_sched(budget=8, max_model_len=128)
    sched.add(Sequence("a", prompt_of(1, 3), SamplingParams(max_tokens=20, ignore_eos=True)))
    runner = FakeRunner(bm)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    sched.add(Sequence("b", prompt_of(2, 30), SamplingParams(max_tokens=2, ignore_eos=True)))
    out = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    sched.update(out, runner.execute(out))
    done = run_all(sched, runner)
    assert done["b"].output_token_ids == expected_output(prompt_of(2, 30), 2)
    assert done["a"].output_token_ids == expected_output(prompt_of(1, 3), 20)


def test_without_chunked_prefill_prompts_are_scheduled_whole():
    sched, bm = make_sched(budget=64, max_model_len=64, enable_chunked_prefill=False)
    for i in range(3):
        sched.add(Sequence(f"r{i}", prompt_of(i, 30), SamplingParams(max_tokens=4, ignore_eos=True)))
    runner = FakeRunner(bm)
    sizes = []
    run_all(sched, runner, on_step=lambda o: sizes.extend(s.num_new_tokens for s in o.scheduled))
    assert set(sizes) <= {30, 1}
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        make_sched(budget=16, max_model_len=64, enable_chunked_prefill=False)


def test_max_num_seqs_limits_running():
    sched, bm = make_sched(max_num_seqs=2, budget=100)
    for i in range(5):
        sched.add(Sequence(f"r{i}", prompt_of(i, 4), SamplingParams(max_tokens=3, ignore_eos=True)))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and sched.num_waiting == 3
    runner = FakeRunner(bm)
    sched.update(out, runner.execute(out))
    done = run_all(sched, runner)
    assert len(done) == 5 and bm.num_used_blocks == 0


# ---- preemption ----------------------------------------------------------------


@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_under_tiny_cache_every_request_finishes_fully(prefix):
    sched, bm = make_sched(
        num_blocks=10, block_size=2, max_num_seqs=6, budget=12, max_model_len=64, enable_prefix_caching=prefix
    )
    prompts = {f"r{i}": prompt_of(i, 3 + i % 4) for i in range(6)}
    for rid, p in prompts.items():
        sched.add(Sequence(rid, p, SamplingParams(max_tokens=12, ignore_eos=True)))
    runner = FakeRunner(bm)
    preempted = []
    done = run_all(sched, runner, on_step=lambda o: preempted.extend(s.request_id for s in o.preempted))
    assert sched.num_preemptions > 0 and len(preempted) == sched.num_preemptions
    for rid, p in prompts.items():
        assert done[rid].output_token_ids == expected_output(p, 12), rid
        assert done[rid].finish_reason == "length"
    assert bm.num_used_blocks == 0
    bm.check_invariants([])


def test_preemption_picks_most_recent_arrival_and_requeues_at_front():
    # 6 blocks of 2: both 4-token prompts are admitted (2 blocks each, one block of growth each left), then
    # both grow until a needs a block while none is free.
    sched, bm = make_sched(
        num_blocks=6, block_size=2, max_num_seqs=4, budget=16, max_model_len=16, enable_prefix_caching=False
    )
    a = Sequence("a", [1, 2, 3, 0], SamplingParams(max_tokens=6, ignore_eos=True))
    b = Sequence("b", [4, 5, 6, 0], SamplingParams(max_tokens=6, ignore_eos=True))
    sched.add(a)
    sched.add(b)
    runner = FakeRunner(bm)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    while not out.preempted:
        sched.update(out, runner.execute(out))
        out = sched.schedule()
    # a, at 6 tokens, needs a 4th block for position 6 with all 6 blocks held -> b, the newest, is preempted
    assert [s.request_id for s in out.preempted] == ["b"]
    assert [s.request_id for s in out.scheduled] == ["a"] and a.num_tokens == 7 and a.num_output_tokens == 3
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.output_token_ids == expected_output([4, 5, 6, 0], 3)  # nothing lost
    assert sched.waiting[0] is b
    sched.update(out, runner.execute(out))
    done = run_all(sched, runner)
    assert done["b"].output_token_ids == expected_output([4, 5, 6, 0], 6)
    assert done["b"].num_preemptions >= 1


def test_admission_fills_the_pool_with_requests_that_cannot_grow():
    """12 blocks of 4, max_model_len 16: a sequence at its limit holds the KV of 15 tokens (4 blocks), so 3 fit.
    Three 15-token prompts whose one output token is their last need no room to grow: all three are admitted
    in the first step, as the plan's concurrency promises."""
    sched, bm = make_sched(num_blocks=12, block_size=4, budget=64, max_model_len=16, enable_prefix_caching=False)
    for i in range(3):
        sched.add(Sequence(f"r{i}", prompt_of(i, 15), SamplingParams(max_tokens=1, ignore_eos=True)))
    out = sched.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [15, 15, 15] and bm.num_free_blocks == 0


def test_admission_leaves_a_block_of_growth_for_each_running_request():
    """8 blocks of 4, 8-token prompts that grow to 16 tokens (4 blocks each): r0 and r1 take 2 blocks each; r2
    would need 2 + a block of growth beside one kept for each of them: 5 > 4 free, so it waits until one
    finishes, and nothing is ever preempted (admitted on its first chunk, r2 would be)."""
    sched, bm = make_sched(num_blocks=8, block_size=4, budget=64, max_model_len=32, enable_prefix_caching=False)
    prompts = {f"r{i}": prompt_of(i, 8) for i in range(3)}
    for rid, p in prompts.items():
        sched.add(Sequence(rid, p, SamplingParams(max_tokens=8, ignore_eos=True)))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"] and sched.num_waiting == 1
    done = run_all(sched, FakeRunner(bm))
    assert sched.num_preemptions == 0
    assert {rid: s.output_token_ids for rid, s in done.items()} == {rid: expected_output(p, 8)
                                                                     for rid, p in prompts.items()}


# ---- prefix cache -----------------------------------------------------------


def test_prefix_cache_hits_reduce_scheduled_prefill_tokens():
    sched, bm = make_sched(block_size=8, budget=64)
    shared = prompt_of(3, 40)
    sched.add(Sequence("first", shared, SamplingParams(max_tokens=2, ignore_eos=True)))
    runner = FakeRunner(bm)
    run_all(sched, runner)
    second = Sequence("second", shared + [7, 8], SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add(second)
    out = sched.schedule()
    (s,) = out.scheduled
    assert (s.start_pos, s.num_new_tokens) == (40, 2)
    assert second.num_cached_prompt_tokens == 40
    sched.update(out, runner.execute(out))
    # Identical prompt: the last block can't be a hit (the last token must be recomputed).
    third = Sequence("third", shared, SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add(third)
    out = sched.schedule()
    (s,) = [x for x in out.scheduled if x.request_id == "third"]
    assert (s.start_pos, s.num_new_tokens, s.do_sample) == (32, 8, True)
    sched.update(out, runner.execute(out))
    done = run_all(sched, runner)
    assert done["third"].output_token_ids == expected_output(shared, 2)
    assert bm.prefix_cache_hits == 40 + 32
    assert third.to_request_output().num_cached_tokens == 32
    assert bm.num_used_blocks == 0


# ---- finishing, aborts, rejection ------------------------------------------------


def test_abort_frees_blocks_running_and_waiting():
    sched, bm = make_sched(max_num_seqs=1)
    a = Sequence("a", prompt_of(1, 10), SamplingParams(max_tokens=50))
    b = Sequence("b", prompt_of(2, 10), SamplingParams(max_tokens=50))
    sched.add(a)
    sched.add(b)
    runner = FakeRunner(bm)
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    assert bm.num_used_blocks > 0
    assert sched.abort("a") is a
    assert a.finish_reason == "abort" and a.block_table == []
    assert sched.abort("b") is b and b.status == SequenceStatus.FINISHED_ABORTED
    assert sched.abort("b") is None and sched.abort("nope") is None
    assert bm.num_used_blocks == 0 and not sched.has_unfinished_requests()


def test_abort_between_schedule_and_update_is_skipped():
    sched, bm = make_sched()
    sched.add(Sequence("a", prompt_of(1, 5), SamplingParams(max_tokens=5)))
    runner = FakeRunner(bm)
    out = sched.schedule()
    sampled = runner.execute(out)
    sched.abort("a")
    assert sched.update(out, sampled) == []
    assert bm.num_used_blocks == 0


def test_over_long_prompt_rejected_with_clear_message():
    sched, bm = make_sched(max_model_len=16)
    with pytest.raises(InvalidRequestError, match="max_model_len=16") as ei:
        sched.add(Sequence("x", list(range(16)), SamplingParams()))
    assert ei.value.field == "prompt" and "16 tokens" in str(ei.value)
    sched.add(Sequence("ok", list(range(15)), SamplingParams(max_tokens=100, ignore_eos=True)))
    done = run_all(sched, FakeRunner(bm))
    assert done["ok"].num_tokens == 16 and done["ok"].finish_reason == "length"


def test_request_needing_more_blocks_than_exist_rejected():
    sched, bm = make_sched(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="only 4 blocks") as ei:
        sched.add(Sequence("x", list(range(10)), SamplingParams(max_tokens=20)))
    assert ei.value.field == "max_tokens"
    with pytest.raises(InvalidRequestError) as ei:
        sched.add(Sequence("y", list(range(20)), SamplingParams(max_tokens=1)))
    assert ei.value.field == "prompt"
    sched.add(Sequence("fits", list(range(10)), SamplingParams(max_tokens=7)))  # 16 tokens, 15 KV
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add(Sequence("fits", [1], SamplingParams()))
    with pytest.raises(InvalidRequestError, match="empty"):
        sched.add(Sequence("e", [], SamplingParams()))


def test_eos_stop_token_and_ignore_eos():
    sched, bm = make_sched(eos_token_ids=[FakeRunner.next_token([1, 2, 3])])
    sched.add(Sequence("eos", [1, 2, 3], SamplingParams(max_tokens=10)))
    sched.add(Sequence("ign", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    second = expected_output([4, 5], 2)[1]
    sched.add(Sequence("stoptok", [4, 5], SamplingParams(max_tokens=10, stop_token_ids=[second])))
    done = run_all(sched, FakeRunner(bm))
    assert done["eos"].output_token_ids == expected_output([1, 2, 3], 1)
    assert done["eos"].finish_reason == "stop" and done["eos"].stop_reason is None
    assert len(done["ign"].output_token_ids) == 3 and done["ign"].finish_reason == "length"
    assert done["stoptok"].output_token_ids == expected_output([4, 5], 2)
    assert done["stoptok"].stop_reason == second


# ---- detokenizer ------------------------------------------------------------------


class ByteTokenizer:
    """Token id = one UTF-8 byte (0..255); 256 = a special "<eos>" token."""

    EOS = 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        out, buf = [], bytearray()
        for i in ids:
            if i == self.EOS:
                if not skip_special_tokens:
                    out.append(buf.decode("utf-8", errors="replace"))
                    buf = bytearray()
                    out.append("<eos>")
                continue
            buf.append(i)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


def test_detokenizer_never_emits_partial_multibyte_char():
    tok = ByteTokenizer()
    text = "héllo, 世界 🙂!"
    d = IncrementalDetokenizer(tok, tok.encode("say: "))
    deltas = [d.add_tokens([t]) for t in tok.encode(text)]
    assert "".join(deltas) == text == d.text
    assert not any("\ufffd" in x for x in deltas)
    assert deltas[tok.encode(text).index(0xF0)] == ""  # first byte of the emoji: held back
    assert detokenize_incrementally(tok, [], tok.encode(text)) == text


def test_detokenizer_stop_string_spanning_tokens_is_cut():
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, [], stop=("END", "zz"))
    for t in tok.encode("abc EN"):
        d.add_tokens([t])
    assert d.stopped_on is None
    assert d.output_text(finished=False) == "abc "  # "EN" could start "END": withheld while streaming
    d.add_tokens(tok.encode("D and more"))
    assert d.stopped_on == "END" and d.text == "abc "
    assert d.add_tokens([65]) == ""


def test_detokenizer_stop_string_must_end_in_text_after_min_tokens():
    """With min_tokens (vLLM's rule) only a stop string that ends in text arriving after the first
    min_tokens output tokens counts: a short stop string lying wholly in earlier text is not matched,
    even while a longer stop string makes the search look back further."""
    tok = ByteTokenizer()
    d = IncrementalDetokenizer(tok, [], stop=("o", "xxxxxxxx"), min_tokens=6)
    for t in tok.encode(" hello"):
        d.add_tokens([t])
    assert d.stopped_on is None
    d.add_tokens(tok.encode(" "))
    assert d.stopped_on is None and d.text == " hello "
    for t in tok.encode("hello"):
        d.add_tokens([t])
    assert d.stopped_on == "o" and d.text == " hello hell"
    # Without min_tokens nothing changes: the first "o" stops the text.
    d = IncrementalDetokenizer(tok, [], stop=("o", "xxxxxxxx"))
    for t in tok.encode(" hello hello"):
        d.add_tokens([t])
    assert d.stopped_on == "o" and d.text == " hell"


def test_scheduler_stop_strings_and_text():
    tok = ByteTokenizer()
    target = tok.encode("Hi there.\nBye")

    class Scripted(FakeRunner):
        def execute(self, out):
            res = super().execute(out)
            for rid in res:
                seq = sched.requests[rid]
                res[rid] = (target[seq.num_output_tokens], None)
            return res

    sched, bm = make_sched(tokenizer=tok, eos_token_ids=[ByteTokenizer.EOS])
    sched.add(Sequence("s", tok.encode("Q:"), SamplingParams(max_tokens=50, stop=["\n"])))
    sched.add(Sequence("t", tok.encode("Q:"), SamplingParams(max_tokens=4)))
    done = run_all(sched, Scripted(bm))
    s = done["s"]
    assert s.finish_reason == "stop" and s.stop_reason == "\n"
    assert s.output_text == "Hi there."
    assert s.output_token_ids == tok.encode("Hi there.\n")
    out = s.to_request_output()
    assert out.finished and out.outputs[0].text == "Hi there." and out.outputs[0].finish_reason == "stop"
    assert done["t"].output_text == "Hi t" and done["t"].finish_reason == "length"
    assert bm.num_used_blocks == 0


def _scripted(target: list[int]):
    """A scheduler with the byte tokenizer and EOS, and a runner that samples ``target[i]`` as every
    request's ``i``-th output token."""
    sched, bm = make_sched(tokenizer=ByteTokenizer(), eos_token_ids=[ByteTokenizer.EOS])

    class Scripted(FakeRunner):
        def execute(self, out):
            res = super().execute(out)
            for rid in res:
                res[rid] = (target[sched.requests[rid].num_output_tokens], None)
            return res

    return sched, bm, Scripted(bm)


def test_the_token_that_stops_a_request_adds_no_text():
    """As in vLLM: a stop token id or an EOS (even one rendered with skip_special_tokens=False) ends the
    request and stays in its token ids, but its text is not returned; an ignored EOS is ordinary text."""
    tok = ByteTokenizer()
    target = tok.encode("Hi there.") + [ByteTokenizer.EOS] + tok.encode("more")
    sched, bm, runner = _scripted(target)
    sched.add(Sequence("stoptok", tok.encode("Q:"), SamplingParams(max_tokens=50, stop_token_ids=[ord(".")])))
    sched.add(Sequence("eos", tok.encode("Q:"), SamplingParams(max_tokens=50, skip_special_tokens=False)))
    sched.add(Sequence("ignored", tok.encode("Q:"), SamplingParams(max_tokens=11, ignore_eos=True,
                                                                   skip_special_tokens=False)))
    done = run_all(sched, runner)
    assert done["stoptok"].output_token_ids == tok.encode("Hi there.") and done["stoptok"].stop_reason == ord(".")
    assert done["stoptok"].output_text == "Hi there"
    assert done["eos"].output_token_ids == target[:10] and done["eos"].finish_reason == "stop"
    assert done["eos"].output_text == "Hi there."
    assert done["ignored"].output_text == "Hi there.<eos>m" and done["ignored"].finish_reason == "length"


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_tokens_text():
    """vLLM's include_stop_str_in_output: the text runs through the stop string (nothing after it), and a
    stop token id's or EOS's text is kept."""
    tok = ByteTokenizer()
    sched, bm, runner = _scripted(tok.encode("Hi there.\nBye") + [ByteTokenizer.EOS])
    keep = dict(max_tokens=50, include_stop_str_in_output=True)
    sched.add(Sequence("str", tok.encode("Q:"), SamplingParams(stop=["re.", "\n"], **keep)))
    sched.add(Sequence("tok", tok.encode("Q:"), SamplingParams(stop_token_ids=[ord(".")], **keep)))
    sched.add(Sequence("eos", tok.encode("Q:"), SamplingParams(skip_special_tokens=False, **keep)))
    done = run_all(sched, runner)
    assert done["str"].stop_reason == "re." and done["str"].output_text == "Hi there."
    assert done["tok"].stop_reason == ord(".") and done["tok"].output_text == "Hi there."
    assert done["eos"].finish_reason == "stop" and done["eos"].output_text == "Hi there.\nBye<eos>"
    assert bm.num_used_blocks == 0


def test_stop_strings_without_tokenizer_rejected():
    sched, _ = make_sched()
    with pytest.raises(InvalidRequestError) as ei:
        sched.add(Sequence("s", [1, 2], SamplingParams(stop=["x"])))
    assert ei.value.field == "stop"


# ---- randomized end-to-end -----------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(6, 24),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(4, 24),
    max_num_seqs=st.integers(1, 6),
    prefix=st.booleans(),
    chunked=st.booleans(),
    reqs=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 20), st.integers(1, 8), st.integers(0, 3)),
        min_size=1,
        max_size=8,
    ),
)
def test_random_workloads_finish_with_exact_outputs(
    num_blocks, block_size, budget, max_num_seqs, prefix, chunked, reqs
):
    max_model_len = 24
    if not chunked:
        budget = max(budget, max_model_len)
    bm = BlockManager(num_blocks, block_size, prefix)
    sched = Scheduler(bm, max_num_seqs, budget, max_model_len, enable_chunked_prefill=chunked)
    runner = FakeRunner(bm)
    expected = {}
    pending = []
    for k, (family, plen, max_tokens, arrive_step) in enumerate(reqs):
        prompt = prompt_of(family, plen)  # same family -> shared prefixes
        seq = Sequence(f"r{k}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        pending.append((arrive_step, seq))
        total = min(max_model_len, plen + max_tokens)
        expected[seq.request_id] = expected_output(prompt, total - plen)
    done = {}
    step = 0
    while pending or sched.has_unfinished_requests():
        for item in [p for p in pending if p[0] <= step]:
            pending.remove(item)
            try:
                sched.add(item[1])
            except InvalidRequestError:
                assert sched.max_blocks_needed(item[1]) > num_blocks
                expected.pop(item[1].request_id)
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        for seq in sched.update(out, runner.execute(out)):
            done[seq.request_id] = seq
        bm.check_invariants(sched.running)
        step += 1
        assert step < 2000, "no progress"
    assert {r: s.output_token_ids for r, s in done.items()} == expected
    assert bm.num_used_blocks == 0

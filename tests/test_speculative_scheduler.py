"""The scheduler with proposals, over a fake model whose "KV cache" stores token ids.

The fake model's next token is a fixed function of the history (tests/test_scheduler.py), so the
reference output of every request is known. Proposals are right or wrong at random; verification is
greedy (accept while the proposal equals the model's token). Every step the fake model reads each
sequence's context back through its block table: KV left by a rejected proposal at a position the
sequence has computed would show up there. Checked after every step: the block manager's invariants,
that a decoding sequence holds exactly the blocks of its computed tokens, and at the end that every
output equals the reference and every block is free.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import VOCAB, FakeRunner, expected_output, make_sched, prompt_of

from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.sequence import Sequence


class VerifyingRunner(FakeRunner):
    def execute(self, out):
        B = self.bm.block_size
        sampled = {}
        for s in out.scheduled:
            seq = s.seq
            toks = seq.all_token_ids
            spec = list(s.spec_token_ids)
            real = s.num_new_tokens - len(spec)
            assert s.start_pos == seq.num_computed_tokens
            assert s.token_ids == toks[s.start_pos:s.start_pos + real] + spec
            assert len(seq.block_table) * B >= s.context_len
            for p in range(s.start_pos):
                assert self.kv.get(self.slot(seq, p)) == toks[p], f"{seq.request_id} context pos {p} corrupted"
            for p, t in zip(range(s.start_pos, s.context_len), s.token_ids):
                self.kv[self.slot(seq, p)] = t
            if s.do_sample:
                history = toks[:s.start_pos + real]
                emitted = []
                for d in spec:
                    t = self.next_token(history)
                    if d != t:
                        break
                    emitted.append(d)
                    history.append(d)
                emitted.append(self.next_token(history))
                sampled[seq.request_id] = [(t, None) for t in emitted]
        return sampled


def propose(sched, k: int, rng: random.Random, p_right: float) -> None:
    """The engine's _propose, with proposals that follow the model with probability p_right per token."""
    for seq in sched.running:
        if seq.num_tokens - seq.num_computed_tokens != 1:
            continue
        history, props = list(seq.all_token_ids), []
        for _ in range(rng.randint(0, k)):
            t = FakeRunner.next_token(history) if rng.random() < p_right else rng.randrange(VOCAB)
            props.append(t)
            history.append(t)
        seq.spec_token_ids = props


def run(sched, bm, k, seed, p_right):
    runner, rng, finished = VerifyingRunner(bm), random.Random(seed), {}
    for _ in range(10_000):
        if not sched.has_unfinished_requests():
            break
        propose(sched, k, rng, p_right)
        out = sched.schedule()
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled) <= sched.max_num_batched_tokens
        for seq in sched.update(out, runner.execute(out)):
            finished[seq.request_id] = seq
        bm.check_invariants(list(sched.running) + list(sched.waiting))
        for seq in sched.running:
            if seq.num_tokens - seq.num_computed_tokens == 1:
                assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens), seq
    else:
        raise AssertionError("requests did not finish")
    return finished


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(17, 40), block_size=st.sampled_from([2, 4, 8]), budget=st.integers(8, 40),
       k=st.integers(1, 6), seed=st.integers(0, 1000), p_right=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
       caching=st.booleans())
def test_outputs_and_blocks_exact_under_speculation(num_blocks, block_size, budget, k, seed, p_right, caching):
    sched, bm = make_sched(num_blocks=num_blocks, block_size=block_size, budget=budget, max_num_seqs=4,
                           max_model_len=48, enable_prefix_caching=caching)
    rng = random.Random(seed)
    specs = []
    for i in range(5):
        n, m = rng.randint(1, 14), rng.randint(1, 20)
        prompt = prompt_of(i % 3, n)  # shared prefixes: prefix-cache hits on blocks computed under speculation
        specs.append((prompt, m))
        sched.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=m, ignore_eos=True)))
    done = run(sched, bm, k, seed, p_right)
    for i, (prompt, m) in enumerate(specs):
        assert done[f"r{i}"].output_token_ids == expected_output(prompt, m), f"r{i}"
    assert bm.num_used_blocks == 0


def test_right_proposals_save_steps_and_wrong_ones_cost_none():
    for p_right, check in ((1.0, lambda steps: steps <= 6), (0.0, lambda steps: steps == 1 + 19)):
        sched, bm = make_sched(block_size=4)
        sched.add(Sequence("r", prompt_of(1, 10), SamplingParams(max_tokens=20, ignore_eos=True)))
        runner, steps = VerifyingRunner(bm), 0
        while sched.has_unfinished_requests():
            for seq in sched.running:
                if seq.num_tokens - seq.num_computed_tokens == 1:
                    history, props = list(seq.all_token_ids), []
                    for _ in range(4):
                        props.append(FakeRunner.next_token(history) if p_right else
                                     (FakeRunner.next_token(history) + 1) % VOCAB)
                        history.append(props[-1])
                    seq.spec_token_ids = props
            out = sched.schedule()
            done = sched.update(out, runner.execute(out))
            steps += 1
        assert done[0].output_token_ids == expected_output(prompt_of(1, 10), 20)
        assert check(steps), (p_right, steps)


def test_proposals_never_preempt_a_request():
    # Two decoding requests fill the pool; the older one's proposals would need a new block. It verifies
    # none this step instead of preempting the younger one.
    sched, bm = make_sched(num_blocks=6, block_size=4, budget=32)
    for i in range(2):
        sched.add(Sequence(f"r{i}", prompt_of(i, 7), SamplingParams(max_tokens=8, ignore_eos=True)))
    runner = VerifyingRunner(bm)
    for _ in range(3):  # both prefills (2 blocks each), then two decodes: the second takes a third block each
        out = sched.schedule()
        sched.update(out, runner.execute(out))
    assert bm.num_free_blocks == 0 and all(s.num_computed_tokens == 9 for s in sched.running)
    older = min(sched.running, key=lambda s: s.arrival)
    older.spec_token_ids = [FakeRunner.next_token(older.all_token_ids), 1, 2]
    out = sched.schedule()
    assert not out.preempted
    assert [len(s.spec_token_ids) for s in out.scheduled] == [0, 0]

"""Scheduler + block manager over KV-cache groups (full and sliding-window) sharing one pool.

A fake model stores token ids in a per-group paged "KV cache" and checks, every
step, that each sequence reads its own tokens through each group's block table
at every position its queries can see (all earlier positions for a full group,
the window for a sliding group). The plan's capacity figures are checked
against what this scheduler admits: the planned concurrency at max-model-len
runs with no preemption, one more sequence preempts.
"""

from __future__ import annotations

import random

import pytest

from kvforge.engine.block_manager import BlockManager
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.scheduler import Scheduler
from kvforge.engine.sequence import Sequence
from kvforge.planner.groups import sliding_window_blocks
from kvforge.planner.inputs import CacheConfig
from kvforge.planner.resolver import resolve
from kvforge.spec.architectures import spec_from_hf_config
from kvforge.spec.presets import PRESETS

VOCAB = 50


def next_token(tokens):
    return (sum(tokens[-3:]) * 7 + len(tokens)) % VOCAB


def expected_output(prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


class GroupedFakeRunner:
    """Plays the model: ``kv[(group, slot)] = token``; checks every group's visible context (``check``;
    without it only counts the blocks in use)."""

    def __init__(self, bm: BlockManager, check: bool = True):
        self.bm = bm
        self.check = check
        self.kv: dict[tuple[int, int], int] = {}
        self.peak_used = 0

    def slot(self, seq, g, p):
        B = self.bm.block_size
        assert p // B >= seq.num_skipped_blocks[g], f"{seq.request_id}: group {g} position {p} was freed"
        return seq.block_tables[g][p // B] * B + p % B

    def execute(self, out):
        B = self.bm.block_size
        self.peak_used = max(self.peak_used, self.bm.num_used_blocks)
        for src, dst in out.blocks_to_copy:
            for (g, slot), tok in list(self.kv.items()):
                if slot // B == src:
                    self.kv[(g, dst * B + slot % B)] = tok
        sampled = {}
        for s in out.scheduled:
            seq = s.seq
            toks = seq.all_token_ids
            if s.do_sample:
                sampled[seq.request_id] = (next_token(toks), None)
            if not self.check:
                continue
            for g, w in enumerate(self.bm.group_windows):
                first = 0 if w is None else max(0, s.start_pos - w + 1)
                for p in range(first, s.start_pos):
                    assert self.kv.get((g, self.slot(seq, g, p))) == toks[p], (seq.request_id, g, p)
                for p in range(s.start_pos, s.context_len):
                    assert self.bm.ref_count(seq.block_tables[g][p // B]) == 1
                    self.kv[(g, self.slot(seq, g, p))] = toks[p]
        return sampled


def run_all(sched: Scheduler, runner: GroupedFakeRunner, max_steps=20_000):
    finished = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for seq in sched.update(out, runner.execute(out)):
            finished[seq.request_id] = seq
    else:
        raise AssertionError("requests did not finish")
    return finished


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_outputs_independent_of_batching_windows_and_prefix_hits(seed):
    """Chunked prefill across window edges, preemption under a small pool, prefix hits that share prompts."""
    rng = random.Random(seed)
    B = rng.choice([2, 4])
    windows = rng.choice([(None, 6), (8, None, 5), (None, 4, None), (7,)])
    bm = BlockManager(rng.randint(48, 90), B, True, group_windows=windows)
    sched = Scheduler(bm, max_num_seqs=rng.randint(2, 6), max_num_batched_tokens=rng.choice([5, 9, 16]),
                      max_model_len=64)
    runner = GroupedFakeRunner(bm)
    stems = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    want = {}
    for i in range(14):
        prompt = rng.choice(stems) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
        n = rng.randint(1, 20)
        sched.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
        want[f"r{i}"] = expected_output(prompt, n)
    done = run_all(sched, runner)
    assert {k: v.output_token_ids for k, v in done.items()} == want
    bm.check_invariants([])
    assert bm.num_used_blocks == 0
    if bm.group_windows != (None,):
        assert bm.prefix_cache_hits > 0


def test_prefix_hit_on_a_sliding_group_skips_blocks_before_the_window():
    B, w = 4, 6
    bm = BlockManager(64, B, True, group_windows=(None, w))
    sched = Scheduler(bm, 4, 64, 128)
    runner = GroupedFakeRunner(bm)
    stem = list(range(30))
    sched.add(Sequence("a", stem + [40], SamplingParams(max_tokens=3, ignore_eos=True)))
    run_all(sched, runner)
    b = Sequence("b", stem + [41, 42], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add(b)
    out = sched.schedule()
    assert b.num_computed_tokens == 28 == out.scheduled[0].start_pos  # 7 cached blocks of 4
    assert b.num_skipped_blocks == [0, (28 - w + 1) // B]
    sched.update(out, runner.execute(out))
    done = run_all(sched, runner)
    assert done["b"].output_token_ids == expected_output(stem + [41, 42], 3)


def test_eviction_keeps_a_finished_prompts_head_in_every_group():
    """A sliding group frees a long prompt's early blocks while it runs; once the request finishes they are
    evicted no sooner than the full group's blocks at the same positions (the cache keeps a prefix of
    positions in every group), so a later request sharing only the prompt's head still hits after
    evictions. Block size 4, window 6: a hit of 3 blocks needs the full group's blocks 0-2 and the sliding
    group's 1-2."""
    B, w = 4, 6
    bm = BlockManager(24, B, True, group_windows=(None, w))  # room for all of a's blocks: nothing evicted yet
    sched = Scheduler(bm, 4, 8, 64)  # 8-token chunks: the sliding group frees blocks during the prefill
    runner = GroupedFakeRunner(bm)
    stem = list(range(1, 41))
    sched.add(Sequence("a", stem, SamplingParams(max_tokens=1, ignore_eos=True)))
    run_all(sched, runner)
    assert bm.num_evictions == 0
    never_used = bm.num_free_blocks - bm.num_cached_blocks
    evict = 4  # the two highest positions of both groups
    filler = Sequence("filler", [45] * (B * -(-(never_used + evict) // 2)), SamplingParams(max_tokens=1))
    assert bm.allocate(filler, cached_blocks=bm.no_hit())
    assert bm.num_evictions >= evict
    b = Sequence("b", stem[:12] + [44, 43], SamplingParams(max_tokens=1))
    hit = bm.lookup_prefix(b)
    assert len(hit) == 3 and hit.skipped == (0, (12 - w + 1) // B)
    bm.free(filler)
    bm.check_invariants([])


def _scaled_preset(name: str, layers: int) -> dict:
    cfg = dict(PRESETS[name])
    cfg["num_hidden_layers"] = layers
    return cfg


def _fill(plan, num_seqs: int, prompt_len: int, max_model_len: int | None = None):
    """Run ``num_seqs`` sequences of ``prompt_len`` tokens to ``max_model_len`` (the plan's by default) in a
    scheduler over the plan's blocks and groups; returns (preemptions, peak used blocks, block manager)."""
    windows = tuple(g.sliding_window for g in plan.groups if g.kind in ("full", "sliding"))
    bm = BlockManager(plan.num_blocks, plan.block_size, False, group_windows=windows)
    L = max_model_len or plan.max_model_len
    sched = Scheduler(bm, max_num_seqs=num_seqs, max_num_batched_tokens=256, max_model_len=L)
    for i in range(num_seqs):
        prompt = [(i * 7 + j) % VOCAB for j in range(prompt_len)]
        sched.add(Sequence(f"s{i}", prompt, SamplingParams(max_tokens=L - prompt_len, ignore_eos=True)))
    runner = GroupedFakeRunner(bm, check=False)
    done = run_all(sched, runner)
    assert all(len(s.all_token_ids) == L for s in done.values())
    return sched.num_preemptions, runner.peak_used, bm


# (preset, layers kept, max model len, KV memory in units of one sequence at max-model-len)
CAPACITY_CASES = [("gpt-oss-20b", 4, 512, 5.5), ("gemma-3-27b", 12, 2048, 3.4)]


@pytest.mark.parametrize("name,layers,max_len,seqs", CAPACITY_CASES)
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_planned_concurrency_at_max_model_len_is_what_the_scheduler_holds(name, layers, max_len, seqs, kv_dtype):
    spec = spec_from_hf_config(_scaled_preset(name, layers), name=name, source="test")
    probe = resolve(spec, CacheConfig(kv_cache_dtype=kv_dtype, max_model_len=max_len, kv_cache_memory=10**9))
    per_seq_bytes = 10**9 / probe.max_concurrency
    plan = resolve(spec, CacheConfig(kv_cache_dtype=kv_dtype, max_model_len=max_len,
                                     kv_cache_memory=int(seqs * per_seq_bytes)))
    B = plan.block_size
    full = [g for g in plan.groups if g.kind == "full"]
    sliding = [g for g in plan.groups if g.kind == "sliding"]
    assert full and sliding and all(g.sliding_window < max_len for g in sliding)
    # The window's blocks per sequence, in bytes, are the plan's state bytes (no state layers here).
    block_id_bytes = plan.group_size * plan.groups[0].page_bytes
    window_blocks = sum(sliding_window_blocks(g.sliding_window, B) for g in sliding)
    assert plan.state_bytes_per_sequence == window_blocks * block_id_bytes
    per_seq_blocks = len(full) * (max_len // B) + window_blocks
    n = int(plan.max_concurrency)
    assert n == int(seqs)
    preempted, peak, _ = _fill(plan, n, prompt_len=max_len // 4)
    assert preempted == 0
    # Every sequence at its last step: max-model-len in the full groups, a window not aligned to a block
    # edge (max_model_len and the windows are multiples of the block size) in the sliding groups.
    assert peak == n * per_seq_blocks <= plan.num_blocks < (n + 1) * per_seq_blocks
    preempted, _, _ = _fill(plan, n + 1, prompt_len=max_len // 4)
    assert preempted > 0


def _most_tokens(num_blocks: int, B: int, full_groups: int, window_blocks: int, max_len: int, max_seqs: int):
    """The reference for ``capacity_tokens``: every sequence count k, and for each the best split of the block
    ids left per full group among k sequences of at most ``max_len`` tokens, by dynamic programming over the
    sequences (a sequence of b blocks holds min(b * B, max_len) tokens). Returns (tokens, lengths)."""
    per_seq = -(-max_len // B)
    best = (0, [])
    for k in range(1, max_seqs + 1):
        blocks = (num_blocks - k * window_blocks) // full_groups
        if blocks < 0:
            break
        # table[m]: (most tokens, lengths) of the sequences so far within m blocks
        table = [(0, [])] * (blocks + 1)
        for _ in range(k):
            table = [max(((table[m - b][0] + min(b * B, max_len), table[m - b][1] + [min(b * B, max_len)])
                          for b in range(0, min(per_seq, m) + 1)), key=lambda t: t[0]) for m in range(blocks + 1)]
        if table[blocks][0] > best[0]:
            best = (table[blocks][0], [n for n in table[blocks][1] if n])
    return best


# (preset, layers kept, max model len, KV memory in units of one sequence at max-model-len); 520 is no whole
# number of blocks
TOKEN_CASES = [*CAPACITY_CASES, ("gpt-oss-20b", 4, 520, 4.7), ("gemma-3-27b", 12, 2048, 2.9995)]


@pytest.mark.parametrize("name,layers,max_len,seqs", TOKEN_CASES)
def test_capacity_tokens_is_the_most_the_full_groups_hold_beside_the_windows(name, layers, max_len, seqs):
    """``capacity_tokens`` is the most any number of sequences of at most max-model-len hold in the full groups,
    each beside its whole window (an independent search over the sequence counts and block splits), and the
    scheduler holds sequences of those lengths at once, reaching their last step together, with no preemption
    and every block the figure counts in use."""
    spec = spec_from_hf_config(_scaled_preset(name, layers), name=name, source="test")
    probe = resolve(spec, CacheConfig(max_model_len=max_len, kv_cache_memory=10**9))
    plan = resolve(spec, CacheConfig(max_model_len=max_len, kv_cache_memory=int(seqs * 10**9 / probe.max_concurrency)))
    B = plan.block_size
    windows = tuple(g.sliding_window for g in plan.groups if g.kind in ("full", "sliding"))
    full_groups = sum(1 for g in plan.groups if g.kind == "full")
    window_blocks = sum(sliding_window_blocks(w, B) for w in windows if w is not None)
    tokens, lengths = _most_tokens(plan.num_blocks, B, full_groups, window_blocks, max_len, 64)
    assert plan.capacity_tokens == tokens and plan.capacity_sequences == len(lengths)
    assert all(n >= w for n in lengths for w in windows if w is not None)  # each holds its whole window
    decode = min(lengths) // 2
    bm = BlockManager(plan.num_blocks, B, False, group_windows=windows)
    sched = Scheduler(bm, len(lengths), sum(lengths) + 1, max_len)
    for i, n in enumerate(lengths):
        prompt = [(i * 5 + j) % VOCAB for j in range(n - decode)]
        sched.add(Sequence(f"s{i}", prompt, SamplingParams(max_tokens=decode, ignore_eos=True)))
    runner = GroupedFakeRunner(bm, check=False)
    done = run_all(sched, runner)
    assert sched.num_preemptions == 0 and sorted(len(s.all_token_ids) for s in done.values()) == sorted(lengths)
    assert runner.peak_used == sum(full_groups * -(-n // B) + window_blocks for n in lengths) <= plan.num_blocks


@pytest.mark.parametrize("name,layers,max_len", [("gpt-oss-20b", 4, 520), ("gemma-3-27b", 12, 2048),
                                                 ("qwen3-next-80b-a3b", 8, 1024)])
def test_more_memory_never_shows_fewer_tokens_or_a_rounded_up_concurrency(name, layers, max_len):
    """Across three whole-sequence steps of memory, in steps of a tenth of a block, the token figure never
    falls and the concurrency shown is never above what fits."""
    from kvforge.planner.kv_plan import format_concurrency

    spec = spec_from_hf_config(_scaled_preset(name, layers), name=name, source="test")
    probe = resolve(spec, CacheConfig(max_model_len=max_len, kv_cache_memory=10**9))
    per_seq = probe.capacity.bytes_per_sequence
    step = max(1, per_seq // (10 * -(-max_len // probe.block_size)))
    last = 0
    for memory in range(int(2.5 * per_seq), int(5.5 * per_seq), step):
        plan = resolve(spec, CacheConfig(max_model_len=max_len, kv_cache_memory=memory))
        assert plan.capacity_tokens >= last, f"{memory} bytes: {plan.capacity_tokens} tokens after {last}"
        last = plan.capacity_tokens
        assert plan.max_concurrency <= memory / per_seq
        assert float(format_concurrency(plan.max_concurrency)) <= memory / per_seq


@pytest.mark.parametrize("name,layers,max_len", [(c[0], c[1], c[2]) for c in CAPACITY_CASES])
def test_fp8_gain_against_the_model_dtype_baseline(name, layers, max_len):
    """Sliding windows are quantized like the full layers, so every per-sequence byte halves: the fp8 gain in
    concurrency is exactly the ratio of the two per-sequence byte counts, which is 2 here."""
    spec = spec_from_hf_config(_scaled_preset(name, layers), name=name, source="test")
    mem = 10**9
    p8 = resolve(spec, CacheConfig(kv_cache_dtype="fp8", max_model_len=max_len, kv_cache_memory=mem))
    p16 = resolve(spec, CacheConfig(kv_cache_dtype="auto", max_model_len=max_len, kv_cache_memory=mem))
    assert p8.baseline == p16.capacity

    def per_seq(p):
        page = p.groups[0].page_bytes
        full = sum(max_len // p.block_size for g in p.groups if g.kind == "full")
        window = sum(sliding_window_blocks(g.sliding_window, p.block_size) for g in p.groups if g.kind == "sliding")
        return (full + window) * p.group_size * page

    assert p8.max_concurrency == pytest.approx(mem / per_seq(p8), abs=1e-4)
    assert p16.max_concurrency == pytest.approx(mem / per_seq(p16), abs=1e-4)
    assert per_seq(p16) == 2 * per_seq(p8)

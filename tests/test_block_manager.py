"""BlockManager: ref counts, prefix cache, LRU eviction, copy-on-write, no leaks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvforge.engine.block_manager import BlockManager, NoFreeBlocksError, block_hash
from kvforge.engine.sequence import Sequence


def make_seq(rid, tokens):
    return Sequence(rid, list(tokens))


def compute(bm: BlockManager, seq: Sequence, n: int):
    """What a step does: the tokens' KV is written, then full blocks are registered."""
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


# ---- unit tests ---------------------------------------------------------------


def test_allocate_and_free_counts():
    bm = BlockManager(10, 4)
    s = make_seq("a", range(10))
    assert bm.can_allocate(s)
    assert bm.allocate(s)
    assert len(s.block_table) == 3
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 7
    assert all(bm.ref_count(b) == 1 for b in s.block_table)
    bm.free(s)
    assert s.block_table == []
    assert bm.num_used_blocks == 0
    bm.check_invariants([])


def test_allocate_fails_atomically_and_strict_append_raises():
    bm = BlockManager(2, 4)
    s = make_seq("a", range(9))  # needs 3 blocks
    assert not bm.can_allocate(s)
    assert not bm.allocate(s)
    assert s.block_table == [] and bm.num_used_blocks == 0
    t = make_seq("b", range(8))
    assert bm.allocate(t)
    compute(bm, t, 8)
    t.output_token_ids.append(1)
    assert not bm.append_slots(t, 1)
    assert len(t.block_table) == 2
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots(t, 1, strict=True)
    bm.check_invariants([t])


def test_append_slots_grows_only_at_block_boundaries():
    bm = BlockManager(8, 4)
    s = make_seq("a", range(3))
    assert bm.allocate(s)
    compute(bm, s, 3)
    assert len(s.block_table) == 1
    for i in range(6):
        s.output_token_ids.append(100 + i)
        assert bm.append_slots(s, 1)
        assert len(s.block_table) == bm.blocks_needed(s.num_computed_tokens + 1)
        compute(bm, s, 1)
    assert len(s.block_table) == 3  # 9 tokens computed


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    bm = BlockManager(16, 4)
    a = make_seq("a", range(10))
    assert bm.allocate(a)
    compute(bm, a, 10)  # blocks 0,1 full -> registered; block 2 partial
    assert bm.prefix_cache_queries == 10 and bm.prefix_cache_hits == 0
    b = make_seq("b", list(range(8)) + [50, 51, 52])
    hits = bm.lookup_prefix(b)
    assert hits.blocks == a.block_table[:2]
    assert bm.allocate(b)
    assert b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert all(bm.ref_count(x) == 2 for x in a.block_table[:2])
    assert bm.prefix_cache_queries == 21 and bm.prefix_cache_hits == 8
    bm.check_invariants([a, b])


def test_prefix_hit_never_covers_whole_prompt():
    bm = BlockManager(16, 4)
    a = make_seq("a", range(8))
    assert bm.allocate(a)
    compute(bm, a, 8)
    b = make_seq("b", range(8))  # identical, exactly two full blocks
    assert len(bm.lookup_prefix(b)) == 1  # the last token must be recomputed
    assert bm.allocate(b)
    assert b.num_computed_tokens == 4
    c = make_seq("c", range(9))
    assert len(bm.lookup_prefix(c)) == 2


def test_prefix_chain_depends_on_all_previous_blocks():
    bm = BlockManager(16, 2)
    a = make_seq("a", [1, 2, 3, 4, 5])
    assert bm.allocate(a)
    compute(bm, a, 5)
    b = make_seq("b", [9, 9, 3, 4, 5])  # same second block, different first
    assert bm.lookup_prefix(b).blocks == []
    assert block_hash(None, [1, 2]) != block_hash(None, [9, 9])
    assert block_hash(block_hash(None, [1, 2]), [3, 4]) != block_hash(block_hash(None, [9, 9]), [3, 4])


def test_freed_cached_blocks_survive_until_never_used_run_out_then_lru():
    bm = BlockManager(6, 2)
    a = make_seq("a", [1, 2, 3, 4, 5])  # 3 blocks, 2 full
    assert bm.allocate(a)
    compute(bm, a, 5)
    b = make_seq("b", [7, 8, 9])  # 2 blocks, 1 full
    assert bm.allocate(b)
    compute(bm, b, 3)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.num_used_blocks == 0
    assert bm.num_cached_blocks == 3  # [1,2], [3,4], [7,8]
    # 3 never-used free blocks (one never touched + the two partial ones) go first.
    c = make_seq("c", [20, 21, 22, 23, 24, 25])
    assert bm.allocate(c)
    assert not set(c.block_table) & {a_blocks[0], a_blocks[1], b_blocks[0]}
    assert bm.num_cached_blocks == 3 and bm.num_evictions == 0
    # Next allocation must evict: LRU order is the free order, tail first -> a's
    # second block, then a's first, then b's first block.
    d = make_seq("d", [30, 31])
    assert bm.allocate(d)
    assert d.block_table == [a_blocks[1]]
    assert bm.num_evictions == 1
    # a's first block is still a hit.
    e = make_seq("e", [1, 2, 3])
    assert bm.lookup_prefix(e).blocks == [a_blocks[0]]
    bm.check_invariants([c, d])


def test_hit_on_cached_free_block_revives_it():
    bm = BlockManager(3, 2)
    a = make_seq("a", [1, 2, 3, 4, 5])
    assert bm.allocate(a)
    compute(bm, a, 5)
    bm.free(a)
    b = make_seq("b", [1, 2, 3, 4, 6])
    assert bm.can_allocate(b)
    assert bm.allocate(b)
    assert b.num_computed_tokens == 4
    assert bm.num_free_blocks == 0
    bm.check_invariants([b])


def test_fork_shares_and_copy_on_write():
    bm = BlockManager(8, 4)
    p = make_seq("p", range(6))
    assert bm.allocate(p)
    compute(bm, p, 6)
    p.output_token_ids.append(99)
    c = p.fork("c")
    bm.fork(p, c)
    assert c.block_table == p.block_table
    assert all(bm.ref_count(b) == 2 for b in p.block_table)
    bm.check_invariants([p, c])
    # Writing token 6 goes into the shared, partial second block -> copy it first.
    shared_last = p.block_table[1]
    assert bm.append_slots(c, 1)
    assert c.block_table[0] == p.block_table[0]
    assert c.block_table[1] != shared_last
    assert bm.take_copies() == [(shared_last, c.block_table[1])]
    assert bm.take_copies() == []
    assert bm.ref_count(shared_last) == 1
    bm.check_invariants([p, c])
    bm.free(p)
    bm.free(c)
    assert bm.num_used_blocks == 0


def test_prefix_caching_disabled():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    a = make_seq("a", [1, 2, 3, 4, 5])
    assert bm.allocate(a)
    compute(bm, a, 5)
    b = make_seq("b", [1, 2, 3, 4, 5])
    assert bm.lookup_prefix(b).blocks == []
    assert bm.num_cached_blocks == 0
    bm.free(a)
    assert bm.num_used_blocks == 0


def test_double_free_detected():
    bm = BlockManager(4, 2)
    a = make_seq("a", [1, 2, 3])
    assert bm.allocate(a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(a)


# ---- stateful property test --------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / step / sample / fork / free / re-allocate (prefix reuse, eviction).

    A simulated KV cache (``kv[block][offset] = token``) plays the model: each
    step writes its tokens' "KV" into the slots the block manager handed out.
    The invariant that every live sequence reads back exactly its own computed
    tokens catches wrong prefix hits, writes into shared blocks, blocks freed
    or evicted while in use, and double allocation.
    """

    @initialize(
        num_blocks=st.integers(2, 14),
        block_size=st.integers(1, 4),
        prefix=st.booleans(),
        vocab=st.integers(1, 3),
    )
    def setup(self, num_blocks, block_size, prefix, vocab):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.vocab = vocab
        self.seqs: dict[str, Sequence] = {}  # live sequences holding blocks
        self.counter = 0

    def _name(self):
        self.counter += 1
        return f"s{self.counter}"

    def _write(self, seq: Sequence, n: int):
        for dst_src in self.bm.take_copies():
            src, dst = dst_src
            self.kv[dst] = list(self.kv[src])
        B = self.bm.block_size
        toks = seq.all_token_ids
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            b = seq.block_table[p // B]
            assert self.bm.ref_count(b) == 1, "a step would write into a shared block"
            self.kv[b][p % B] = toks[p]
        compute(self.bm, seq, n)

    def _pick(self, i):
        return self.seqs[sorted(self.seqs)[i % len(self.seqs)]]

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12), r=st.integers(0, 1 << 16))
    def new_sequence(self, tokens, r):
        seq = make_seq(self._name(), [t % self.vocab for t in tokens])
        cached = self.bm.lookup_prefix(seq)
        remaining = seq.num_tokens - len(cached) * self.bm.block_size
        assert remaining >= 1
        chunk = 1 + r % remaining
        can = self.bm.can_allocate(seq, chunk, cached)
        before = (self.bm.num_free_blocks, self.bm.prefix_cache_queries)
        ok = self.bm.allocate(seq, chunk, cached)
        assert ok == can
        if not ok:
            assert seq.block_table == [] and (self.bm.num_free_blocks, self.bm.prefix_cache_queries) == before
            return
        assert seq.num_computed_tokens == len(cached) * self.bm.block_size
        self.seqs[seq.request_id] = seq
        self._write(seq, chunk)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63), tok=st.integers(0, 2), r=st.integers(0, 1 << 16))
    def step(self, i, tok, r):
        """Compute the next chunk of known tokens, or sample a token and decode it."""
        seq = self._pick(i)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(tok % self.vocab)
        n = 1 + r % (seq.num_tokens - seq.num_computed_tokens)
        table = list(seq.block_table)
        free_before = self.bm.num_free_blocks
        if self.bm.append_slots(seq, n):
            self._write(seq, n)
        else:
            assert seq.block_table == table and self.bm.num_free_blocks == free_before

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63))
    def fork(self, i):
        parent = self._pick(i)
        child = parent.fork(self._name())
        self.bm.fork(parent, child)
        self.seqs[child.request_id] = child

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63))
    def free(self, i):
        seq = self.seqs.pop(self._pick(i).request_id)
        self.bm.free(seq)
        assert seq.block_table == []

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63))
    def preempt_and_readmit(self, i):
        """Free a sequence and allocate it again from scratch (prefix reuse of its own blocks)."""
        seq = self.seqs.pop(self._pick(i).request_id)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        cached = self.bm.lookup_prefix(seq)
        if self.bm.allocate(seq, seq.num_tokens - len(cached) * self.bm.block_size, cached):
            self.seqs[seq.request_id] = seq
            self._write(seq, seq.num_tokens - seq.num_computed_tokens)

    @invariant()
    def ref_counts_and_lists(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants(list(self.seqs.values()))

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        if not hasattr(self, "bm"):
            return
        B = self.bm.block_size
        for seq in self.seqs.values():
            toks = seq.all_token_ids
            assert len(seq.block_table) >= self.bm.blocks_needed(seq.num_computed_tokens)
            for p in range(seq.num_computed_tokens):
                assert self.kv[seq.block_table[p // B]][p % B] == toks[p], (seq, p)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.seqs.values():
            self.bm.free(seq)
        self.bm.check_invariants([])
        assert self.bm.num_used_blocks == 0
        assert self.bm.num_free_blocks == self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# ---- KV-cache groups (sliding-window + full) -------------------------------------


def test_sliding_group_frees_blocks_that_left_the_window():
    from kvforge.planner.groups import sliding_window_blocks

    B, w = 4, 6
    bm = BlockManager(64, B, group_windows=(None, w))
    s = make_seq("a", range(5))
    assert bm.allocate(s)
    compute(bm, s, 5)
    bm.release_out_of_window(s)
    assert s.num_skipped_blocks == [0, 0]  # query at 5 sees 0..5
    for t in range(40):
        s.output_token_ids.append(t % 7)
        assert bm.append_slots(s, 1)
        held = len(s.block_tables[1]) - s.num_skipped_blocks[1]
        assert held <= sliding_window_blocks(w, B)
        # The step's query at position c sees c - w + 1 .. c: every one of those blocks is held.
        c = s.num_computed_tokens
        assert s.num_skipped_blocks[1] == max(0, c - w + 1) // B
        compute(bm, s, 1)
        bm.release_out_of_window(s)
    assert len(s.block_tables[0]) == bm.blocks_needed(s.num_computed_tokens)  # the full group keeps all
    assert bm.num_used_blocks == len(s.block_tables[0]) + len(s.block_tables[1]) - s.num_skipped_blocks[1]
    bm.check_invariants([s])
    bm.free(s)
    assert bm.num_used_blocks == 0
    bm.check_invariants([])


def test_window_blocks_bound_is_reached():
    """The bound is exact: a window not aligned to a block edge touches one block more."""
    from kvforge.planner.groups import sliding_window_blocks

    B, w = 4, 8
    bm = BlockManager(64, B, group_windows=(w,))
    s = make_seq("a", range(40))
    assert bm.allocate(s, 10)
    compute(bm, s, 10)
    most = 0
    while s.num_computed_tokens < 39:
        assert bm.append_slots(s, 1)
        most = max(most, len(s.block_table) - s.num_skipped_blocks[0])
        compute(bm, s, 1)
    assert most == sliding_window_blocks(w, B) == 3
    # A chunk of n new tokens holds the window plus the chunk for its step.
    t = make_seq("b", range(100, 140))
    assert bm.allocate(t, 9)
    compute(bm, t, 9)
    assert bm.append_slots(t, 10)
    assert len(t.block_table) - t.num_skipped_blocks[0] == sliding_window_blocks(w, B, 10) == 5


def test_prefix_hit_with_a_sliding_group_needs_only_the_window():
    B, w = 4, 6
    bm = BlockManager(64, B, group_windows=(None, w))
    a = make_seq("a", range(30))
    assert bm.allocate(a)
    compute(bm, a, 30)
    bm.free(a)  # every full block of both groups is cached free
    b = make_seq("b", list(range(24)) + [99, 98])
    hit = bm.lookup_prefix(b)
    assert hit.num_blocks == 6
    assert hit.skipped == (0, (24 - w + 1) // B)  # query at 24 sees 19..24: blocks 4, 5 of the window
    assert len(hit.tables[0]) == 6 and len(hit.tables[1]) == 2
    # Evict the sliding group's early blocks: the hit stands, since the window does not need them.
    early = {bm._hash_to_block[(1, h)] for h in b.block_hashes[:4]}
    for blk in early:
        bm._forget_hash(blk)
        del bm._cached_free[blk]
        bm._free.append(blk)
    bm.check_invariants([])
    assert bm.lookup_prefix(b) == hit
    # Evicting a block inside the window shortens the hit to the longest point whose window is whole.
    inside = bm._hash_to_block[(1, b.block_hashes[4])]
    bm._forget_hash(inside)
    del bm._cached_free[inside]
    bm._free.append(inside)
    shorter = bm.lookup_prefix(b)
    assert shorter.num_blocks < 6
    k = shorter.num_blocks
    assert all((1, h) in bm._hash_to_block for h in b.block_hashes[shorter.skipped[1]:k])
    assert bm.allocate(b, cached_blocks=shorter)
    assert b.num_computed_tokens == k * B and b.num_skipped_blocks == [0, shorter.skipped[1]]
    bm.check_invariants([b])


class GroupedBlockManagerMachine(BlockManagerMachine):
    """The same random workload over a full group and sliding-window groups sharing one pool.

    Each group has its own simulated cache contents; every sequence must read
    its own tokens in every full group and, in a sliding group, at every
    position its next query can see.
    """

    @initialize(
        num_blocks=st.integers(6, 30),
        block_size=st.integers(1, 4),
        prefix=st.booleans(),
        vocab=st.integers(1, 3),
        windows=st.lists(st.one_of(st.none(), st.integers(1, 9)), min_size=2, max_size=3),
    )
    def setup(self, num_blocks, block_size, prefix, vocab, windows):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix, group_windows=tuple(windows))
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.vocab = vocab
        self.seqs = {}
        self.counter = 0

    def _write(self, seq: Sequence, n: int):
        for src, dst in self.bm.take_copies():
            self.kv[dst] = list(self.kv[src])
        B = self.bm.block_size
        toks = seq.all_token_ids
        for g, table in enumerate(seq.block_tables):
            assert len(table) * B >= seq.num_computed_tokens + n
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                b = table[p // B]
                assert p // B >= seq.num_skipped_blocks[g], "a new token landed in a skipped entry"
                assert self.bm.ref_count(b) == 1, "a step would write into a shared block"
                self.kv[b][p % B] = (g, toks[p])
        compute(self.bm, seq, n)
        self.bm.release_out_of_window(seq)
        c = seq.num_computed_tokens
        for g, w in enumerate(self.bm.group_windows):  # every block that left its window is released at once
            due = 0 if w is None else min(max(0, c - w + 1) // B, len(seq.block_tables[g]))
            assert seq.num_skipped_blocks[g] == due, (seq, g, c)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63), r=st.integers(0, 1 << 16))
    def preempt_and_readmit(self, i, r):
        """Free a sequence and allocate it again from scratch (a prefix hit on its own blocks, where cached),
        computing its tokens in one or two chunks."""
        seq = self.seqs.pop(self._pick(i).request_id)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        cached = self.bm.lookup_prefix(seq)
        remaining = seq.num_tokens - len(cached) * self.bm.block_size
        chunk = 1 + r % remaining
        if self.bm.allocate(seq, chunk, cached):
            self.seqs[seq.request_id] = seq
            self._write(seq, chunk)
            rest = seq.num_tokens - seq.num_computed_tokens
            if rest and self.bm.append_slots(seq, rest):
                self._write(seq, rest)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=16), i=st.integers(0, 63))
    def lookup_is_the_longest_resumable_prefix(self, tokens, i):
        """The hit is the largest k whose blocks every group needs are cached (brute force over k); the probe
        extends a live sequence's tokens when there is one, so it shares cached blocks."""
        stem = self._pick(i).all_token_ids if self.seqs else []
        seq = make_seq("probe", stem + [t % self.vocab for t in tokens])
        hit = self.bm.lookup_prefix(seq)
        if not self.bm.enable_prefix_caching:
            assert hit.num_blocks == 0
            return
        B, cache = self.bm.block_size, self.bm._hash_to_block
        hashes = seq.block_hashes

        def resumable(k):
            for g, w in enumerate(self.bm.group_windows):
                first = 0 if w is None else max(0, k * B - w + 1) // B
                if any((g, hashes[i]) not in cache for i in range(first, k)):
                    return False
            return True

        best = max(k for k in range((seq.num_tokens - 1) // B + 1) if resumable(k))
        assert hit.num_blocks == best

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        if not hasattr(self, "bm"):
            return
        B = self.bm.block_size
        for seq in self.seqs.values():
            toks = seq.all_token_ids
            c = seq.num_computed_tokens
            for g, table in enumerate(seq.block_tables):
                w = self.bm.group_windows[g]
                first = 0 if w is None else max(0, c - w + 1)
                for p in range(first, c):
                    assert self.kv[table[p // B]][p % B] == (g, toks[p]), (seq, g, p)


GroupedBlockManagerMachine.TestCase.settings = settings(
    max_examples=400, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestGroupedBlockManagerMachine = GroupedBlockManagerMachine.TestCase

"""kvforge/engine/block_table_cache.py: the host copies of block tables equal the tables, step after step, under
every change the block manager makes to them; and ModelRunner.build_host lays them out per group, zero-padded.
Exact equality: these are integer copies."""

import random

import numpy as np
import pytest

from kvforge.engine.block_table_cache import BlockTableCache
from kvforge.engine.model_runner import ModelRunner


def mutate(rng: random.Random, seq: list, cache: BlockTableCache) -> list:
    """One change to one sequence's tables, as the block manager (or the engine) makes it; returns the outer
    list the sequence holds afterwards."""
    G, n = len(seq), len(seq[0])
    op = rng.choice(["extend", "extend", "slide", "trim", "cow", "reallocate", "none", "none"])
    if op == "extend":  # append_slots: every group grows in place
        k = rng.randint(1, 3)
        for table in seq:
            table.extend(rng.randrange(1, 10_000) for _ in range(k))
    elif op == "slide" and n:  # release_out_of_window: a new list with a zeroed head in one group
        g, first = rng.randrange(G), rng.randint(1, n)
        seq[g] = [0] * first + seq[g][first:]
    elif op == "trim" and n:  # trim: new, shorter lists in every group
        keep = rng.randrange(n)
        for g in range(G):
            seq[g] = seq[g][:keep]
    elif op == "cow" and n:  # copy-on-write rewrites an entry in place; the engine clears the cache
        g, i = rng.randrange(G), rng.randrange(n)
        seq[g][i] = rng.randrange(1, 10_000)
        cache.clear()
    elif op == "reallocate":  # free + allocate: a new outer list
        m = rng.randint(0, 6)
        return [[rng.randrange(1, 10_000) for _ in range(m)] for _ in range(G)]
    return seq


@pytest.mark.parametrize("num_groups", [1, 2, 6])
def test_group_copies_equal_the_tables_after_every_change(num_groups):
    rng = random.Random(num_groups)
    cache = BlockTableCache()
    seqs = [[[rng.randrange(1, 10_000) for _ in range(5)] for _ in range(num_groups)] for _ in range(12)]
    for _ in range(400):
        for i in range(len(seqs)):
            seqs[i] = mutate(rng, seqs[i], cache)
        for s in rng.sample(seqs, rng.randint(1, len(seqs))):  # not every sequence is in every step
            got = cache.get_groups(s)
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, np.array(s, dtype=np.int32).reshape(num_groups, len(s[0])))
        cache.end_step()


def test_flat_copies_equal_the_table_after_every_change():
    rng = random.Random(7)
    cache = BlockTableCache()
    seqs = [[[rng.randrange(1, 10_000) for _ in range(3)]] for _ in range(8)]
    for _ in range(300):
        for i in range(len(seqs)):
            seqs[i] = mutate(rng, seqs[i], cache)
        for s in seqs:
            np.testing.assert_array_equal(cache.get(s[0]), np.array(s[0], dtype=np.int32))
        cache.end_step()


def runner(num_groups: int) -> ModelRunner:
    r = ModelRunner.__new__(ModelRunner)
    r.block_size, r.num_groups, r._tables = 4, num_groups, BlockTableCache()
    return r


@pytest.mark.parametrize("num_groups", [1, 3])
def test_build_host_pads_each_groups_tables_with_zeros(num_groups):
    rng = random.Random(3)
    r = runner(num_groups)
    tables = [[[rng.randrange(1, 500) for _ in range(w)] for _ in range(num_groups)] for w in (3, 1, 5, 2)]
    for step in range(3):
        chunks = [([7], 4 * len(t[0]) - 2, t) for t in tables]
        host = r.build_host(chunks)
        assert host.tables.shape == (num_groups, 4, 5 + step)  # the widest table, grown by one a step
        for g in range(num_groups):
            for i, t in enumerate(tables):
                w = len(t[g])
                assert host.tables[g, i, :w].tolist() == t[g]
                assert not host.tables[g, i, w:].any()
                assert host.slots[g, i] == t[g][-1] * 4 + 2  # position 4 * w - 2: the last block, offset 2
        for t in tables:
            for table in t:
                table.append(rng.randrange(1, 500))
        tables[1][0] = [0] + tables[1][0][1:]  # a sliding group's head released: a new list


def test_build_host_takes_flat_tables_for_one_group():
    r = runner(1)
    host = r.build_host([([1], 5, [9, 8]), ([2], 0, [4])])
    assert host.tables.tolist() == [[[9, 8], [4, 0]]]
    assert host.slots.tolist() == [[8 * 4 + 1, 4 * 4]]
    with pytest.raises(ValueError, match="one block table given for a pool of 2"):
        runner(2).build_host([([1], 0, [3])])

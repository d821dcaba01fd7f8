"""Paged KV-cache block allocation with reference counts and a prefix cache.

Prefix caching: every FULL block of a sequence's tokens has a chained hash

    hash_0 = H(b"" , token_ids[0:B]),  hash_i = H(hash_{i-1}, token_ids[i*B:(i+1)*B])

where H is SHA-256 over the parent digest followed by the block's token ids as
little-endian int64 (``block_hash``). SHA-256 (not Python's ``hash``) makes the
keys stable across processes and collisions practically impossible, so a hit
can never hand a sequence someone else's KV. Hashes depend only on token ids
(no LoRA / multimodal salt yet).

KV-cache groups (hybrid models, e.g. sliding-window + full attention): the
plan splits the attention layers into groups that share a block table; every
group draws its block ids from the one pool here, and a sequence holds one
table per group (``Sequence.block_tables``). A full group keeps every block
of the sequence. A sliding-window group of window ``w`` frees, before each of
the sequence's steps and after each advance, the blocks whose tokens all lie
before ``num_computed_tokens - w + 1`` (no later query can see them); their
table entries become skipped placeholders (``Sequence.num_skipped_blocks``).
A cached block is registered under (group, chained hash), so a prefix hit
finds each group's own blocks; a sliding group needs only the blocks inside
the window of the hit point (``lookup_prefix``).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from kvforge.engine.sequence import Sequence
from kvforge.planner.groups import sliding_window_blocks


def block_hash(parent: bytes | None, token_ids) -> bytes:
    """Chained hash of one full block (see module docstring)."""
    h = hashlib.sha256()
    h.update(parent or b"")
    a = array("q", token_ids)  # 8-byte signed ints on every supported platform
    if sys.byteorder == "big":  # pragma: no cover
        a.byteswap()
    h.update(a.tobytes())
    return h.digest()


class NoFreeBlocksError(RuntimeError):
    """Raised by ``allocate``/``append_slots`` with ``strict=True`` when the pool is exhausted."""


@dataclass(frozen=True)
class PrefixHit:
    """A prefix-cache hit: the leading ``num_blocks`` block positions are cached in every group.

    ``skipped[g]``: leading positions group ``g`` does not need (a sliding
    group: blocks wholly before the window of the first uncached token);
    ``tables[g]``: the cached block ids of positions ``skipped[g] .. num_blocks - 1``.
    ``len(hit)`` is ``num_blocks``.
    """

    num_blocks: int
    skipped: tuple[int, ...]
    tables: tuple[tuple[int, ...], ...]

    def __len__(self) -> int:
        return self.num_blocks

    @property
    def blocks(self) -> list[int]:
        """The first group's cached block ids (all of them for a single-group model)."""
        return list(self.tables[0])


class BlockManager:
    """Hands out KV-cache blocks (ids ``0 .. num_blocks-1``) to sequences.

    ``group_windows``: one entry per KV-cache group, None for a full-attention
    (or MLA) group, the window for a sliding-window group; default one full
    group. Every group uses ``block_size``.

    Every block is in exactly one of three states:

    - *used*: ``ref_count > 0``; held by exactly ``ref_count`` sequences (each
      sequence's ``block_tables`` list a block at most once, in one group);
    - *free, never used* (or evicted): ``ref_count == 0``, no hash; kept in
      ``_free`` (FIFO);
    - *cached free*: ``ref_count == 0`` and its hash is in the prefix cache;
      kept in ``_cached_free`` in LRU order (least recently freed first).

    Invariants (checked by ``check_invariants``):

    1. ``num_free_blocks + num_used_blocks == num_blocks``, where free counts
       both free lists.
    2. ``_hash_to_block[k] == b`` implies ``_block_hash[b] == k``; a block in
       ``_cached_free`` has a hash, a block in ``_free`` has none.
    3. A hashed block's contents are exactly the tokens its hash describes and
       are computed (a block is registered only once all its tokens are in the
       cache, and full blocks are never written again).
    4. New blocks are taken from ``_free`` first; a cached free block is
       reused (its hash dropped = evicted) only when ``_free`` is empty.
    5. A prefix-cache hit never covers a sequence's whole token list: at least
       its last token is recomputed so the step has logits to sample from.
    6. Writing into a block shared with another sequence (after ``fork``)
       first copies it (copy-on-write); the copies are returned by
       ``take_copies`` for the model runner to apply before the step.
    7. Every group's table of a sequence has the same length; a sliding group
       holds real blocks only from ``num_skipped_blocks[g]`` on, which is
       never after the window of the sequence's next query.
    8. ``_num_children[(g, h)]`` counts the registered blocks of group ``g``
       whose parent hash is ``h`` (``None`` for a first block): the cached
       continuations of a prefix (``has_other_continuation``).

    After every sequence is freed, ``num_used_blocks == 0``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group_windows: tuple[int | None, ...] = (None,)):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        group_windows = tuple(group_windows)
        if not group_windows:
            raise ValueError("need at least one KV-cache group")
        for w in group_windows:
            if w is not None and w < 1:
                raise ValueError(f"a sliding window must be >= 1, got {w}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = group_windows
        self.num_groups = len(group_windows)
        self._sliding = tuple(g for g, w in enumerate(group_windows) if w is not None)
        self._full = tuple(g for g, w in enumerate(group_windows) if w is None)
        self._sliding_windows = tuple((g, group_windows[g]) for g in self._sliding)
        self._ref_count = [0] * num_blocks
        self._block_hash: list[tuple[int, bytes] | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[tuple[int, bytes], int] = {}
        self._block_parent: list[bytes | None] = [None] * num_blocks  # parent hash of a registered block
        self._num_children: dict[tuple[int, bytes | None], int] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._empty_hit = PrefixHit(0, (0,) * self.num_groups, ((),) * self.num_groups)
        # Stats (tokens).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0

    # ---- stats -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is in the prefix cache (used or free)."""
        return len(self._hash_to_block)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def ref_count(self, block_id: int) -> int:
        return self._ref_count[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks of one group's table that cover ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def max_blocks_per_sequence(self, num_tokens: int, new_tokens: int = 1) -> int:
        """Most block ids (all groups) a sequence of ``num_tokens`` computed tokens holds in a step of
        ``new_tokens`` tokens: every block in a full group, the window's in a sliding group
        (``sliding_window_blocks``, never more than the sequence's own blocks)."""
        full = self.blocks_needed(num_tokens)
        total = full * len(self._full)
        for g in self._sliding:
            total += min(full, sliding_window_blocks(self.group_windows[g], self.block_size, new_tokens))
        return total

    def blocks_held(self, seq: Sequence) -> int:
        """Real block ids (all groups) ``seq`` holds: its tables less the sliding groups' skipped placeholders."""
        return sum(len(t) - k for t, k in zip(seq.block_tables, seq.num_skipped_blocks))

    def blocks_to_hold(self, seq: Sequence, num_tokens: int, chunk: int, held: int | None = None) -> int:
        """Blocks (all groups) ``seq`` has yet to take to hold the KV of its first ``num_tokens`` tokens, computed
        in chunks of at most ``chunk`` tokens (a sliding group then holds its window plus a chunk); ``held``
        overrides the blocks it holds now (a prefix hit's, for a sequence not yet admitted)."""
        held = self.blocks_held(seq) if held is None else held
        return max(0, self.max_blocks_per_sequence(num_tokens, max(1, min(chunk, num_tokens))) - held)

    def _window_start(self, group: int, position: int) -> int:
        """First block position that group ``group`` needs for a query at ``position``."""
        w = self.group_windows[group]
        if w is None:
            return 0
        return max(0, position - w + 1) // self.block_size

    # ---- hashing -----------------------------------------------------------
    def _ensure_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Extend ``seq.block_hashes`` to cover its first ``num_full_blocks`` full blocks."""
        hashes = seq.block_hashes
        B = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(block_hash(parent, seq.token_ids_slice(i * B, (i + 1) * B)))
        return hashes

    def no_hit(self) -> PrefixHit:
        """The empty prefix hit (nothing cached is taken)."""
        return self._empty_hit

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of ``seq``'s first ``num_blocks`` full blocks (computed once per sequence)."""
        return self._ensure_hashes(seq, num_blocks)[:num_blocks]

    def lookup_prefix(self, seq: Sequence, resumable: Callable[[bytes], bool] | None = None) -> PrefixHit:
        """The longest cached prefix of ``seq``'s tokens that every group can resume from (no side effects).

        Only full blocks are matched, and never all of the tokens: at most
        ``(num_tokens - 1) // block_size`` blocks, so the last token is
        recomputed. A full group needs every block of the prefix; a sliding
        group only those inside the window of the first uncached token, so its
        hit can stand on blocks whose earlier neighbours were evicted.
        ``resumable(hash)``, when given, says whether a hit may end with the
        block of that hash (state layers resume only where a snapshot of their
        state was kept).
        """
        if not self.enable_prefix_caching or seq.holds_blocks:
            return self.no_hit()
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._ensure_hashes(seq, max_blocks)
        cache = self._hash_to_block
        k = max_blocks
        for g in self._full:
            n = 0
            while n < k and (g, hashes[n]) in cache:
                n += 1
            k = n
        while k > 0:
            # The last block a sliding group misses inside the window of the hit point k. Every hit point
            # in (missing, k] has that block in its window too, so the next candidate is ``missing``.
            missing = max((i for g in self._sliding for i in range(self._window_start(g, k * self.block_size), k)
                           if (g, hashes[i]) not in cache), default=None)
            if missing is not None:
                k = missing
            elif resumable is not None and not resumable(hashes[k - 1]):
                k -= 1
            else:
                break
        skipped = tuple(self._window_start(g, k * self.block_size) for g in range(self.num_groups))
        tables = tuple(tuple(cache[(g, hashes[i])] for i in range(skipped[g], k)) for g in range(self.num_groups))
        return PrefixHit(k, skipped, tables)

    def _as_hit(self, cached) -> PrefixHit:
        """``cached`` as a PrefixHit: a hit is kept; a list of block ids is the one-group form
        (``[]`` = no hit, for any number of groups)."""
        if isinstance(cached, PrefixHit):
            return cached
        cached = list(cached)
        if not cached:
            return self.no_hit()
        if self.num_groups != 1:
            raise ValueError("a list of cached block ids describes one KV-cache group; pass lookup_prefix()'s hit")
        return PrefixHit(len(cached), (0,), (tuple(cached),))

    # ---- allocation --------------------------------------------------------
    def free_after_hit(self, hit: PrefixHit) -> int:
        """Free blocks left once ``hit``'s cached blocks are taken (some of them may be free, cached)."""
        return self._num_free_for(hit)

    def _num_free_for(self, hit: PrefixHit) -> int:
        """Free blocks left after taking the hit's blocks (some may sit in the cached-free list)."""
        revived = sum(1 for t in hit.tables for b in t if self._ref_count[b] == 0)
        return self.num_free_blocks - revived

    def _new_blocks_for(self, hit: PrefixHit, num_new_tokens: int) -> int:
        """Blocks to take for ``num_new_tokens`` after the hit, in every group together."""
        per_group = self.blocks_needed(hit.num_blocks * self.block_size + num_new_tokens) - hit.num_blocks
        return per_group * self.num_groups

    def can_allocate(self, seq: Sequence, num_new_tokens: int | None = None, cached_blocks=None) -> bool:
        """Whether ``allocate(seq, num_new_tokens, cached_blocks)`` would succeed."""
        hit = self.lookup_prefix(seq) if cached_blocks is None else self._as_hit(cached_blocks)
        if num_new_tokens is None:
            num_new_tokens = seq.num_tokens - hit.num_blocks * self.block_size
        return self._new_blocks_for(hit, num_new_tokens) <= self._num_free_for(hit)

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None, cached_blocks=None) -> bool:
        """Give a sequence with no blocks its cached prefix plus room for ``num_new_tokens``.

        ``cached_blocks`` is ``lookup_prefix(seq)`` (looked up when None; a
        list of block ids is accepted for one group). On success sets
        ``seq.num_computed_tokens`` to the cached token count and returns True;
        returns False (changing nothing) when blocks are short.
        ``num_new_tokens`` defaults to all of the sequence's uncached tokens.
        """
        if seq.holds_blocks:
            raise RuntimeError(f"allocate: {seq.request_id} already holds blocks; use append_slots")
        hit = self.lookup_prefix(seq) if cached_blocks is None else self._as_hit(cached_blocks)
        num_cached = hit.num_blocks * self.block_size
        if num_new_tokens is None:
            num_new_tokens = seq.num_tokens - num_cached
        if num_new_tokens < 0 or num_cached + num_new_tokens > seq.num_tokens:
            raise ValueError(
                f"allocate: {num_cached} cached + {num_new_tokens} new tokens exceeds the "
                f"{seq.num_tokens} tokens of {seq.request_id}"
            )
        if self._new_blocks_for(hit, num_new_tokens) > self._num_free_for(hit):
            return False
        for t in hit.tables:
            for b in t:
                if self._ref_count[b] == 0:
                    del self._cached_free[b]
                self._ref_count[b] += 1
        need = self.blocks_needed(num_cached + num_new_tokens) - hit.num_blocks
        seq.block_tables = [[0] * hit.skipped[g] + list(hit.tables[g]) for g in range(self.num_groups)]
        seq.num_skipped_blocks = list(hit.skipped)
        seq.window_release_at = 0
        for table in seq.block_tables:
            table.extend(self._take_free() for _ in range(need))
        seq.num_registered_blocks = hit.num_blocks
        seq.num_computed_tokens = num_cached
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_cached
        return True

    def _take_free(self) -> int:
        if self._free:
            b = self._free.popleft()
        elif self._cached_free:
            b, _ = self._cached_free.popitem(last=False)  # least recently freed
            self._forget_hash(b)
            self.num_evictions += 1
        else:  # pragma: no cover - callers check first
            raise NoFreeBlocksError("no free KV-cache blocks")
        assert self._ref_count[b] == 0
        self._ref_count[b] = 1
        return b

    def _forget_hash(self, b: int) -> None:
        """Drop block ``b``'s hash from the prefix cache (an eviction)."""
        key = self._block_hash[b]
        if key is not None and self._hash_to_block.get(key) == b:
            del self._hash_to_block[key]
            self._drop_child(key[0], self._block_parent[b])
        self._block_hash[b] = None

    def _release(self, b: int, seq: Sequence) -> None:
        rc = self._ref_count[b]
        if rc <= 0:
            raise RuntimeError(f"double free of block {b} by {seq.request_id}")
        self._ref_count[b] = rc - 1
        if rc == 1:
            if self._block_hash[b] is not None:
                self._cached_free[b] = None
            else:
                self._free.append(b)

    @property
    def has_sliding_groups(self) -> bool:
        return bool(self._sliding)

    def release_out_of_window(self, seq: Sequence) -> int:
        """Free each sliding group's blocks that no query from ``num_computed_tokens`` on can see;
        returns how many entries were released. Their table entries become skipped placeholders (0).

        Called for every sequence in every step: below ``seq.window_release_at`` computed tokens (where the
        next block of some sliding group leaves its window, the earliest of them) nothing is due, and nothing
        is looked at."""
        computed, B = seq.num_computed_tokens, self.block_size
        if computed < seq.window_release_at:
            return 0
        released = 0
        for g, w in self._sliding_windows:
            first = max(0, computed - w + 1) // B  # _window_start
            skipped = seq.num_skipped_blocks[g]
            if first <= skipped:
                continue
            table = seq.block_tables[g]
            first = min(first, len(table))
            if first <= skipped:
                continue
            if self.enable_prefix_caching:  # the cached ones by position (-1: none), for free() to refresh
                kept = seq.out_of_window_blocks
                while len(kept) <= g:
                    kept.append(array("l"))
                kept[g].extend([-1] * (skipped - len(kept[g])))  # positions a prefix hit skipped
                kept[g].extend(b if self._block_hash[b] is not None else -1 for b in table[skipped:first])
            for i in range(first - 1, skipped - 1, -1):  # tail first, as in free()
                self._release(table[i], seq)
            # A new list (not an in-place edit): the model runner's table cache keys on the list object.
            seq.block_tables[g] = [0] * first + table[first:]
            seq.num_skipped_blocks[g] = first
            released += first - skipped
        # Group g's next block leaves its window once max(0, computed - w + 1) // B passes its skipped count.
        skipped = seq.num_skipped_blocks
        seq.window_release_at = min(((skipped[g] + 1) * B + w - 1 for g, w in self._sliding_windows), default=0)
        return released

    def _shared_blocks_to_write(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """(group, index) of table entries that the next write touches and others share."""
        if num_new_tokens <= 0:
            return []
        first = seq.num_computed_tokens // self.block_size
        end = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        rc = self._ref_count
        if end - first == 1:  # within one block (a decode): one entry a group
            if first >= len(seq.block_tables[0]):
                return []
            return [(g, first) for g, (table, skipped) in enumerate(zip(seq.block_tables, seq.num_skipped_blocks))
                    if rc[table[first]] > 1 and first >= skipped]
        out = []
        for g, table in enumerate(seq.block_tables):
            for i in range(max(first, seq.num_skipped_blocks[g]), min(len(table), end)):
                if rc[table[i]] > 1:
                    out.append((g, i))
        return out

    def new_blocks_for_step(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks (all groups) that ``append_slots(seq, num_new_tokens)`` adds to the tables, not
        counting copy-on-write nor the out-of-window blocks it frees first."""
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_tables[0])
        return max(0, need) * self.num_groups

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``append_slots`` would succeed (counting the out-of-window blocks it frees first)."""
        out_of_window = 0
        for g in self._sliding:
            first = min(self._window_start(g, seq.num_computed_tokens), len(seq.block_tables[g]))
            out_of_window += sum(1 for b in seq.block_tables[g][seq.num_skipped_blocks[g]:first]
                                 if self._ref_count[b] == 1)
        need = self.new_blocks_for_step(seq, num_new_tokens) + len(self._shared_blocks_to_write(seq, num_new_tokens))
        return need <= self.num_free_blocks + out_of_window

    def append_slots(self, seq: Sequence, num_new_tokens: int, strict: bool = False) -> bool:
        """Make room for tokens ``num_computed_tokens .. num_computed_tokens + num_new_tokens - 1``.

        First frees the sliding groups' blocks that left the window (they are
        never read again, whatever happens next); then grows every group's
        table and copies-on-write shared blocks that will be written. Returns
        False (changing nothing more) when blocks are short, or raises
        ``NoFreeBlocksError`` when ``strict``.
        """
        if self._sliding:
            self.release_out_of_window(seq)
        # Same test as can_append_slots, computing the shared blocks once (hot path: every step, every sequence).
        shared = self._shared_blocks_to_write(seq, num_new_tokens)
        tables = seq.block_tables
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(tables[0])
        if max(0, need) * self.num_groups + len(shared) > len(self._free) + len(self._cached_free):
            if strict:
                raise NoFreeBlocksError(
                    f"append_slots: {seq.request_id} needs more blocks than the {self.num_free_blocks} free"
                )
            return False
        for g, i in shared:
            table = tables[g]
            old = table[i]
            new = self._take_free()
            self._ref_count[old] -= 1  # stays >= 1: it was shared
            table[i] = new
            self._pending_copies.append((old, new))
        if need > 0:  # copy-on-write above kept the tables' length
            for table in tables:
                table.extend(self._take_free() for _ in range(need))
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Free every group's blocks past the ones covering the first ``num_tokens`` tokens (tail first);
        returns how many were freed. Speculative decoding calls it after verification: blocks taken for
        rejected proposals hold no token of the sequence. Those blocks were taken by ``append_slots`` for
        positions past every registered block, so none is shared or hashed."""
        keep = self.blocks_needed(num_tokens)
        if len(seq.block_tables[0]) <= keep:
            return 0
        freed = 0
        for g, table in enumerate(seq.block_tables):
            for i in range(len(table) - 1, max(keep, seq.num_skipped_blocks[g]) - 1, -1):
                self._release(table[i], seq)
                freed += 1
            # A new list (not an in-place edit): the model runner's table cache keys on the list object.
            seq.block_tables[g] = table[:keep]
        seq.num_registered_blocks = min(seq.num_registered_blocks, keep)
        return freed

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies from copy-on-write since the last call; apply before the step."""
        out, self._pending_copies = self._pending_copies, []
        return out

    # ---- prefix-cache registration ------------------------------------------
    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks in the prefix cache (every group).

        Call after advancing ``seq.num_computed_tokens``. If another block
        already holds the same (group, hash), this block stays unregistered
        (no dedup). Skipped entries of sliding groups hold no block.
        """
        if not self.enable_prefix_caching:
            return
        # Only tokens whose ids are known can be hashed (a token in flight may be computed already).
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size, len(seq.block_tables[0]))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._ensure_hashes(seq, num_full)
        for g, table in enumerate(seq.block_tables):
            for i in range(max(seq.num_registered_blocks, seq.num_skipped_blocks[g]), num_full):
                b = table[i]
                key = (g, hashes[i])
                if self._block_hash[b] is None and key not in self._hash_to_block:
                    self._block_hash[b] = key
                    self._hash_to_block[key] = b
                    parent = hashes[i - 1] if i else None
                    self._block_parent[b] = parent
                    self._num_children[(g, parent)] = self._num_children.get((g, parent), 0) + 1
        seq.num_registered_blocks = num_full

    def _drop_child(self, group: int, parent: bytes | None) -> None:
        n = self._num_children[(group, parent)] - 1
        if n:
            self._num_children[(group, parent)] = n
        else:
            del self._num_children[(group, parent)]

    def has_other_continuation(self, seq: Sequence, num_blocks: int) -> bool:
        """Whether the cache holds a block that follows ``seq``'s first ``num_blocks`` blocks in the first
        full group and is not ``seq``'s next block: another cached request went on from that prefix with
        different tokens (a branch point), not just stopped there."""
        if not self.enable_prefix_caching or not self._full or num_blocks < 1:
            return False
        g = self._full[0]
        hashes = self._ensure_hashes(seq, num_blocks)
        n = self._num_children.get((g, hashes[num_blocks - 1]), 0)
        if n and (seq.num_tokens // self.block_size) > num_blocks:
            own_next = self._ensure_hashes(seq, num_blocks + 1)[num_blocks]
            n -= (g, own_next) in self._hash_to_block
        return n > 0

    # ---- release -----------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks that reach zero become free.

        Blocks are released by position, last first, every group's block at a
        position together, so under LRU eviction a prompt's later blocks are
        evicted before its earlier (more shareable) ones in every group. The
        cached blocks a sliding group freed earlier, as they left the window
        (``release_out_of_window``), and that are still cached and unheld
        are refreshed in the same order: otherwise, freed first, they would be
        evicted first, and a later request sharing only the prompt's head
        would find the full groups' blocks but not the windows it needs.
        """
        kept = seq.out_of_window_blocks
        hashes = seq.block_hashes
        for i in range(max(map(len, seq.block_tables)) - 1, -1, -1):
            for g, table in enumerate(seq.block_tables):
                if i >= len(table):
                    continue
                if i >= seq.num_skipped_blocks[g]:
                    self._release(table[i], seq)
                    continue
                b = kept[g][i] if g < len(kept) and i < len(kept[g]) else -1
                if b >= 0 and self._ref_count[b] == 0 and i < len(hashes) and self._block_hash[b] == (g, hashes[i]):
                    self._cached_free.move_to_end(b)
        seq.block_tables = [[] for _ in range(self.num_groups)]
        seq.num_skipped_blocks = [0] * self.num_groups
        seq.window_release_at = 0
        seq.num_registered_blocks = 0
        seq.out_of_window_blocks = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks (refs + 1 each)."""
        if child.holds_blocks:
            raise RuntimeError(f"fork: child {child.request_id} already holds blocks")
        for g, table in enumerate(parent.block_tables):
            for b in table[parent.num_skipped_blocks[g]:]:
                self._ref_count[b] += 1
        child.block_tables = [list(t) for t in parent.block_tables]
        child.num_skipped_blocks = list(parent.num_skipped_blocks)
        child.window_release_at = 0
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_computed_tokens = parent.num_computed_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (free cached blocks become never-used free blocks)."""
        for b, _ in self._cached_free.items():
            self._block_hash[b] = None
            self._free.append(b)
        self._cached_free.clear()
        for b in self._hash_to_block.values():
            self._block_hash[b] = None
        self._hash_to_block.clear()
        self._num_children.clear()

    # ---- checking ----------------------------------------------------------
    def check_invariants(self, seqs=None) -> None:
        """Assert the class invariants; with ``seqs`` (all live sequences) also the ref counts."""
        free = set(self._free)
        cached = set(self._cached_free)
        assert len(free) == len(self._free), "duplicate in free list"
        assert not free & cached, "block in both free lists"
        for b in range(self.num_blocks):
            rc = self._ref_count[b]
            assert rc >= 0, f"negative ref count on block {b}"
            if rc == 0:
                assert (b in free) != (b in cached), f"free block {b} is in neither/both free lists"
            else:
                assert b not in free and b not in cached, f"used block {b} is on a free list"
        for b in free:
            assert self._block_hash[b] is None, f"never-used free block {b} has a hash"
        for b in cached:
            assert self._block_hash[b] is not None, f"cached free block {b} has no hash"
        for key, b in self._hash_to_block.items():
            assert self._block_hash[b] == key, f"hash map disagrees for block {b}"
        assert sum(1 for k in self._block_hash if k is not None) == len(self._hash_to_block)
        children: dict[tuple[int, bytes | None], int] = {}
        for (g, _), b in self._hash_to_block.items():
            children[(g, self._block_parent[b])] = children.get((g, self._block_parent[b]), 0) + 1
        assert children == self._num_children, "continuation counts disagree with the registered blocks"
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
        if seqs is not None:
            holders = [0] * self.num_blocks
            for s in seqs:
                held = [b for g, t in enumerate(s.block_tables) for b in t[s.num_skipped_blocks[g]:]]
                assert len(set(held)) == len(held), f"{s.request_id} lists a block twice"
                assert len({len(t) for t in s.block_tables}) <= 1, f"{s.request_id}: group tables differ in length"
                for g, t in enumerate(s.block_tables):
                    assert all(b == 0 for b in t[:s.num_skipped_blocks[g]]), "a skipped entry is not 0"
                    if t:
                        assert s.num_skipped_blocks[g] <= self._window_start(g, s.num_computed_tokens), \
                            f"{s.request_id}: group {g} skipped a block inside the window"
                for b in held:
                    holders[b] += 1
            assert holders == self._ref_count, "ref counts differ from the number of holders"

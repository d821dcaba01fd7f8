"""Paged KV-cache block allocation with reference counts and a prefix cache.

Prefix caching: every FULL block of a sequence's tokens has a chained hash

    hash_0 = H(b"" , token_ids[0:B]),  hash_i = H(hash_{i-1}, token_ids[i*B:(i+1)*B])

where H is SHA-256 over the parent digest followed by the block's token ids as
little-endian int64 (``block_hash``). SHA-256 (not Python's ``hash``) makes the
keys stable across processes and collisions practically impossible, so a hit
can never hand a sequence someone else's KV. Hashes depend only on token ids
(no LoRA / multimodal salt yet).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict, deque

from kvforge.engine.sequence import Sequence


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


class BlockManager:
    """Hands out KV-cache blocks (ids ``0 .. num_blocks-1``) to sequences.

    Every block is in exactly one of three states:

    - *used*: ``ref_count > 0``; held by exactly ``ref_count`` sequences (each
      sequence's ``block_table`` lists a block at most once);
    - *free, never used* (or evicted): ``ref_count == 0``, no hash; kept in
      ``_free`` (FIFO);
    - *cached free*: ``ref_count == 0`` and its hash is in the prefix cache;
      kept in ``_cached_free`` in LRU order (least recently freed first).

    Invariants (checked by ``check_invariants``):

    1. ``num_free_blocks + num_used_blocks == num_blocks``, where free counts
       both free lists.
    2. ``_hash_to_block[h] == b`` implies ``_block_hash[b] == h``; a block in
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

    After every sequence is freed, ``num_used_blocks == 0``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[bytes, int] = {}
        self._pending_copies: list[tuple[int, int]] = []
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
        return -(-num_tokens // self.block_size)

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

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold the longest prefix of ``seq``'s tokens (no side effects).

        Only full blocks are matched, and never all of the tokens: at most
        ``(num_tokens - 1) // block_size`` blocks, so the last token is recomputed.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._ensure_hashes(seq, max_blocks)
        hits: list[int] = []
        for h in hashes[:max_blocks]:
            b = self._hash_to_block.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    # ---- allocation --------------------------------------------------------
    def _num_free_for(self, cached_blocks: list[int]) -> int:
        """Free blocks left after taking ``cached_blocks`` (some may sit in the cached-free list)."""
        revived = sum(1 for b in cached_blocks if self._ref_count[b] == 0)
        return self.num_free_blocks - revived

    def can_allocate(self, seq: Sequence, num_new_tokens: int | None = None, cached_blocks=None) -> bool:
        """Whether ``allocate(seq, num_new_tokens, cached_blocks)`` would succeed."""
        if cached_blocks is None:
            cached_blocks = self.lookup_prefix(seq)
        num_cached = len(cached_blocks) * self.block_size
        if num_new_tokens is None:
            num_new_tokens = seq.num_tokens - num_cached
        need = self.blocks_needed(num_cached + num_new_tokens) - len(cached_blocks)
        return need <= self._num_free_for(cached_blocks)

    def allocate(
        self, seq: Sequence, num_new_tokens: int | None = None, cached_blocks: list[int] | None = None
    ) -> bool:
        """Give a sequence with no blocks its cached prefix plus room for ``num_new_tokens``.

        ``cached_blocks`` is ``lookup_prefix(seq)`` (looked up when None). On
        success sets ``seq.num_computed_tokens`` to the cached token count and
        returns True; returns False (changing nothing) when blocks are short.
        ``num_new_tokens`` defaults to all of the sequence's uncached tokens.
        """
        if seq.block_table:
            raise RuntimeError(f"allocate: {seq.request_id} already holds blocks; use append_slots")
        if cached_blocks is None:
            cached_blocks = self.lookup_prefix(seq)
        num_cached = len(cached_blocks) * self.block_size
        if num_new_tokens is None:
            num_new_tokens = seq.num_tokens - num_cached
        if num_new_tokens < 0 or num_cached + num_new_tokens > seq.num_tokens:
            raise ValueError(
                f"allocate: {num_cached} cached + {num_new_tokens} new tokens exceeds the "
                f"{seq.num_tokens} tokens of {seq.request_id}"
            )
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            return False
        for b in cached_blocks:
            if self._ref_count[b] == 0:
                del self._cached_free[b]
            self._ref_count[b] += 1
        seq.block_table = list(cached_blocks)
        seq.num_registered_blocks = len(cached_blocks)
        seq.num_computed_tokens = num_cached
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_cached
        need = self.blocks_needed(num_cached + num_new_tokens) - len(cached_blocks)
        seq.block_table.extend(self._take_free() for _ in range(need))
        return True

    def _take_free(self) -> int:
        if self._free:
            b = self._free.popleft()
        elif self._cached_free:
            b, _ = self._cached_free.popitem(last=False)  # least recently freed
            h = self._block_hash[b]
            if h is not None and self._hash_to_block.get(h) == b:
                del self._hash_to_block[h]
            self._block_hash[b] = None
            self.num_evictions += 1
        else:  # pragma: no cover - callers check first
            raise NoFreeBlocksError("no free KV-cache blocks")
        assert self._ref_count[b] == 0
        self._ref_count[b] = 1
        return b

    def _shared_blocks_to_write(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Indices into ``seq.block_table`` of blocks that the next write touches and others share."""
        if num_new_tokens <= 0:
            return []
        first = seq.num_computed_tokens // self.block_size
        last = min(len(seq.block_table), self.blocks_needed(seq.num_computed_tokens + num_new_tokens))
        return [i for i in range(first, last) if self._ref_count[seq.block_table[i]] > 1]

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = max(0, self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))
        need += len(self._shared_blocks_to_write(seq, num_new_tokens))
        return need <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int, strict: bool = False) -> bool:
        """Make room for tokens ``num_computed_tokens .. num_computed_tokens + num_new_tokens - 1``.

        Grows ``seq.block_table`` and copies-on-write shared blocks that will be
        written. Returns False (changing nothing) when blocks are short, or
        raises ``NoFreeBlocksError`` when ``strict``.
        """
        # Same test as can_append_slots, computing the shared blocks once (hot path: every step, every sequence).
        shared = self._shared_blocks_to_write(seq, num_new_tokens)
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if max(0, need) + len(shared) > len(self._free) + len(self._cached_free):
            if strict:
                raise NoFreeBlocksError(
                    f"append_slots: {seq.request_id} needs more blocks than the {self.num_free_blocks} free"
                )
            return False
        for i in shared:
            old = seq.block_table[i]
            new = self._take_free()
            self._ref_count[old] -= 1  # stays >= 1: it was shared
            seq.block_table[i] = new
            self._pending_copies.append((old, new))
        if need > 0:  # copy-on-write above kept the table's length
            seq.block_table.extend(self._take_free() for _ in range(need))
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies from copy-on-write since the last call; apply before the step."""
        out, self._pending_copies = self._pending_copies, []
        return out

    # ---- prefix-cache registration ------------------------------------------
    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's full, computed blocks in the prefix cache.

        Call after advancing ``seq.num_computed_tokens``. If another block
        already holds the same hash, this block stays unregistered (no dedup).
        """
        if not self.enable_prefix_caching:
            return
        # Only tokens whose ids are known can be hashed (a token in flight may be computed already).
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._ensure_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            b = seq.block_table[i]
            h = hashes[i]
            if self._block_hash[b] is None and h not in self._hash_to_block:
                self._block_hash[b] = h
                self._hash_to_block[h] = b
        seq.num_registered_blocks = num_full

    # ---- release -----------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks that reach zero become free.

        Blocks are released tail first, so under LRU eviction a prompt's later
        blocks are evicted before its earlier (more shareable) ones.
        """
        for b in reversed(seq.block_table):
            rc = self._ref_count[b]
            if rc <= 0:
                raise RuntimeError(f"double free of block {b} by {seq.request_id}")
            self._ref_count[b] = rc - 1
            if rc == 1:
                if self._block_hash[b] is not None:
                    self._cached_free[b] = None
                else:
                    self._free.append(b)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks (refs + 1 each)."""
        if child.block_table:
            raise RuntimeError(f"fork: child {child.request_id} already holds blocks")
        for b in parent.block_table:
            self._ref_count[b] += 1
        child.block_table = list(parent.block_table)
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
        for h, b in self._hash_to_block.items():
            assert self._block_hash[b] == h, f"hash map disagrees for block {b}"
        assert sum(1 for h in self._block_hash if h is not None) == len(self._hash_to_block)
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
        if seqs is not None:
            holders = [0] * self.num_blocks
            for s in seqs:
                assert len(set(s.block_table)) == len(s.block_table), f"{s.request_id} lists a block twice"
                for b in s.block_table:
                    holders[b] += 1
            assert holders == self._ref_count, "ref counts differ from the number of holders"

"""Host (numpy int32) copies of block tables, kept across steps.

A decode step would otherwise convert every sequence's whole Python table again (and, for a hybrid model,
one table per KV-cache group). The cache is keyed by the identity of the list a step brings: a sequence's
``block_tables`` (one list per group, :meth:`BlockTableCache.get_groups`) or one flat table
(:meth:`BlockTableCache.get`). Each entry keeps the lists it copied alive, so an id is never reused while
its entry exists.

What the block manager does to a table, and what the cache does about it:

- a table grows by ``extend``: the new tail is copied;
- a sliding group's out-of-window head, a trim, a fork, a new allocation: the block manager puts a new list
  in place; the cache sees another object and copies that table whole;
- copy-on-write rewrites an entry in place: the engine calls :meth:`BlockTableCache.clear` in that step.

As a guard, the last entry a flat table's entry copied, and the last a group's entry copied when that
group grew, is compared with the list's before the copy is extended.
"""

from __future__ import annotations

import numpy as np


class BlockTableCache:
    """See the module docstring. :meth:`end_step` keeps only the entries a step used."""

    def __init__(self):
        self._entries: dict[int, tuple] = {}
        self._used: dict[int, tuple] = {}

    def clear(self) -> None:
        self._entries.clear()

    def get(self, table: list[int]) -> np.ndarray:
        """``table`` as an int32 array ``[len(table)]`` (a view valid until the next call for it)."""
        key = id(table)
        n = len(table)
        entry = self._entries.get(key)
        if entry is not None and entry[0] is table and entry[1].ndim == 1 and entry[2] <= n and (
                entry[2] == 0 or int(entry[1][entry[2] - 1]) == table[entry[2] - 1]):
            arr, have = entry[1], entry[2]
            if have < n:
                if arr.shape[0] < n:
                    grown = np.empty(max(n, 2 * arr.shape[0]), dtype=np.int32)
                    grown[:have] = arr[:have]
                    arr = grown
                arr[have:n] = table[have:n]
        else:
            arr = np.empty(max(n, 8), dtype=np.int32)
            arr[:n] = table
        self._used[key] = (table, arr, n)
        return arr[:n]

    def get_groups(self, tables: list[list[int]]) -> np.ndarray:
        """One sequence's tables (one list per group, all of one length) as an int32 array
        ``[len(tables), len(tables[0])]`` (a view valid until the next call for them)."""
        key = id(tables)
        n = len(tables[0])
        entry = self._entries.get(key)
        # The decode fast path: the same lists, of the length copied. (Tuple equality is identity first; a list
        # put in place of one it equals holds what was copied, since a table changes in place only by extend,
        # which changes its length, or by copy-on-write, after which the cache is cleared.)
        if entry is not None and entry[0] is tables and entry[3] == n and entry[2] == tuple(tables):
            self._used[key] = entry
            return entry[4]
        G = len(tables)
        if entry is not None and entry[0] is tables and entry[1].ndim == 2 and entry[1].shape[0] == G:
            _, arr, refs, have, _ = entry
        else:
            arr, refs, have = None, (), 0
        if arr is None or arr.shape[1] < n:
            grown = np.empty((G, max(n, 8, 2 * (0 if arr is None else arr.shape[1]))), dtype=np.int32)
            if arr is not None:
                grown[:, :have] = arr[:, :have]
            arr = grown
        for g, table in enumerate(tables):
            if g < len(refs) and refs[g] is table and have <= n and (have == 0 or arr[g, have - 1] == table[have - 1]):
                arr[g, have:n] = table[have:n]  # grown by extend: copy the tail
            else:
                arr[g, :n] = table  # another list (or an emptied one): copy it whole
        entry = (tables, arr, tuple(tables), n, arr[:, :n])
        self._used[key] = entry
        return entry[4]

    def end_step(self) -> None:
        """Keep only the tables used by this step (finished sequences drop out)."""
        self._entries, self._used = self._used, {}

"""KV-cache groups: which layers share a block table and a page layout.

Attention layers with the same page layout (kind, window, bytes per token)
form a *type*. All types share one block pool, so pages must have one size:
each type is cut into groups of ``group_size`` layers, and a group with fewer
layers leaves ``padding_layers`` page slots unused. The group size is chosen
between the smallest and largest type to waste the fewest page slots (ties:
fewer groups). Types with smaller pages use proportionally larger blocks so
every page has the same byte size; a non-integral ratio is padded.

A speculative proposer's layers (a draft model's) are counted in the type of
the target's layers with the same page layout, after them (``draft_layers``),
so they fill the same groups; a layout of its own is a type of its own, and
when its pages are a whole fraction of the pool's, ``layers_per_slot`` of
them share one page slot (each a slice of every page of it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerType:
    kind: str
    layers: tuple[int, ...]
    token_bytes: int
    padded_page_bytes_at_base: int  # backend page padding applied at the base block size
    kv_dtype: str
    backend: str
    draft_layers: tuple[int, ...] = ()  # the proposer's layers of this layout (slots after ``layers``)
    layers_per_slot: int = 1  # proposer layers sharing one page slot (a type of proposer layers only)

    @property
    def num_layers(self) -> int:
        """Page slots the type fills (its layers, with ``layers_per_slot`` proposer layers per slot)."""
        return len(self.layers) + -(-len(self.draft_layers) // self.layers_per_slot)


@dataclass(frozen=True)
class Grouping:
    group_size: int
    #: (type, target layers, proposer layers, padding_layers) per group
    groups: tuple[tuple[LayerType, tuple[int, ...], tuple[int, ...], int], ...]
    padding_layers: int

    @property
    def num_slots(self) -> int:
        return len(self.groups) * self.group_size

    @property
    def waste_pct(self) -> float:
        return 100.0 * self.padding_layers / self.num_slots if self.num_slots else 0.0


def choose_grouping(types: list[LayerType]) -> Grouping:
    """Split each type into groups of one common size, wasting the fewest slots."""
    if not types:
        return Grouping(0, (), 0)
    counts = [t.num_layers for t in types]
    if len(types) == 1:
        candidates = [counts[0]]
    else:
        candidates = list(range(min(counts), max(counts) + 1))
    best = None
    for size in candidates:
        padding = sum(-(-n // size) * size - n for n in counts)
        num_groups = sum(-(-n // size) for n in counts)
        key = (padding, num_groups)
        if best is None or key < best[0]:
            best = (key, size)
    size = best[1]
    groups = []
    total_padding = 0
    for t in types:
        r = t.layers_per_slot
        slots = [((i,), ()) for i in t.layers] + [((), t.draft_layers[j:j + r]) for j in range(0, len(t.draft_layers), r)]
        for start in range(0, len(slots), size):
            chunk = slots[start:start + size]
            pad = size - len(chunk)
            total_padding += pad
            groups.append((t, tuple(i for mine, _ in chunk for i in mine), tuple(i for _, d in chunk for i in d), pad))
    return Grouping(size, tuple(groups), total_padding)


def sliding_window_blocks(window: int, block_size: int, new_tokens: int = 1) -> int:
    """Most blocks a sliding-window group holds for one sequence during a step of ``new_tokens`` tokens.

    The step's queries at positions ``s .. s + new_tokens - 1`` read keys from
    ``s - window + 1`` on, so the group keeps the ``window - 1`` tokens before
    ``s`` plus the new ones: ``window - 2 + new_tokens + 1`` consecutive tokens,
    which touch at most ``ceil((window + new_tokens - 2) / block_size) + 1``
    blocks (a run not aligned to a block edge touches one block more). Blocks
    whose tokens all lie before ``s - window + 1`` are freed (kvforge/engine/
    block_manager.py). A decode step (``new_tokens`` = 1) gives the figure the
    plan counts per sequence; a longer prefill chunk holds more for its step.
    """
    return -(-(window + new_tokens - 2) // block_size) + 1

"""Routing table of the Triton paged-attention backend (full and sliding layers on CUDA).

Four rows serve it, three kernels. The Gluon fp8 decode kernels take decode batches over fp8 caches where the
Gluon gate is open (:mod:`.platform`); which one follows the shape: on grids of at least
``min_programs_per_sm`` programs per SM (head sizes 64 and 128) the "warp" kernel (every warp keeps its own
softmax over its share of a tile) with one warp per program, at any context; on smaller grids the four-warp
"warp" kernel once the context is longer than its row's ``min_context`` and the programs fill ``min_waves``
waves of the GPU, else the "cta" kernel. The one-warp row depends on the number of programs only; a CUDA
graph, captured for a padded batch, runs the row of its padded size (9-12 sequences over 8 KV heads replay
the 16-sequence graph's one-warp launch where an eager step runs a four-warp kernel). The four-warp row's
context bound is exclusive because the first CUDA-graph context bucket ends at it: a graph of that bucket
replays contexts up to it, nearly all of which the eager path runs on the "cta" kernel, so the graph must
route to it too. Everything else (prefill, mixed and 16/32-bit decode, other head sizes, wider GQA groups,
layers with attention sinks, the gate closed) runs the tl.dot kernel. Sliding windows run on every kernel;
attention sinks (one logit per query head in the softmax denominator) only on the tl.dot kernel, which adds
them once per query row: in its epilogue without split-K, in the merge of the split partials with it. The
kernel depends on the shape only: a pinned split count (CUDA graphs) replaces the count, never the kernel,
so a captured graph runs the kernel the eager path would.

Long prefill chunks leave the kernels for torch's fused attention (:data:`SDPA_PREFILL`,
:func:`sdpa_prefill_sequences`): in an eager step whose host copies of ``query_start_loc`` and ``seq_lens``
are known, a sequence with at least ``SDPA_PREFILL.min_query_len`` query tokens runs through
``scaled_dot_product_attention`` over its context gathered from the cache
(:mod:`kvforge.attention.paged_prefill_sdpa`) when the layer has no attention sinks, its window does not cut
into the sequence (none, or at least the sequence's length), the head size is at most
``SDPA_PREFILL.max_head_size`` and the query is bf16 or fp16. The other sequences of the step run through
the table above as a batch of their own. A call with a pinned split count (a CUDA graph) or without the host
copies never leaves the kernels, and ``min_query_len`` exceeds any verification length a graph is captured
for, so decode and verification graphs never reach it. ``KVFORGE_DISABLE_SDPA_PREFILL`` (:mod:`kvforge.env`)
and a named kernel (``kernel=`` of the launchers, tests and benchmarks) keep every sequence on the kernels.

Inputs are integers and dtype names (``"bfloat16"``, ``"float16"``, ``"float32"``, ``"fp8_e4m3"``,
``"fp8_e5m2"``); nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.attention.routing.platform import Device
from kvforge.attention.routing.split_k import SplitRule
from kvforge.kv_dtypes import BYTES_PER_ELEMENT

FP8_KV_DTYPES: frozenset[str] = frozenset({"fp8_e4m3", "fp8_e5m2"})


@dataclass(frozen=True)
class PagedKernel:
    """One row of the table: a kernel and when it applies (None: any)."""

    name: str
    launcher: str  # "module:function" that launches it
    needs_gluon: bool
    decode_only: bool
    kv_dtypes: frozenset[str] | None
    query_dtypes: frozenset[str] | None
    head_sizes: frozenset[int] | None
    max_group: int | None  # query heads per KV head
    sinks: bool  # serves layers with attention sinks
    splits: SplitRule
    #: The "warp" variant's extra condition: context > this and programs x its splits >= this many waves.
    min_context: int = 0
    min_waves: int = 0
    #: The one-warp variant's condition: programs >= this many x SMs (0: no such condition).
    min_programs_per_sm: float = 0.0
    #: Tile overrides the launcher applies for this row (``(key, value)`` pairs of
    #: :data:`kvforge.kernels.gluon_fp8_decode.TILING_KEYS`).
    tiling: tuple[tuple[str, int], ...] = ()
    when: str = ""


#: The tl.dot kernel: any batch; split-K only when every sequence's query fits in one tile (decode-like).
TL_DOT = PagedKernel(
    name="tl_dot", launcher="kvforge.kernels.triton_paged_attention:paged_attention",
    needs_gluon=False, decode_only=False, kv_dtypes=None, query_dtypes=None, head_sizes=None, max_group=None,
    sinks=True, splits=SplitRule(waves=4, min_tokens=256, max_splits=64, round_up=True, small_grid_waves=2,
                                 small_grid_min_tokens=128),
    when="every batch the Gluon rows do not take; split-K when each sequence's query fits one tile",
)
_GLUON_SCOPE = dict(needs_gluon=True, decode_only=True, kv_dtypes=FP8_KV_DTYPES,
                    query_dtypes=frozenset({"bfloat16", "float16"}), head_sizes=frozenset({64, 128, 256}),
                    max_group=16, sinks=False)  # fmt: skip
#: The Gluon "warp" kernel with one warp per program, 32 tokens a tile and a 3-stage ring: large grids at any
#: context. A one-warp program never waits on another warp, so its copies and products interleave freely with
#: those of the other programs on its SM. Its splits aim at ~8 programs per SM (whole ones: the floor), where
#: it beat the four-warp kernels at 16-256 sequences x 8 KV heads except 48 x 16k and 96 x 4k-16k (3-9%
#: slower); below ~0.75 programs per SM the splits get too short to keep enough copies in flight
#: (docs/BENCHMARKS.md, "Paged decode attention").
GLUON_FP8_WARP1 = PagedKernel(
    name="gluon_fp8_warp1", launcher="kvforge.kernels.gluon_fp8_decode:launch_gluon_fp8_decode",
    **{**_GLUON_SCOPE, "head_sizes": frozenset({64, 128})},
    splits=SplitRule(waves=8, min_tokens=256, max_splits=64, round_up=False), min_programs_per_sm=0.75,
    tiling=(("wt", 32), ("stages", 3), ("warps", 1)),
    when="large grids",
)
#: The Gluon "warp" kernel with four warps a program: long contexts on the grids below the one-warp row's.
GLUON_FP8_WARP = PagedKernel(
    name="gluon_fp8_warp", launcher="kvforge.kernels.gluon_fp8_decode:launch_gluon_fp8_decode", **_GLUON_SCOPE,
    splits=SplitRule(waves=4, min_tokens=1024, max_splits=64, round_up=True, small_grid_waves=2), min_context=2048, min_waves=2,
    when="context > 2048 and programs x splits >= 2 x SMs",
)
#: The Gluon "cta" kernel: the other fp8 decode batches in the Gluon scope.
GLUON_FP8_CTA = PagedKernel(
    name="gluon_fp8_cta", launcher="kvforge.kernels.gluon_fp8_decode:launch_gluon_fp8_decode", **_GLUON_SCOPE,
    splits=SplitRule(waves=4, min_tokens=256, max_splits=64, round_up=True, small_grid_waves=2,
                     small_grid_min_tokens=128),
    when="the other decode batches in the Gluon scope",
)
#: In order of preference; the first that applies serves.
TABLE: tuple[PagedKernel, ...] = (GLUON_FP8_WARP1, GLUON_FP8_WARP, GLUON_FP8_CTA, TL_DOT)
KERNEL_NAMES: tuple[str, ...] = tuple(k.name for k in TABLE)
KERNELS: dict[str, PagedKernel] = {k.name: k for k in TABLE}


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class PagedShape:
    """One call's shape: ``num_seqs`` sequences, query heads ``num_q_heads`` over ``num_kv_heads``, head
    size ``head_size``, the longest query ``max_query_len`` and context ``max_seq_len``, the layer's
    ``window`` (0: none) and whether it has attention ``sinks``."""

    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    max_query_len: int
    max_seq_len: int
    query_dtype: str
    kv_dtype: str
    window: int = 0
    sinks: bool = False

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def uses_window(self) -> bool:
        return 0 < self.window < self.max_seq_len

    @property
    def context(self) -> int:
        """Tokens a decode program walks at most: the window when it is shorter than the context."""
        return min(self.max_seq_len, self.window) if self.uses_window else self.max_seq_len


@dataclass(frozen=True)
class TlDotTiles:
    """The tl.dot kernel's tiles for a shape: ``block_q`` query tokens x ``G_PAD`` heads = ``block_m`` rows
    per program, ``tile_n`` context tokens per iteration; ``one_tile``: every sequence's query fits one tile
    (one program per (sequence, KV head), split-K possible)."""

    decode_like: bool
    block_q: int
    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int
    one_tile: bool


def tl_dot_tiles(shape: PagedShape) -> TlDotTiles:
    """Decode-like batches (one query tile per sequence): ``16 // G_PAD`` tokens a tile (more when a query
    is longer), 128-token context tiles up to head size 128, 4 warps, 3 stages. Others: 128 rows (64 above
    head size 128), 64-token context tiles (32 above 128), 8 warps from head size 128, 2 stages."""
    g_pad = next_power_of_2(shape.group)
    d_pad = max(16, next_power_of_2(shape.head_size))
    q_len = shape.max_query_len
    decode_like = q_len * g_pad <= 16 or q_len == 1
    if decode_like:
        block_q = max(max(1, 16 // g_pad), next_power_of_2(q_len))
        block_m = block_q * g_pad
        tile_n, num_warps, num_stages = (128 if d_pad <= 128 else 64), 4, 3
    else:
        block_m = max(128 if d_pad <= 128 else 64, g_pad)
        block_q = block_m // g_pad
        tile_n, num_warps, num_stages = (64 if d_pad <= 128 else 32), (8 if d_pad >= 128 else 4), 2
    return TlDotTiles(decode_like, block_q, block_m, max(tile_n, 16), num_warps, num_stages, q_len <= block_q)


def applies(kernel: PagedKernel, shape: PagedShape, device: Device) -> bool:
    """Whether ``kernel``'s row takes ``shape`` on ``device`` (the scope; the warp row's extra condition is
    :func:`route`'s)."""
    return ((device.gluon or not kernel.needs_gluon)
            and (not kernel.decode_only or shape.max_query_len == 1)
            and (kernel.kv_dtypes is None or shape.kv_dtype in kernel.kv_dtypes)
            and (kernel.query_dtypes is None or shape.query_dtype in kernel.query_dtypes)
            and (kernel.head_sizes is None or shape.head_size in kernel.head_sizes)
            and (kernel.max_group is None or shape.group <= kernel.max_group)
            and (kernel.sinks or not shape.sinks))  # fmt: skip


@dataclass(frozen=True)
class PagedRoute:
    """What runs: ``kernel`` (a name of :data:`TABLE`) with ``splits`` context splits (1: no split-K)."""

    kernel: str
    splits: int
    tiles: TlDotTiles | None = None  # the tl.dot kernel's tiles
    tiling: tuple[tuple[str, int], ...] = ()  # a Gluon row's tile overrides (its ``tiling``)


def _fills_waves(kernel: PagedKernel, programs: int, context: int, device: Device) -> bool:
    """Whether ``kernel``'s programs times its splits fill its ``min_waves`` waves of the GPU."""
    splits = kernel.splits.splits(programs, context, device.num_sms)
    return programs * splits >= kernel.min_waves * device.num_sms


def route(shape: PagedShape, device: Device, forced_splits: int | None = None) -> PagedRoute:
    """The kernel and split count for ``shape`` (``forced_splits``: a pinned count; see the module docstring)."""
    programs = shape.num_seqs * shape.num_kv_heads
    if applies(GLUON_FP8_CTA, shape, device):
        one_warp, warp = GLUON_FP8_WARP1, GLUON_FP8_WARP
        if applies(one_warp, shape, device) and programs >= one_warp.min_programs_per_sm * device.num_sms:
            kernel = one_warp
        elif shape.context > warp.min_context and _fills_waves(warp, programs, shape.context, device):
            kernel = warp
        else:
            kernel = GLUON_FP8_CTA
        splits = kernel.splits.splits(programs, shape.context, device.num_sms)
        if forced_splits is not None:
            splits = kernel.splits.apply_forced(forced_splits, programs, shape.context, device.num_sms)
        return PagedRoute(kernel.name, splits, tiling=kernel.tiling)
    tiles = tl_dot_tiles(shape)
    splits = 1
    if tiles.one_tile:
        splits = TL_DOT.splits.choose(forced_splits, programs, shape.context, device.num_sms)
    return PagedRoute(TL_DOT.name, splits, tiles)


def pinned_splits(batch: int, num_q_heads: int, num_kv_heads: int, head_size: int, max_model_len: int,
                  query_dtype: str, kv_dtype: str, device: Device, sinks: bool = False, query_len: int = 1) -> int:
    """The split count a CUDA graph of ``batch`` sequences of ``query_len`` query tokens (1: decode) pins: the
    eager rule at ``max_model_len``, the graph's context bucket (its metadata says ``max_seq_len =
    max_model_len``; the kernels divide shorter contexts among the same splits) for layers with or without
    attention ``sinks`` (which decide the kernel). The window is not looked at, as the graph's own pinning
    never did."""
    shape = PagedShape(batch, num_q_heads, num_kv_heads, head_size, query_len, max_model_len, query_dtype,
                       kv_dtype, sinks=sinks)
    return route(shape, device).splits


# ---- prefill through torch's fused attention ----------------------------------------------------------------


@dataclass(frozen=True)
class SdpaPrefillRule:
    """Which sequences of a step leave the kernels for ``scaled_dot_product_attention`` (module docstring):
    at least ``min_query_len`` query tokens, a query dtype in ``query_dtypes``, head size at most
    ``max_head_size`` (torch's flash kernel's limit), no sinks, no window shorter than the sequence."""

    min_query_len: int
    query_dtypes: frozenset[str]
    max_head_size: int


#: The rule. 512 query tokens: far above any speculative verification length; shorter chunks keep the one
#: batched launch of the kernels rather than a context gather and a few launches per sequence.
SDPA_PREFILL = SdpaPrefillRule(min_query_len=512, query_dtypes=frozenset({"bfloat16", "float16"}), max_head_size=256)


#: Bytes of gathered K and V one SDPA call may hold (KV heads go in groups to stay under it; one head is always
#: allowed): 1 GiB, the K and V of all 8 KV heads of a 262,144-token Llama-3-8B sequence in bf16. The plan's
#: activation reserve counts one call's (kvforge/planner/activations.py).
SDPA_PREFILL_KV_BYTES: int = 1 << 30


def sdpa_prefill_kv_bytes_per_head(seq_len: int, head_size: int, model_dtype: str, kv_dtype: str, expand: int = 1,
                                   block_size: int = 1) -> int:
    """Peak bytes of one KV head's gathered K and V for a sequence of ``seq_len`` tokens: the rows read from
    whole blocks in the cache dtype, then (a cache of another dtype) their copy in the model dtype, through a
    float32 copy for fp8 (the scale applied there), all alive at once; where K and V are expanded to
    ``expand`` query heads per KV head, the model-dtype rows and their expansion. That is torch's gather
    (CPU); the CUDA gather kernel writes the model-dtype rows only, so this bounds it too."""
    model, cache = BYTES_PER_ELEMENT[model_dtype], BYTES_PER_ELEMENT[kv_dtype]
    rows = -(-seq_len // block_size) * block_size
    converted = 0 if kv_dtype == model_dtype else seq_len * ((4 if kv_dtype in FP8_KV_DTYPES else 0) + model)
    expanded = seq_len * model * (1 + expand) if expand > 1 else 0
    return 2 * head_size * max(rows * cache + converted, expanded)


def sdpa_prefill_layer(head_size: int, query_dtype: str, sinks: bool, enabled: bool = True,
                       pinned_splits: bool = False) -> bool:
    """Whether any sequence of a call on this layer may leave the kernels: the rule's layer conditions, the
    switch ``enabled`` (off: ``KVFORGE_DISABLE_SDPA_PREFILL`` or a named kernel) and no pinned split count."""
    rule = SDPA_PREFILL
    return (enabled and not pinned_splits and not sinks and head_size <= rule.max_head_size
            and query_dtype in rule.query_dtypes)  # fmt: skip


def sdpa_prefill_takes(query_len: int, seq_len: int, window: int = 0) -> bool:
    """Whether one sequence (``query_len`` new tokens, ``seq_len`` after the step) of a layer that
    :func:`sdpa_prefill_layer` admits leaves the kernels: a long enough query and no window cutting into it."""
    return query_len >= SDPA_PREFILL.min_query_len and (window <= 0 or window >= seq_len)


def sdpa_prefill_sequences(query_lens: list[int], seq_lens: list[int], window: int, head_size: int,
                           query_dtype: str, sinks: bool, enabled: bool = True,
                           pinned_splits: bool = False) -> tuple[int, ...]:
    """The indices of the sequences that run through ``scaled_dot_product_attention`` (the others: the
    kernels of :data:`TABLE`)."""
    if not sdpa_prefill_layer(head_size, query_dtype, sinks, enabled, pinned_splits):
        return ()
    return tuple(i for i, (q, n) in enumerate(zip(query_lens, seq_lens)) if sdpa_prefill_takes(q, n, window))

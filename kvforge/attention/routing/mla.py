"""Routing table of the Triton MLA backend (DeepSeek-V2/V3-style latent caches on CUDA).

Decode (one query token per sequence) runs one of three kernels, tried in the order :func:`decode_candidates`
gives (a candidate whose launch once ran out of shared memory or registers is skipped from then on):

1. ``gluon_mla_ws``: the warp-specialized fp8 kernel (a producer warpgroup, two consumers on alternate
   tiles), for fp8 caches at up to ``WS.max_heads`` heads where every CTA gets at least
   ``WS_MIN_TOKENS_PER_CTA`` tokens; with the plan's e4m3 query its score product is an fp8 ``wgmma``, and
   so is a bf16 model-dtype query's over an e4m3 cache at 16 heads per program, as two exact e4m3 terms
   (:func:`ws_two_term_query`).
2. ``gluon_mla_wgmma``: the ``wgmma`` kernel (cached tokens as the M dimension), for bf16/fp16 models at up
   to ``WGMMA.max_heads`` heads over a cache of the model's dtype or fp8, latent 512 + rope 64. It always
   computes with the model-dtype query.
3. ``tl_dot_mla``: the tl.dot kernel, for everything (float32, other latent sizes, mixed 16-bit dtypes, the
   Gluon gate closed); it implements the fp8 query as an fp8 x fp8 dot.

The e4m3 query (``QUANTIZED_QUERY``, what the backend declaration offers the planner) is declared at
1-``FP8_QUERY_MAX_HEADS`` heads on e4m3 caches with 576-wide rows. It runs as an fp8 product only on the
warp-specialized kernel; wherever that kernel does not take the call, the model-dtype query runs (the
wgmma kernel's, or the tl.dot kernel's exact query), so the e4m3 query is an upper bound on the rounding.
The planner takes it only under ``--query-dtype fp8`` (``QuantizedQueryRule.opt_in`` says why).

Steps with a prefill chunk send each sequence down one of the paths of :data:`PREFILL_MODES`
(:func:`sequence_paths`).

Inputs are integers and dtype names; nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.attention.routing.platform import Device
from kvforge.attention.routing.split_k import SplitRule

FP8_KV_DTYPES: frozenset[str] = frozenset({"fp8_e4m3", "fp8_e5m2"})
SIXTEEN_BIT: frozenset[str] = frozenset({"bfloat16", "float16"})
#: The latent and rope widths the Gluon kernels are written for (DeepSeek-V2/V3, Kimi-K2).
LATENT_DIM: int = 512
ROPE_DIM: int = 64


@dataclass(frozen=True)
class MLAKernel:
    """One decode kernel and when it applies (None: any)."""

    name: str
    launcher: str  # "module:function" that launches it
    needs_gluon: bool
    model_dtypes: frozenset[str] | None
    kv_dtypes: frozenset[str] | None  # besides a cache of the model's own dtype where ``same_dtype_cache``
    same_dtype_cache: bool
    max_heads: int | None
    latent_dim: int | None
    rope_dim: int | None
    splits: SplitRule
    when: str = ""


#: A call runs on :data:`WS` only if each CTA gets at least this many tokens (context over its splits). Routed
#: against the wgmma kernel at its own split count (H100, fp8 e4m3 cache, bf16 query): 1.04x faster at 1024
#: and 1.04-1.06x at 2048 tokens a CTA with 16 heads, 1.07-1.11x with 8; at 512 0.95x with 16 heads
#: (docs/BENCHMARKS.md, "MLA decode: where the warp-specialized kernel takes over").
WS_MIN_TOKENS_PER_CTA: int = 1024
#: The warp-specialized fp8 kernel (``kvforge.kernels.gluon_mla_decode_ws``).
WS = MLAKernel(
    name="gluon_mla_ws", launcher="kvforge.kernels.gluon_mla_decode_ws:mla_decode_ws", needs_gluon=True,
    model_dtypes=SIXTEEN_BIT, kv_dtypes=FP8_KV_DTYPES, same_dtype_cache=False, max_heads=16,
    latent_dim=LATENT_DIM, rope_dim=ROPE_DIM,
    splits=SplitRule(waves=1, min_tokens=512, max_splits=128, round_up=False, forced="or_rule"),
    when=f"fp8 cache, <= 16 heads, >= {WS_MIN_TOKENS_PER_CTA} tokens a CTA",
)
#: Heads per program from which :data:`WS` runs a bf16 model-dtype query over an e4m3 cache as two e4m3 terms
#: (an fp8 score product that holds the query exactly) rather than the fp16 product from registers: 1.01-1.07x
#: faster at 16, 0.99-1.04x at 8, for a relative L2 error of 1.8-2.3e-3 against 1.7e-3 (3.5e-3 against 1.6e-3
#: with peaked scores), where one e4m3 term gives 2.8-3.7e-2 and the fp8 cache's own rounding is 2^-4 an element
#: (docs/BENCHMARKS.md).
WS_TWO_TERM_MIN_HEADS: int = 16
#: The wgmma kernel (``kvforge.kernels.gluon_mla_decode``). Its programs per SM depend on the shape
#: (:func:`wgmma_programs_per_sm`), hence ``waves=0`` in its rule. On small grids (1-8 sequences of 16 heads)
#: one wave of splits down to 64 tokens beats the 256-token floor: 1 x 4096 tokens 14.5 against 18.7 us (bf16),
#: 14.7 against 20.7 (fp8), where the fp8 rows' second wave still pays at 8 sequences of 8k-16k
#: (docs/BENCHMARKS.md, "MLA decode: split length on small grids").
WGMMA = MLAKernel(
    name="gluon_mla_wgmma", launcher="kvforge.kernels.gluon_mla_decode:mla_decode_wgmma", needs_gluon=True,
    model_dtypes=SIXTEEN_BIT, kv_dtypes=FP8_KV_DTYPES, same_dtype_cache=True, max_heads=128,
    latent_dim=LATENT_DIM, rope_dim=ROPE_DIM,
    splits=SplitRule(waves=0, min_tokens=256, max_splits=256, round_up=False, forced="or_rule",
                     one_wave_min_tokens=64),
    when="bf16/fp16 model, <= 128 heads, cache of the model dtype or fp8, latent 512 + rope 64",
)
#: The tl.dot kernel (``kvforge.kernels.triton_mla_decode``); programs per SM from :func:`tl_dot_head_blocking`.
TL_DOT = MLAKernel(
    name="tl_dot_mla", launcher="kvforge.kernels.triton_mla_decode:mla_decode", needs_gluon=False,
    model_dtypes=None, kv_dtypes=None, same_dtype_cache=True, max_heads=None, latent_dim=None, rope_dim=None,
    splits=SplitRule(waves=0, min_tokens=256, max_splits=32, round_up=True, forced="capped"),
    when="everything else",
)
#: In order of preference.
TABLE: tuple[MLAKernel, ...] = (WS, WGMMA, TL_DOT)
KERNEL_NAMES: tuple[str, ...] = tuple(k.name for k in TABLE)


@dataclass(frozen=True)
class QuantizedQueryRule:
    """Where the backend takes a quantized query: ``dtypes`` over ``kv_dtypes``, 1 to ``max_heads`` heads
    per rank, rows of ``row_widths``, models in ``model_dtypes``; ``opt_in``: why the planner takes it only
    when asked (``--query-dtype fp8``), quoted in the plan's reason."""

    dtypes: frozenset[str]
    kv_dtypes: frozenset[str]
    max_heads: int
    row_widths: frozenset[int]
    model_dtypes: frozenset[str]
    note: str
    opt_in: str


#: The e4m3 query: declared exactly where the warp-specialized kernel can run its fp8 score product.
QUANTIZED_QUERY = QuantizedQueryRule(
    dtypes=frozenset({"fp8_e4m3"}), kv_dtypes=frozenset({"fp8_e4m3"}), max_heads=WS.max_heads,
    row_widths=frozenset({LATENT_DIM + ROPE_DIM}), model_dtypes=SIXTEEN_BIT,
    note=(f"on sm_90 where a decode CTA gets >= {WS_MIN_TOKENS_PER_CTA} tokens; elsewhere the model-dtype query "
          "runs, faster there"),
    opt_in=("its decode output error was 15x the model-dtype query's (2.0-2.6e-2 against 1.7-2.0e-3 relative L2) "
            "for a 1.09-1.14x kernel speed-up, and no model-level KLD has been measured (docs/BENCHMARKS.md)"),
)
#: Above this many heads a quantized query runs the tl.dot kernel's fp8 dot; at or below it, wherever the
#: fp8 score product does not run, the model-dtype query runs instead.
FP8_QUERY_MAX_HEADS: int = QUANTIZED_QUERY.max_heads


@dataclass(frozen=True)
class MLAShape:
    """One decode call: ``num_seqs`` sequences of at most ``max_seq_len`` tokens, ``num_heads`` heads,
    ``latent_dim`` + ``rope_dim`` wide rows, the model (query) dtype, the cache dtype, and the plan's query
    dtype (None: the model dtype)."""

    num_seqs: int
    num_heads: int
    latent_dim: int
    rope_dim: int
    max_seq_len: int
    model_dtype: str
    kv_dtype: str
    query_dtype: str | None = None

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype in FP8_KV_DTYPES


# ---- the kernels' own shape rules -----------------------------------------------------------------------


def ws_heads_per_program(num_heads: int) -> int:
    """The warp-specialized kernel's heads per program (its ``wgmma`` N): 8 up to 8 heads, else 16."""
    return 8 if num_heads <= 8 else 16


def ws_splits(num_seqs: int, num_heads: int, max_seq_len: int, num_sms: int, heads_per_program: int | None = None,
              forced: int | None = None) -> int:
    """The warp-specialized kernel's split count (one CTA per SM, whole waves)."""
    programs = num_seqs * -(-num_heads // (heads_per_program or ws_heads_per_program(num_heads)))
    return WS.splits.choose(forced, programs, max_seq_len, num_sms)


def two_term_query_exact(model_dtype: str, kv_dtype: str) -> bool:
    """Whether two e4m3 terms hold the query exactly and pair with the cache in one fp8 product: a bf16 query
    (its 8 significant bits fit in two 4-bit terms; an fp16 query's 11 do not) over an e4m3 cache (an e5m2
    cache would make the product mixed-format)."""
    return model_dtype == "bfloat16" and kv_dtype == "fp8_e4m3"


def ws_two_term_query(model_dtype: str, kv_dtype: str, heads_per_program: int) -> bool:
    """Whether :data:`WS` computes a model-dtype query as two e4m3 terms: where they hold it exactly
    (:func:`two_term_query_exact`), at ``WS_TWO_TERM_MIN_HEADS`` or more heads per program."""
    return two_term_query_exact(model_dtype, kv_dtype) and heads_per_program >= WS_TWO_TERM_MIN_HEADS


def ws_takes(is_fp8: bool, num_heads: int, num_seqs: int, max_seq_len: int, num_sms: int) -> bool:
    """Whether a call the wgmma kernel accepts runs on the warp-specialized kernel instead."""
    if not is_fp8 or num_heads > WS.max_heads:
        return False
    return max_seq_len // ws_splits(num_seqs, num_heads, max_seq_len, num_sms) >= WS_MIN_TOKENS_PER_CTA


def wgmma_heads_per_program(num_heads: int) -> int:
    """The wgmma kernel's heads per program (its N: a power of two from 8 to 32)."""
    return min(32, max(8, 1 << max(0, (num_heads - 1).bit_length())))


def wgmma_programs_per_sm(is_fp8: bool, heads_per_program: int, fp8_in_registers: bool = True) -> int:
    """Programs resident per SM (shared memory decides): 2 for fp8 rows staged through registers with 4
    warps (up to 16 heads per program), else 1."""
    return 2 if is_fp8 and fp8_in_registers and heads_per_program <= 16 else 1


def wgmma_splits(num_seqs: int, num_heads: int, max_seq_len: int, num_sms: int, is_fp8: bool,
                 heads_per_program: int | None = None, fp8_in_registers: bool = True,
                 forced: int | None = None) -> int:
    """The wgmma kernel's split count: whole waves of its resident programs."""
    nh = heads_per_program or wgmma_heads_per_program(num_heads)
    programs = num_seqs * -(-num_heads // nh)
    waves = wgmma_programs_per_sm(is_fp8, nh, fp8_in_registers)
    return WGMMA.splits.choose(forced, programs, max_seq_len, num_sms, waves)


def tl_dot_head_blocking(num_heads: int) -> tuple[int, int]:
    """The tl.dot kernel's (heads per program, target programs per SM): 16 / 4 up to 16 heads, 32 / 2 up
    to 32, else 64 / 2."""
    if num_heads <= 16:
        return 16, 4
    return (32 if num_heads <= 32 else 64), 2


def tl_dot_splits(num_seqs: int, num_heads: int, max_seq_len: int, num_sms: int, heads_per_program: int | None = None,
                  programs_per_sm: int | None = None, forced: int | None = None) -> int:
    """The tl.dot kernel's split count (about ``programs_per_sm`` programs per SM, a partial wave allowed)."""
    block_h, per_sm = tl_dot_head_blocking(num_heads)
    block_h = heads_per_program or block_h
    programs = num_seqs * -(-num_heads // block_h)
    return TL_DOT.splits.choose(forced, programs, max_seq_len, num_sms, programs_per_sm or per_sm)


# ---- the decision -----------------------------------------------------------------------------------------


def wgmma_accepts(shape: MLAShape, query_dtype: str | None) -> bool:
    """The wgmma kernel's scope (which includes the warp-specialized kernel's): a bf16/fp16 model, 1 to
    ``WGMMA.max_heads`` heads, latent 512 + rope 64, a cache of the model's dtype or fp8, and the model-dtype
    query or the e4m3 query on an e4m3 cache at up to ``FP8_QUERY_MAX_HEADS`` heads."""
    fp8_query_ok = (query_dtype in QUANTIZED_QUERY.dtypes and shape.kv_dtype in QUANTIZED_QUERY.kv_dtypes
                    and shape.num_heads <= FP8_QUERY_MAX_HEADS)  # fmt: skip
    k = WGMMA
    return ((query_dtype is None or fp8_query_ok)
            and 1 <= shape.num_heads <= k.max_heads
            and shape.latent_dim == k.latent_dim and shape.rope_dim == k.rope_dim
            and shape.model_dtype in k.model_dtypes
            and (shape.kv_dtype in k.kv_dtypes or shape.kv_dtype == shape.model_dtype))  # fmt: skip


@dataclass(frozen=True)
class MLARoute:
    """One candidate: ``kernel`` (a name of :data:`TABLE`) given ``query_dtype`` (None: the model dtype;
    the wgmma kernel computes with the model-dtype query either way), ``splits`` context splits, and
    ``heads_per_program``."""

    kernel: str
    query_dtype: str | None
    splits: int
    heads_per_program: int


def _gluon_route(shape: MLAShape, query_dtype: str | None, device: Device, forced: int | None) -> MLARoute:
    n, h, length, sms = shape.num_seqs, shape.num_heads, shape.max_seq_len, device.num_sms
    if ws_takes(shape.is_fp8, h, n, length, sms):
        return MLARoute(WS.name, query_dtype, ws_splits(n, h, length, sms, forced=forced), ws_heads_per_program(h))
    nh = wgmma_heads_per_program(h)
    return MLARoute(WGMMA.name, query_dtype, wgmma_splits(n, h, length, sms, shape.is_fp8, nh, forced=forced), nh)


def tl_dot_route(shape: MLAShape, query_dtype: str | None, device: Device, forced: int | None = None) -> MLARoute:
    block_h, _ = tl_dot_head_blocking(shape.num_heads)
    splits = tl_dot_splits(shape.num_seqs, shape.num_heads, shape.max_seq_len, device.num_sms, forced=forced)
    return MLARoute(TL_DOT.name, query_dtype, splits, block_h)


def decode_candidates(shape: MLAShape, device: Device, forced_splits: int | None = None,
                      tl_dot_only: bool = False) -> tuple[MLARoute, ...]:
    """The decode kernels to try, in order; the last is always the tl.dot kernel. ``tl_dot_only``: skip the
    Gluon kernels (tests and benchmarks of the tl.dot kernel). A declared e4m3 query at up to
    ``FP8_QUERY_MAX_HEADS`` heads is tried as such first, then as the model-dtype query, on the Gluon kernels;
    it reaches the tl.dot kernel as the model-dtype query (exact, and faster there than its fp8 dot)."""
    query = shape.query_dtype
    exact_fallback = query is not None and shape.num_heads <= FP8_QUERY_MAX_HEADS and not tl_dot_only
    routes: list[MLARoute] = []
    if device.gluon and not tl_dot_only:
        for q in (query, None) if exact_fallback else (query,):
            if wgmma_accepts(shape, q):
                routes.append(_gluon_route(shape, q, device, forced_splits))
    routes.append(tl_dot_route(shape, None if exact_fallback else query, device, forced_splits))
    return tuple(routes)


def pinned_splits(batch: int, num_heads: int, latent_dim: int, rope_dim: int, max_model_len: int,
                  model_dtype: str, kv_dtype: str, query_dtype: str | None, device: Device) -> int:
    """The split count a CUDA graph of ``batch`` decode rows pins: the first candidate's at
    ``max_model_len``, the graph's context bucket (a later candidate only runs after the first ran out of resources, which happens at
    the first call, before any capture)."""
    shape = MLAShape(batch, num_heads, latent_dim, rope_dim, max_model_len, model_dtype, kv_dtype, query_dtype)
    return decode_candidates(shape, device)[0].splits


# ---- prefill ----------------------------------------------------------------------------------------------

#: How steps with a prefill chunk attend (the engine argument ``mla_prefill_mode``). "absorbed": every query
#: token runs as its own decode query over its causal prefix through the decode kernels (one launch per
#: layer, O(L^2) prefix reads per prompt). "sdpa": the latents of each prefilling sequence are expanded in
#: the model dtype for torch's fused attention. "expanded": the float32 PyTorch reference expands the latents
#: of every sequence (correct, slow). "auto": a prefilling sequence is absorbed while it is at most
#: ``ABSORBED_PREFILL_MAX_SEQ_LEN`` tokens long (prefix included), else sdpa. Under "auto" and "sdpa" a
#: decoding sequence of the step (one query token) is always absorbed: the decode kernel reads its context
#: once in latent space, where expanding it costs ``2 R (Dn + V)`` FLOPs per key and head for one query.
PREFILL_MODES: tuple[str, ...] = ("auto", "expanded", "absorbed", "sdpa")
#: Under "auto", the longest prefilling sequence that is absorbed. End to end on DeepSeek-V2-Lite, prompts of
#: 2048-3072 tokens ran 1.62x (fp8 latents) and 1.10x (bf16) faster absorbed than through sdpa, prompts of
#: 1024-2048 1.17x (bf16, cuDNN then allowed in sdpa); sdpa led at 2500-4000 tokens (bf16) and leads a layer
#: from ~2.5k tokens on (docs/BENCHMARKS.md, "Where `auto` switches").
ABSORBED_PREFILL_MAX_SEQ_LEN: int = 3072


def check_prefill_mode(value: str) -> str:
    """``value`` lower-cased, or a ValueError naming the choices."""
    mode = value.strip().lower()
    if mode not in PREFILL_MODES:
        raise ValueError(f"MLA prefill mode {value!r}: choose one of {', '.join(PREFILL_MODES)}")
    return mode


def sequence_paths(mode: str, query_lens: list[int], seq_lens: list[int]) -> list[str]:
    """Per sequence of a step with a prefill chunk: "absorbed", "sdpa" or "expanded" under the engine's
    ``mode`` (see :data:`PREFILL_MODES`)."""
    if mode in ("expanded", "absorbed"):
        return [mode] * len(query_lens)

    def path(query_len: int, seq_len: int) -> str:
        if query_len <= 1:
            return "absorbed"
        return "sdpa" if mode == "sdpa" or seq_len > ABSORBED_PREFILL_MAX_SEQ_LEN else "absorbed"

    return [path(q, n) for q, n in zip(query_lens, seq_lens)]

"""docs/ROUTING.md from the routing tables: ``python -m kvforge.attention.routing.render > docs/ROUTING.md``.

tests/test_routing_tables.py checks that the file equals :func:`render_markdown`, so the doc cannot drift
from the tables.
"""

from __future__ import annotations

from kvforge.attention.routing import delta_rule, mla, paged, platform, torch_backends
from kvforge.attention.routing.split_k import SplitRule


def _names(values) -> str:
    return "any" if values is None else ", ".join(str(v) for v in sorted(values))


def _splits(rule: SplitRule, waves: str | None = None) -> str:
    text = rule.describe()
    if waves:
        text = text.replace("waves x SMs", f"{waves} x SMs")
    pinned = {"exact": "as given", "capped": f"capped at {rule.max_splits}",
              "or_rule": f"0 means the rule; capped at {rule.max_splits}"}[rule.forced]
    return f"{text}; a pinned count: {pinned}"


def _paged_section() -> list[str]:
    rule = paged.SDPA_PREFILL
    lines = ["## triton_paged (full and sliding layers, CUDA)", "",
             "Source: `kvforge/attention/routing/paged.py`. The first row that applies serves the call.", "",
             "| kernel | launched by | Gluon gate | decode only | KV dtypes | query dtypes | head sizes | "
             "query heads per KV head | sinks | also | splits |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in paged.TABLE:
        extra = (f"context > {k.min_context}, programs x splits >= {k.min_waves} x SMs" if k.min_context
                 else f"programs >= {k.min_programs_per_sm:g} x SMs" if k.min_programs_per_sm else k.when)
        if k.tiling:
            extra += "; tiles: " + ", ".join(f"{key} {value}" for key, value in k.tiling)
        lines.append(f"| `{k.name}` | `{k.launcher}` | {'yes' if k.needs_gluon else 'no'} | "
                     f"{'yes' if k.decode_only else 'no'} | {_names(k.kv_dtypes)} | {_names(k.query_dtypes)} | "
                     f"{_names(k.head_sizes)} | {'any' if k.max_group is None else f'<= {k.max_group}'} | "
                     f"{'yes' if k.sinks else 'no'} | {extra} | {_splits(k.splits)} |")
    lines += ["", "programs = sequences x KV heads; context = the window where it is shorter than the longest "
              "sequence. The tl.dot kernel splits only decode-like batches (every sequence's query in one "
              "tile of 16 // G_PAD tokens or one power of two); CUDA graphs pin the rule's count at "
              "their context bucket (kvforge/engine/cuda_graphs.py) of the row that serves the graph's layers (a Gluon row only where it serves every "
              "one of them, so never for layers with sinks).", "",
              "**Sliding windows** run on every row. **Attention sinks** (one logit per query head, in the "
              "softmax denominator only) run on the rows marked \"sinks: yes\"; a layer with sinks skips the "
              "others. The sink enters each query row once: in the kernel's epilogue without split-K, in the "
              "merge of the partials with it (the splits' partials never hold it).", "",
              f"**Prefill through SDPA** (`kvforge/attention/paged_prefill_sdpa.py`): in an eager step whose "
              f"metadata carries the host copies of `query_start_loc` and `seq_lens`, a sequence with at least "
              f"{rule.min_query_len} query tokens runs through torch's `scaled_dot_product_attention` over its "
              f"context gathered from the cache (fp8 dequantized with the per-KV-head scales) when the layer has "
              f"no sinks, its window is none or at least the sequence's length, the head size is at most "
              f"{rule.max_head_size} and the query is {_names(rule.query_dtypes)}: `is_causal` without a cached "
              "prefix, the lower-right causal mask with one. The step's other sequences run the rows above as "
              "a batch of their own. A pinned split count (CUDA graphs), a named `kernel=` or "
              "`KVFORGE_DISABLE_SDPA_PREFILL` keeps every sequence on the kernels.", ""]
    return lines


def _mla_section() -> list[str]:
    lines = ["## triton_mla (MLA layers, CUDA)", "",
             "Source: `kvforge/attention/routing/mla.py`. Decode calls try the candidates in this order "
             "(a Gluon candidate that once ran out of shared memory or registers is skipped).", "",
             "| kernel | launched by | Gluon gate | model dtypes | KV dtypes | heads per rank | latent + rope | "
             "when | splits |",
             "|---|---|---|---|---|---|---|---|---|"]
    waves = {mla.WGMMA.name: "(2 for fp8 rows at <= 16 heads per program, else 1)",
             mla.TL_DOT.name: "(4 up to 16 heads, else 2)"}
    for k in mla.TABLE:
        kv = _names(k.kv_dtypes) + (" or the model dtype" if k.kv_dtypes is not None and k.same_dtype_cache else "")
        width = "any" if k.latent_dim is None else f"{k.latent_dim} + {k.rope_dim}"
        heads = "any" if k.max_heads is None else f"1-{k.max_heads}"
        lines.append(f"| `{k.name}` | `{k.launcher}` | {'yes' if k.needs_gluon else 'no'} | "
                     f"{_names(k.model_dtypes)} | {kv} | {heads} | {width} | {k.when} | "
                     f"{_splits(k.splits, waves.get(k.name))} |")
    q = mla.QUANTIZED_QUERY
    lines += ["", f"programs = sequences x head blocks; `{mla.WS.name}` takes a call only where "
              f"context // its splits >= {mla.WS_MIN_TOKENS_PER_CTA} tokens.", "",
              f"**Quantized query** (what the declaration offers the planner): {_names(q.dtypes)} over "
              f"{_names(q.kv_dtypes)} caches, 1-{q.max_heads} heads per rank, rows of {_names(q.row_widths)}, "
              f"{_names(q.model_dtypes)} models. It is tried first on the Gluon kernels, then as the "
              f"model-dtype query; up to {mla.FP8_QUERY_MAX_HEADS} heads the tl.dot kernel gets the model-dtype "
              f"query. The planner takes it only under `--query-dtype fp8`: {q.opt_in}.", "",
              f"**Prefill** (engine argument `--mla-prefill-mode`, one of {', '.join(mla.PREFILL_MODES)}): "
              f"`auto` absorbs a prefilling sequence of at most {mla.ABSORBED_PREFILL_MAX_SEQ_LEN} tokens "
              f"(prefix included) and expands a longer one for sdpa; under `auto` and `sdpa` the step's "
              f"decoding sequences are always absorbed.", ""]
    return lines


def _delta_rule_section() -> list[str]:
    r = delta_rule
    lines = ["## Delta-rule prefill (Gated DeltaNet and KDA state layers, CUDA)", "",
             "Source: `kvforge/attention/routing/delta_rule.py`; launched by `prefill` in "
             "`kvforge/kernels/triton_gated_delta_rule.py` (a step of one token a sequence runs `decode`, the "
             "token-by-token kernel). A caller's `chunk_size=` names the form instead.", ""]
    if r.PREFILL_CHUNK_SIZE is None:
        return lines + ["Every prefill runs token by token (`_recurrent_kernel`).", ""]
    gates = "per-head and per-channel gates" if r.PER_CHANNEL_CHUNKED else "per-head gates (per-channel: token by token)"
    short = (f"the call's sequences of fewer than {r.CHUNKED_MIN_TOKENS} tokens, where the chunked form takes the "
             "call and the caller gave each sequence's length" if r.SHORT_TOKEN_BY_TOKEN else "none (off)")
    lines += ["| form | kernels | takes |", "|---|---|---|",
              f"| chunks of {r.PREFILL_CHUNK_SIZE} | `_chunk_prep_kernel`, then `_chunk_state_kernel` | "
              f"{gates}: a call of 1-{r.CHUNKED_MAX_SEQUENCES} sequences of at least {r.CHUNKED_MIN_TOKENS} tokens "
              f"holding at least {r.CHUNKED_TOKENS_PER_SHORT} of their tokens per shorter sequence beside them "
              "(padding rows of no tokens not counted; each sequence's length where the caller gives them, else the "
              "call's mean for every one) |",
              f"| token by token, beside the chunks | `_recurrent_kernel`, after the two chunked launches | {short} |",
              "| token by token | `_recurrent_kernel` | every other call |", "",
              "The chunked form's matrix products by the inputs' dtype (`product_precision`): "
              + ", ".join(f"{d} `{p}`" for d, p in r.PRODUCT_PRECISION.items())
              + f", any other `{r.DEFAULT_PRODUCT_PRECISION}`"
              + ("; `tf32-nearest`: one tf32 product of operands rounded to nearest."
                 if "tf32-nearest" in r.PRODUCT_PRECISION.values() else "."), "",
              "The planner's activation reserve counts the chunked form's float32 buffers (`chunked_buffer_bytes`) "
              "for every state layer whose gates the route may chunk.", ""]
    return lines


def _torch_section(title: str, rows) -> list[str]:
    lines = [f"## {title}", "", "Source: `kvforge/attention/routing/torch_backends.py`.", "",
             "| path | runs | when |", "|---|---|---|"]
    lines += [f"| `{r.name}` | `{r.runs}` | {r.when} |" for r in rows]
    return lines + [""]


def render_markdown() -> str:
    lines = ["# Routing tables", "",
             "Which kernel serves a batch, per attention backend, and the form of a state layer's delta-rule "
             "prefill. Generated from `kvforge/attention/routing/` by "
             "`python -m kvforge.attention.routing.render > docs/ROUTING.md`; a test keeps the two equal.", "",
             f"**Gluon gate**: Triton {_names(platform.GLUON_TRITON_VERSIONS)}, compute capability "
             f"{platform.GLUON_COMPUTE_CAPABILITY_MAJOR}.x, and `KVFORGE_DISABLE_GLUON` unset. Where it is "
             "closed, every row marked \"Gluon gate: yes\" is skipped.", ""]
    lines += _paged_section() + _mla_section() + _delta_rule_section()
    lines += _torch_section("torch_reference (full, sliding and state layers, any device)",
                            torch_backends.TORCH_REFERENCE)
    lines += _torch_section("torch_mla_reference (MLA layers, any device)", torch_backends.MLA_REFERENCE)
    lines += _torch_section("csa_ring (per-request rings)", torch_backends.RING)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")

"""Render a KVPlan as a rich table for humans (JSON lives on KVPlan.to_json)."""

from __future__ import annotations

from kvforge.planner.inputs import DEFAULT_CPU_KV_CACHE_MEMORY
from kvforge.planner.kv_plan import KVPlan, format_concurrency


def _gib(n: int | None) -> str:
    """Bytes in GiB, or MiB below one GiB (so a small size never reads 0.00)."""
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _layer_rows(plan: KVPlan):
    """Collapse consecutive identical layers into one row (index ranges)."""
    rows = []
    for layer in plan.layers:
        key = (layer.kind, layer.backend, layer.kv_dtype, layer.query_dtype, layer.heads_per_rank,
               layer.kv_heads_per_rank, layer.bytes_per_token, layer.state_bytes, layer.query_dtype_reason,
               layer.sliding_window)
        if rows and rows[-1][0] == key and rows[-1][2] == layer.index - 1:
            rows[-1][2] = layer.index
        else:
            rows.append([key, layer.index, layer.index])
    return rows


def _indices(idx) -> str:
    """Layer indices: all of them when few, else the range, with its step when evenly spaced (every 2nd layer of
    a 1:1 hybrid reads ``0..22 every 2 (12)``, not as the 23 layers 0 to 22)."""
    idx = list(idx)
    if len(idx) <= 6:
        return ",".join(map(str, idx))
    steps = {b - a for a, b in zip(idx, idx[1:])}
    if len(steps) == 1 and (step := steps.pop()) > 1:
        return f"{idx[0]}..{idx[-1]} every {step} ({len(idx)})"
    return f"{idx[0]}..{idx[-1]} ({len(idx)})"


def render_plan(plan: KVPlan, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    cap = plan.capacity
    head = Table(title=f"KV plan: {plan.model} ({plan.architecture})", show_header=False, box=None)
    head.add_column(style="bold")
    head.add_column()
    head.add_row("platform / TP", f"{plan.platform} / {plan.tensor_parallel_size}")
    schemes = sorted({layer.scale_scheme.replace("_", "-") for layer in plan.layers if layer.scale_scheme})
    head.add_row("model dtype / KV dtype", f"{plan.model_dtype} / {plan.kv_cache_dtype}"
                 + (f" (scales: {', '.join([plan.scale_source, *schemes])})" if plan.scale_source else ""))
    head.add_row("block size", f"{plan.block_size}: {plan.block_size_reason}")
    head.add_row("max model len", f"{plan.max_model_len}" + (f": {plan.max_model_len_reason}"
                                                             if plan.max_model_len_reason else ""))
    head.add_row("bytes per token (rank)", f"{plan.bytes_per_token:,}")
    replay = plan.verify_replay_bytes_per_sequence()
    head.add_row("fixed bytes per sequence", plan.fixed_bytes_text() + (
        f" (of which {replay:,} keep a verify step's {plan.num_speculative_tokens + 1} rows to roll the "
        f"linear-attention state back)" if replay else ""))
    if plan.state_dtype is not None:
        head.add_row("state dtype", plan.state_dtype_reason)
    head.add_row("prefix caching", plan.prefix_caching_reason)
    head.add_row("weights per rank", f"{_gib(plan.weights_bytes_per_rank)} ({plan.num_parameters:,} parameters)")
    if plan.activations is not None:
        head.add_row("activations per rank", plan.activations.describe())
    if cap.num_blocks is not None:
        head.add_row("KV memory per rank", _gib(cap.kv_cache_memory))
        head.add_row("blocks / tokens", f"{cap.num_blocks:,} / {plan.capacity_text()}")
        head.add_row("max concurrency", f"{format_concurrency(cap.max_concurrency)} x {plan.max_model_len} tokens")
        if cap.chunk_bytes:
            head.add_row("sliding chunk", f"{cap.chunk_bytes:,} bytes beyond the windows while a sequence "
                                          f"computes a chunk of the step budget")
        if plan.baseline is not None and plan.baseline.capacity_tokens:
            gain = cap.capacity_tokens / plan.baseline.capacity_tokens
            head.add_row(f"vs {plan.baseline.kv_cache_dtype} KV", f"{plan.baseline.capacity_tokens:,} tokens, "
                         f"concurrency {format_concurrency(plan.baseline.max_concurrency)}: {gain:.2f}x the tokens")
            exact = plan.concurrency_gain()
            if exact is not None and plan.state_bytes_per_sequence:
                state = sum(layer.state_bytes for layer in plan.layers if layer.kind == "state")
                head.add_row("concurrency gain (exact)",
                             f"{plan.baseline.bytes_per_sequence:,} / {cap.bytes_per_sequence:,} bytes per sequence "
                             f"= {exact:.4f}x" + (" (linear-attention state keeps its dtype)" if state else ""))
    else:
        if plan.platform == "cpu":
            note = (f"no --kv-cache-memory given: the CPU engine takes {_gib(DEFAULT_CPU_KV_CACHE_MEMORY)} unless "
                    "--kv-cache-memory sets another size")
        else:
            note = "no memory given (--kv-cache-memory or --gpu-memory)"
        head.add_row("capacity", note)
    if plan.draft is not None:
        head.add_row("speculative draft", plan.draft_explanation())
    elif plan.num_speculative_tokens:
        head.add_row("speculative decoding", f"{plan.num_speculative_tokens} proposed tokens a step, verified in "
                                             f"{plan.num_speculative_tokens + 1} rows a sequence; the proposer "
                                             f"holds no KV (n-gram)")
    console.print(head)

    layers = Table(title="layers (per rank)")
    for col in ("layers", "kind", "backend", "KV", "query", "heads", "KV heads", "bytes/token", "why query"):
        layers.add_column(col)
    reasons: list[str] = []
    for key, lo, hi in _layer_rows(plan):
        kind, backend, kv, q, h, kvh, bpt, state, reason, window = key
        if reason not in reasons:
            reasons.append(reason)
        if kind == "state":  # no KV cache, no attention query, no attention backend: the state's dtype and bytes
            kv, q, per, backend = f"state {kv}", "-", f"state {state:,} B/seq", "-"
        elif kind == "sliding":  # bounded by the window: its blocks are counted per sequence, not per token
            per = f"{window}-token window"
        else:
            per = f"{bpt:,}"
        layers.add_row(f"{lo}" if lo == hi else f"{lo}-{hi}", kind, backend, kv, q, str(h), str(kvh), per,
                       f"[{reasons.index(reason) + 1}]")
    console.print(layers)
    for i, reason in enumerate(reasons, 1):
        console.print(f"  [{i}] {reason}")

    groups = Table(title=f"KV cache groups (group size {plan.group_size}, padding layers {plan.padding_layers}, "
                   f"worst-case waste {plan.worst_case_waste_pct:.1f}%)")
    columns = ("kind", "layers") + (("draft layers",) if plan.draft is not None else ()) + (
        "block", "page bytes", "unpadded", "padding layers", "backend")
    for col in columns:
        groups.add_column(col)
    for g in plan.groups:
        draft = (_indices(g.draft_layers) or "-",) if plan.draft is not None else ()
        groups.add_row(g.kind, _indices(g.layers) or "-", *draft, str(g.block_size), f"{g.page_bytes:,}",
                       f"{g.page_bytes_unpadded:,}", str(g.padding_layers), g.backend)
    console.print(groups)
    if plan.draft is not None:
        name = plan.draft.model if plan.draft.model.endswith(("layer", "layers")) else f"{plan.draft.model} layers"
        draft_layers = Table(title=f"draft {name} (per rank), in the groups above")
        for col in ("layers", "kind", "backend", "KV", "query", "heads", "KV heads", "bytes/token"):
            draft_layers.add_column(col)
        for layer in plan.draft.layers:
            draft_layers.add_row(str(layer.index), layer.kind, layer.backend, layer.kv_dtype, layer.query_dtype,
                                 str(layer.heads_per_rank), str(layer.kv_heads_per_rank), f"{layer.bytes_per_token:,}")
        console.print(draft_layers)
        alone = plan.draft.capacity_without
        if alone.num_blocks is not None and cap.num_blocks is not None:
            console.print(f"capacity with the draft: {cap.num_blocks:,} blocks / {cap.capacity_tokens:,} tokens, "
                          f"max concurrency {format_concurrency(cap.max_concurrency)}; without: {alone.num_blocks:,} "
                          f"blocks / {alone.capacity_tokens:,} tokens, max concurrency "
                          f"{format_concurrency(alone.max_concurrency)}")
    for check in plan.index_checks:
        console.print(f"index check {check.backend}: {check.planned_slots:,} slots of {check.row_bytes} B "
                      f"<= {check.max_slots:,} addressable: {'ok' if check.ok else 'OVERFLOW'}")
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")

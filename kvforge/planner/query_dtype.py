"""Rule 3 of the resolver: the attention query's dtype, per layer, with the reason the plan prints.

``--query-dtype`` (``CacheConfig.query_dtype``) chooses among:

* ``model``: the model dtype on every layer.
* ``auto`` (the default): the model dtype, except where a backend declares a quantized query that accepts
  the layer *and* does not mark it opt-in (``QuantizedQuery.opt_in`` empty). The one quantized query the
  built-in backends declare (``triton_mla``'s e4m3 query over an fp8 e4m3 latent cache) is opt-in, so with
  them ``auto`` plans the model dtype everywhere and the reason quotes the evidence that decided it.
* ``fp8``: the quantized query the backend declares, on every attention layer. A layer whose KV cache is
  not quantized, or whose backend does not accept a quantized query there, makes the plan fail (before
  any weight is read), naming the layers, the backend's reason and the fix.

Whatever the query dtype, an fp8 KV cache's dequantization scale is folded into the softmax scale.
"""

from __future__ import annotations

from kvforge.errors import PlanError
from kvforge.kv_dtypes import is_quantized

_FOLDED = "KV dequant scale folded into the softmax scale"


def _rejection(layer, model_dtype: str) -> str | None:
    """Why ``layer``'s backend does not take a quantized query here, or None when it does."""
    if not is_quantized(layer.kv_dtype):
        return f"KV cache is {layer.kv_dtype} (not quantized)"
    rule = layer.backend.quantized_query
    name = layer.backend.name
    if rule.accepts(layer.kv_dtype, layer.heads_per_rank, model_dtype, layer.head_size or 0):
        return None
    if layer.kv_dtype not in rule.kv_dtypes:
        return f"{name} does not declare a quantized query for {layer.kv_dtype} KV"
    if model_dtype not in rule.model_dtypes:
        return (f"{name} quantizes the query only for {', '.join(sorted(rule.model_dtypes))} models; "
                f"this model is {model_dtype}")
    if rule.head_sizes is not None and (layer.head_size or 0) not in rule.head_sizes:
        what = "row width (kv_lora_rank + rope)" if layer.kind == "mla" else "head size"
        return (f"{name} accepts an {layer.kv_dtype} query only for {what} "
                f"{', '.join(map(str, sorted(rule.head_sizes)))}; this layer has {layer.head_size}")
    if layer.heads_per_rank < rule.min_heads_per_rank:
        return (f"{name} accepts an {layer.kv_dtype} query only from {rule.min_heads_per_rank} heads per rank; "
                f"this layer has {layer.heads_per_rank}")
    return (f"{name} accepts an {layer.kv_dtype} query only up to {rule.max_heads_per_rank} heads per rank; "
            f"this layer has {layer.heads_per_rank}")


def _quantized(layer) -> tuple[str, str]:
    rule = layer.backend.quantized_query
    return layer.kv_dtype, (f"{layer.backend.name} declares an {layer.kv_dtype} query with {layer.kv_dtype} KV "
                            f"{rule.heads_range()} heads per rank; this layer has {layer.heads_per_rank}: "
                            f"{layer.kv_dtype} dot" + (f" ({rule.note})" if rule.note else ""))


def _layer_query_dtype(layer, model_dtype: str, choice: str) -> tuple[str, str]:
    """(query dtype, reason) for one layer (``layer``: kind, kv_dtype, backend, heads_per_rank, head_size);
    ``choice`` is ``--query-dtype`` (``fp8`` only for layers that take it, checked by the caller)."""
    if layer.kind == "state":
        return model_dtype, ("state layer: no KV cache, no attention query or backend (its state update is routed "
                             "per call: docs/LINEAR_ATTENTION.md)")
    if choice == "fp8":
        dtype, why = _quantized(layer)
        return dtype, f"--query-dtype fp8: {why}"
    if not is_quantized(layer.kv_dtype):
        return model_dtype, f"KV cache is {layer.kv_dtype} (not quantized): query uses the model dtype {model_dtype}"
    why_not = _rejection(layer, model_dtype)
    if why_not is not None:
        return model_dtype, f"{why_not}: query stays {model_dtype}, {_FOLDED}"
    name, opt_in = layer.backend.name, layer.backend.quantized_query.opt_in
    if choice == "model":
        return model_dtype, (f"{name} declares an {layer.kv_dtype} query here, but --query-dtype model keeps "
                             f"{model_dtype}, {_FOLDED}")
    if opt_in:
        return model_dtype, (f"{name} declares an {layer.kv_dtype} query here, opt-in only (--query-dtype fp8): "
                             f"{opt_in}; query stays {model_dtype}, {_FOLDED}")
    return _quantized(layer)


def plan_query_dtypes(layers, model_dtype: str, choice: str, ranges, platform: str) -> list[tuple[str, str]]:
    """(query dtype, reason) per layer, in order. Under ``--query-dtype fp8`` every attention layer must take
    the quantized query; otherwise one PlanError lists the layers (``ranges`` formats indices) and why, and
    on a CPU plan says that the GPU backends are planned with ``--device cuda``."""
    refused: dict[str, list[int]] = {}
    for layer in layers:
        why = _rejection(layer, model_dtype) if choice == "fp8" and layer.kind != "state" else None
        if why is not None:
            refused.setdefault(why, []).append(layer.spec.index)
    if refused:
        listing = "\n".join(f"  - layers {ranges(idx)}: {why}" for why, idx in refused.items())
        raise PlanError(f"--query-dtype fp8: these layers cannot take a quantized (fp8) attention query:\n{listing}\n"
                        "fix: drop --query-dtype fp8 (auto keeps the model-dtype query); the fp8 query needs an "
                        "fp8_e4m3 KV cache (--kv-cache-dtype fp8) and a backend that declares it for the layer "
                        "(`kvforge plan` shows each layer's backend and why)"
                        + ("; this plan is for CPU: `kvforge plan --device cuda` plans the GPU backends"
                           if platform == "cpu" else ""))
    return [_layer_query_dtype(layer, model_dtype, choice) for layer in layers]

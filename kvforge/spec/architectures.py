"""Hugging Face config dict -> ModelSpec, one builder per architecture.

Field names are those of transformers' config classes. Each builder validates
what the planner relies on and raises ConfigError naming the field otherwise.
Parameter counts include every weight (all experts of MoE layers) so the plan
can say whether weights fit; norms and biases are counted where the
architecture has them.
"""

from __future__ import annotations

from collections.abc import Callable

from kvforge.errors import ConfigError
from kvforge.kv_dtypes import canonical_model_dtype
from kvforge.spec.layers import AttentionLayerSpec, LayerSpec, MLALayerSpec, RingSpec, StateLayerSpec
from kvforge.spec.model_spec import ModelSpec
from kvforge.spec.tp_split_sizes import tp_split_sizes


def _get(cfg: dict, key: str, *, default=None, required: bool = True, kind=int, minimum: int | None = 1):
    """Read one positive integer (or other typed) field with a clear error."""
    value = cfg.get(key, default)
    if value is None:
        if required:
            raise ConfigError(f"config.json is missing required field {key!r} for {cfg.get('architectures')}")
        return None
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ConfigError(f"config field {key!r} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(f"config field {key!r} must be >= {minimum}, got {value}")
    return value


def _model_dtype(cfg: dict) -> str:
    raw = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    try:
        return canonical_model_dtype(raw)
    except ConfigError:
        return "bfloat16"


def _head_dim(cfg: dict) -> int:
    if cfg.get("head_dim") is not None:
        return _get(cfg, "head_dim")
    hidden = _get(cfg, "hidden_size")
    heads = _get(cfg, "num_attention_heads")
    if hidden % heads:
        raise ConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}; set head_dim")
    return hidden // heads


def _check_gqa(heads: int, kv_heads: int) -> None:
    if heads % kv_heads:
        raise ConfigError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )


def _embedding_params(cfg: dict) -> int:
    vocab, hidden = _get(cfg, "vocab_size"), _get(cfg, "hidden_size")
    tied = bool(cfg.get("tie_word_embeddings", False))
    return vocab * hidden * (1 if tied else 2) + hidden  # + final norm


def _attention_params(hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool, qk_norm: bool) -> int:
    q = hidden * heads * head_dim
    kv = 2 * hidden * kv_heads * head_dim
    o = heads * head_dim * hidden
    extra = (heads + 2 * kv_heads) * head_dim if bias else 0
    norms = 2 * head_dim if qk_norm else 0
    return q + kv + o + extra + norms


def _layer_types(cfg: dict, n: int, default: Callable[[int], str]) -> list[str]:
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n:
            raise ConfigError(f"config field 'layer_types' must list {n} entries, got {types!r}")
        return list(types)
    return [default(i) for i in range(n)]


def dense_sliding_windows(cfg: dict, arch: str, n: int) -> list[int | None]:
    """Each layer's sliding window (None: full attention) in a Llama-family model, for the plan and for the
    model code (kvforge/models/llama.py) alike: ``layer_types`` when it lists every layer ("sliding_attention" slides);
    else Mistral slides every layer; else Qwen with ``use_sliding_window`` slides the layers from
    ``max_window_layers`` on; else no layer slides."""
    if not cfg.get("sliding_window"):  # None or 0: no window, as the model code reads it
        return [None] * n
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        window = _get(cfg, "sliding_window")
        return [window if t == "sliding_attention" else None for t in types]
    if arch == "MistralForCausalLM":
        return [_get(cfg, "sliding_window")] * n
    if arch.startswith("Qwen") and cfg.get("use_sliding_window"):
        first = _get(cfg, "max_window_layers", required=False, minimum=0) or 0
        return [_get(cfg, "sliding_window") if i >= first else None for i in range(n)]
    return [None] * n


def _dense_llama(cfg: dict, arch: str, *, bias: bool = False, qk_norm: bool = False) -> tuple[list[LayerSpec], int]:
    n = _get(cfg, "num_hidden_layers")
    heads = _get(cfg, "num_attention_heads")
    kv_heads = _get(cfg, "num_key_value_heads", default=heads)
    _check_gqa(heads, kv_heads)
    head_dim = _head_dim(cfg)
    hidden = _get(cfg, "hidden_size")
    inter = _get(cfg, "intermediate_size")
    windows = dense_sliding_windows(cfg, arch, n)
    layers: list[LayerSpec] = [
        AttentionLayerSpec(
            index=i,
            kind="sliding" if windows[i] else "full",
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim_k=head_dim,
            head_dim_v=head_dim,
            sliding_window=windows[i],
        )
        for i in range(n)
    ]
    per_layer = _attention_params(hidden, heads, kv_heads, head_dim, bias, qk_norm) + 3 * hidden * inter + 2 * hidden
    return layers, _embedding_params(cfg) + n * per_layer


def _llama(cfg: dict, arch: str):
    return _dense_llama(cfg, arch, bias=bool(cfg.get("attention_bias", False)))


def _qwen2(cfg: dict, arch: str):
    return _dense_llama(cfg, arch, bias=True)


def _qwen3(cfg: dict, arch: str):
    return _dense_llama(cfg, arch, qk_norm=True)


def _gemma3(cfg: dict, arch: str):
    n = _get(cfg, "num_hidden_layers")
    heads = _get(cfg, "num_attention_heads")
    kv_heads = _get(cfg, "num_key_value_heads", default=heads)
    _check_gqa(heads, kv_heads)
    head_dim = _get(cfg, "head_dim", default=256)
    window = _get(cfg, "sliding_window", default=4096)
    pattern = _get(cfg, "sliding_window_pattern", default=6)
    types = _layer_types(cfg, n, lambda i: "full_attention" if (i + 1) % pattern == 0 else "sliding_attention")
    layers = [
        AttentionLayerSpec(i, "sliding" if t == "sliding_attention" else "full", heads, kv_heads, head_dim, head_dim,
                           window if t == "sliding_attention" else None)
        for i, t in enumerate(types)
    ]
    hidden, inter = _get(cfg, "hidden_size"), _get(cfg, "intermediate_size")
    per_layer = _attention_params(hidden, heads, kv_heads, head_dim, False, True) + 3 * hidden * inter + 4 * hidden
    cfg_tied = dict(cfg, tie_word_embeddings=cfg.get("tie_word_embeddings", True))
    return layers, _embedding_params(cfg_tied) + n * per_layer


def _gpt_oss(cfg: dict, arch: str):
    n = _get(cfg, "num_hidden_layers")
    heads = _get(cfg, "num_attention_heads")
    kv_heads = _get(cfg, "num_key_value_heads")
    _check_gqa(heads, kv_heads)
    head_dim = _get(cfg, "head_dim", default=64)
    window = _get(cfg, "sliding_window", default=128)
    types = _layer_types(cfg, n, lambda i: "sliding_attention" if i % 2 == 0 else "full_attention")
    layers = [
        AttentionLayerSpec(i, "sliding" if t == "sliding_attention" else "full", heads, kv_heads, head_dim, head_dim,
                           window if t == "sliding_attention" else None, sinks=True)
        for i, t in enumerate(types)
    ]
    hidden, inter = _get(cfg, "hidden_size"), _get(cfg, "intermediate_size")
    experts = _get(cfg, "num_local_experts", default=32)
    expert = 3 * hidden * inter + 2 * inter + hidden  # gate_up (fused) + down, with biases
    per_layer = (_attention_params(hidden, heads, kv_heads, head_dim, True, False) + heads  # sinks
                 + experts * expert + hidden * experts + experts + 2 * hidden)
    return layers, _embedding_params(cfg) + n * per_layer


def _mla_layer(cfg: dict, index: int) -> tuple[MLALayerSpec, int]:
    """One MLA layer's spec and its attention parameter count (DeepSeek field names)."""
    heads = _get(cfg, "num_attention_heads")
    hidden = _get(cfg, "hidden_size")
    kv_lora = _get(cfg, "kv_lora_rank")
    rope = _get(cfg, "qk_rope_head_dim")
    nope = _get(cfg, "qk_nope_head_dim")
    v_dim = _get(cfg, "v_head_dim")
    q_lora = _get(cfg, "q_lora_rank", required=False)
    qk = nope + rope
    if q_lora:
        q_params = hidden * q_lora + q_lora + q_lora * heads * qk
    else:
        q_params = hidden * heads * qk
    attn = (q_params + hidden * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim)
            + heads * v_dim * hidden)
    return MLALayerSpec(index, heads, kv_lora, rope, nope, v_dim), attn


def _deepseek_layer_params(cfg: dict, index: int) -> int:
    """Parameters of DeepSeek decoder layer ``index``: MLA, its MLP (MoE or dense by the config's rule)
    and its two norms."""
    hidden = _get(cfg, "hidden_size")
    inter = _get(cfg, "intermediate_size")
    moe_inter = _get(cfg, "moe_intermediate_size", required=False) or inter
    routed = _get(cfg, "n_routed_experts", required=False, minimum=0) or 0
    shared = _get(cfg, "n_shared_experts", required=False, minimum=0) or 0
    first_dense = _get(cfg, "first_k_dense_replace", default=0, minimum=0)
    freq = _get(cfg, "moe_layer_freq", default=1)
    if routed > 0 and index >= first_dense and index % freq == 0:
        mlp = (routed + shared) * 3 * hidden * moe_inter + hidden * routed
    else:
        mlp = 3 * hidden * inter
    return _mla_layer(cfg, index)[1] + mlp + 2 * hidden


def _deepseek(cfg: dict, arch: str):
    n = _get(cfg, "num_hidden_layers")
    layers = [_mla_layer(cfg, i)[0] for i in range(n)]
    return layers, _embedding_params(cfg) + sum(_deepseek_layer_params(cfg, i) for i in range(n))


def deepseek_mtp_layer(cfg: dict) -> tuple[MLALayerSpec, int]:
    """The first multi-token-prediction layer of a DeepSeek-V3 config (index ``num_hidden_layers``) and its
    parameters: a decoder layer plus its embedding, head, ``eh_proj`` and three norms
    (kvforge/models/deepseek_mtp.py)."""
    n = _get(cfg, "num_hidden_layers")
    hidden, vocab = _get(cfg, "hidden_size"), _get(cfg, "vocab_size")
    extra = 2 * vocab * hidden + 2 * hidden * hidden + 3 * hidden
    return _mla_layer(cfg, n)[0], _deepseek_layer_params(cfg, n) + extra


def _qwen3_next(cfg: dict, arch: str):
    n = _get(cfg, "num_hidden_layers")
    heads = _get(cfg, "num_attention_heads")
    kv_heads = _get(cfg, "num_key_value_heads")
    _check_gqa(heads, kv_heads)
    head_dim = _get(cfg, "head_dim", default=256)
    interval = _get(cfg, "full_attention_interval", default=4)
    types = _layer_types(cfg, n, lambda i: "full_attention" if (i + 1) % interval == 0 else "linear_attention")
    v_heads = _get(cfg, "linear_num_value_heads")
    k_heads = _get(cfg, "linear_num_key_heads")
    k_dim = _get(cfg, "linear_key_head_dim")
    v_dim = _get(cfg, "linear_value_head_dim")
    conv = _get(cfg, "linear_conv_kernel_dim", default=4)
    key_total, value_total = k_heads * k_dim, v_heads * v_dim
    # Gated DeltaNet state per sequence: the recurrent state (v_heads x k_dim x v_dim)
    # plus the causal-conv history ((conv - 1) x (2 * key_total + value_total)).
    state = v_heads * k_dim * v_dim + (conv - 1) * (2 * key_total + value_total)
    split = (("linear_num_key_heads", k_heads), ("linear_num_value_heads", v_heads))
    # One token's inputs to the state update: the conv input, then k, v, one gate and one beta per value head.
    inputs = (2 * key_total + value_total) + key_total + value_total + 2 * v_heads
    dtype = _model_dtype(cfg)
    layers: list[LayerSpec] = []
    for i, t in enumerate(types):
        if t == "linear_attention":
            layers.append(StateLayerSpec(i, state_elements=state, tp_divisible_elements=state, state_dtype=dtype,
                                         split_heads=split, token_input_elements=inputs, value_heads=v_heads,
                                         key_dim=k_dim, value_dim=v_dim))
        else:
            layers.append(AttentionLayerSpec(i, "full", heads, kv_heads, head_dim, head_dim))
    hidden = _get(cfg, "hidden_size")
    lin_attn = hidden * (2 * key_total + 2 * value_total + 2 * v_heads) + value_total * hidden + conv * (
        2 * key_total + value_total)
    full_attn, mlp = _qwen3_next_full_attention_params(cfg), _qwen3_next_mlp_params(cfg)
    total = _embedding_params(cfg)
    for layer in layers:
        total += (lin_attn if layer.kind == "state" else full_attn) + mlp + 2 * hidden
    return layers, total


def _qwen3_next_full_attention_params(cfg: dict) -> int:
    """A Qwen3-Next gated attention block: q (with its output gate), k, v, o and the two head norms."""
    hidden, heads = _get(cfg, "hidden_size"), _get(cfg, "num_attention_heads")
    head_dim = _get(cfg, "head_dim", default=256)
    return (_attention_params(hidden, heads, _get(cfg, "num_key_value_heads"), head_dim, False, True)
            + hidden * heads * head_dim)


def _qwen3_next_mlp_params(cfg: dict) -> int:
    """A Qwen3-Next MoE block: the routed experts, the shared expert and the router (counted for every layer)."""
    hidden = _get(cfg, "hidden_size")
    moe_inter = _get(cfg, "moe_intermediate_size", required=False) or _get(cfg, "intermediate_size")
    experts = _get(cfg, "num_experts", default=0, minimum=0)
    shared_inter = _get(cfg, "shared_expert_intermediate_size", default=0, minimum=0)
    return experts * 3 * hidden * moe_inter + 3 * hidden * shared_inter + hidden * experts


def qwen3_next_mtp_layer(cfg: dict) -> tuple[AttentionLayerSpec, int]:
    """The first multi-token-prediction layer of a Qwen3-Next config, planned at index ``num_hidden_layers``
    (checkpoint ``mtp.layers.0``: gated full attention and MoE), and its parameters: that layer plus ``fc``
    and three norms (it shares the target's embedding and head; kvforge/models/qwen3_next_mtp.py)."""
    n = _get(cfg, "num_hidden_layers")
    hidden, heads, kv_heads = _get(cfg, "hidden_size"), _get(cfg, "num_attention_heads"), _get(cfg, "num_key_value_heads")
    head_dim = _get(cfg, "head_dim", default=256)
    layer = AttentionLayerSpec(n, "full", heads, kv_heads, head_dim, head_dim)
    params = _qwen3_next_full_attention_params(cfg) + _qwen3_next_mlp_params(cfg) + 2 * hidden
    return layer, params + 2 * hidden * hidden + 3 * hidden


def _kimi_linear(cfg: dict, arch: str):
    """KDA layers (a per-sequence state) and MLA layers (a latent cache); saved or hub config keys."""
    n = _get(cfg, "num_hidden_layers")
    hidden = _get(cfg, "hidden_size")
    lin = cfg.get("linear_attn_config") or {}
    head_dim = _get(dict(lin, **cfg), "linear_head_dim", default=lin.get("head_dim", 128))
    num_heads = _get(dict(lin, **cfg), "linear_num_heads", default=lin.get("num_heads", 32))
    conv = _get(dict(lin, **cfg), "linear_conv_kernel_dim", default=lin.get("short_conv_kernel_size", 4))
    if conv < 2:
        raise ConfigError(f"the short conv kernel size must be >= 2, got {conv}")
    if cfg.get("layer_types") is None and "full_attn_layers" in lin:
        full = {int(i) - 1 for i in lin["full_attn_layers"]}  # 1-indexed in the checkpoint config
        types = ["full_attention" if i in full else "linear_attention" for i in range(n)]
    else:
        types = _layer_types(cfg, n, lambda i: "full_attention" if i and i % 4 == 0 else "linear_attention")
    width = num_heads * head_dim
    # KDA state per sequence: the recurrent state (heads x head_dim x head_dim) plus the causal-conv
    # history of q, k and v ((conv - 1) x 3 * width).
    state = num_heads * head_dim * head_dim + (conv - 1) * 3 * width
    # One token's inputs to the state update: the conv input (q, k, v), then k, v, the per-channel gate and
    # one beta per head.
    inputs = 3 * width + 3 * width + num_heads
    kda_params = (3 * hidden * width + 3 * width * conv + hidden * head_dim + head_dim * width + width + num_heads
                  + hidden * num_heads + hidden * head_dim + head_dim * width + head_dim + width * hidden)
    dtype = _model_dtype(cfg)
    inter = _get(cfg, "intermediate_size")
    moe_inter = _get(cfg, "moe_intermediate_size", required=False) or inter
    routed = next((cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(k)), 0)
    shared = next((cfg[k] for k in ("num_shared_experts", "n_shared_experts") if cfg.get(k)), 0)
    mlp_types = cfg.get("mlp_layer_types") or [
        "dense" if i < _get(cfg, "first_k_dense_replace", default=1, minimum=0) else "sparse" for i in range(n)]
    layers: list[LayerSpec] = []
    total = _embedding_params(dict(cfg, tie_word_embeddings=False))  # an untied head, as the model loads it
    for i, t in enumerate(types):
        if t == "linear_attention":
            layers.append(StateLayerSpec(i, state_elements=state, tp_divisible_elements=state, state_dtype=dtype,
                                         split_heads=(("linear_num_heads", num_heads),), token_input_elements=inputs,
                                         value_heads=num_heads, key_dim=head_dim, value_dim=head_dim,
                                         per_channel_gates=True))
            attn = kda_params
        else:
            layer, attn = _mla_layer(cfg, i)
            layers.append(layer)
        if mlp_types[i] == "sparse":
            mlp = (routed + shared) * 3 * hidden * moe_inter + hidden * routed + routed
        else:
            mlp = 3 * hidden * inter
        total += attn + mlp + 2 * hidden
    return layers, total


def _csa_ring(cfg: dict, arch: str):
    layers, params = _dense_llama(cfg, arch)
    rows = _get(cfg, "ring_rows", default=7)
    row_bytes = _get(cfg, "ring_row_bytes", default=1024)
    hidden = _get(cfg, "hidden_size")
    rings = tuple(RingSpec(layer.index, rows, row_bytes) for layer in layers)
    # Each layer owns a projection hidden -> ring_row_bytes (one ring row per token).
    return (layers, rings), params + len(layers) * hidden * row_bytes


_BUILDERS: dict[str, Callable] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma3ForCausalLM": _gemma3,
    "GptOssForCausalLM": _gpt_oss,
    "DeepseekV2ForCausalLM": _deepseek,
    "DeepseekV3ForCausalLM": _deepseek,
    "Qwen3NextForCausalLM": _qwen3_next,
    "KimiLinearForCausalLM": _kimi_linear,
    "CsaRingTestForCausalLM": _csa_ring,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_BUILDERS)

# Multimodal wrappers whose text decoder runs on its own: wrapper -> the text architecture.
TEXT_MODELS_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
_CARRIED_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype")


def text_model_config(cfg: dict) -> dict:
    """A multimodal wrapper's config -> its text decoder's config (images are not served); others unchanged.

    The text config is ``text_config`` with the text architecture, and the
    wrapper's token ids and dtype where the text config lacks them. The
    wrapper's checkpoint tensors load into the text model by their
    ``language_model`` names; vision tensors are skipped.
    """
    archs = cfg.get("architectures") or []
    text_arch = TEXT_MODELS_OF_MULTIMODAL.get(archs[0]) if isinstance(archs, list) and archs else None
    if text_arch is None:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{archs[0]} config has no 'text_config' object; it cannot run its text model")
    out = dict(text, architectures=[text_arch])
    for key in _CARRIED_TOKENS:
        if out.get(key) is None and cfg.get(key) is not None:
            out[key] = cfg[key]
    out.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    return out


def spec_from_hf_config(cfg: dict, *, name: str, source: str) -> ModelSpec:
    """Build a ModelSpec from a transformers-style config dict (multimodal wrappers: their text model)."""
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: config must be a JSON object, got {type(cfg).__name__}")
    cfg = text_model_config(cfg)
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ConfigError(
            f"{source}: config has no 'architectures' list; set it to one of: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = archs[0]
    builder = _BUILDERS.get(arch)
    if builder is None:
        raise ConfigError(
            f"{source}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    built, params = builder(cfg, arch)
    layers, rings = built if isinstance(built, tuple) else (built, ())
    return ModelSpec(
        architecture=arch,
        name=name,
        layers=tuple(layers),
        rings=tuple(rings),
        model_dtype=_model_dtype(cfg),
        hidden_size=_get(cfg, "hidden_size"),
        vocab_size=_get(cfg, "vocab_size"),
        num_parameters=int(params),
        max_position_embeddings=_get(cfg, "max_position_embeddings", required=False),
        source=source,
        tp_split_sizes=tp_split_sizes(cfg, arch),
        hf_config=dict(cfg),
    )

"""Gemma 3 text model (``Gemma3ForCausalLM``), device-agnostic PyTorch.

What differs from Llama:

* two rope tables: sliding layers use the local base (``rope_local_base_freq``,
  or ``rope_parameters["sliding_attention"]``), full layers the global one with
  its scaling (``rope_theta`` + ``rope_scaling``, or
  ``rope_parameters["full_attention"]``);
* ``layer_types`` (or every ``sliding_window_pattern``-th layer full) decides
  which layers slide over the last ``sliding_window`` tokens;
* softmax scale ``query_pre_attn_scalar ** -0.5``; per-head RMSNorm of q and k;
* four norms per layer (input, post-attention, pre- and post-feedforward), all
  Gemma-style: ``x / rms(x) * (1 + weight)`` in float32, cast back;
* GeGLU MLP (``hidden_activation``, gelu with the tanh approximation);
* embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the weight dtype),
  the LM head tied to them, and optional final logit soft-capping
  ``cap * tanh(logits / cap)``.

Attention logit soft-capping (``attn_logit_softcapping``) is refused: no
attention backend here implements it, and Gemma 3 checkpoints leave it unset.
q/k/v are fused into ``self_attn.qkv_proj`` and gate/up into
``mlp.gate_up_proj``; every other parameter keeps its HF name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvforge.errors import ConfigError
from kvforge.models.decoder import DecoderArgs, DecoderForCausalLM, attention_and_mlp_parts
from kvforge.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, cfg_get, rope_parameters
from kvforge.models.linear_route import Linear

SLIDING, FULL = "sliding_attention", "full_attention"
_DEFAULT_THETA = {SLIDING: 10_000.0, FULL: 1_000_000.0}


def gemma3_layer_types(config: dict, num_layers: int) -> list[str]:
    """``layer_types`` from the config, else every ``sliding_window_pattern``-th layer (default 6) is full."""
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers or set(types) - {SLIDING, FULL}:
            raise ConfigError(f"config 'layer_types' must list {num_layers} entries of {SLIDING!r} / {FULL!r}, "
                              f"got {types!r}")
        return list(types)
    pattern = int(cfg_get(config, "sliding_window_pattern", 6))
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]


def gemma3_rope(config: dict) -> dict[str, tuple[float, dict | None]]:
    """Layer type -> (rope theta, rope scaling or None), from transformers 5.x or 4.x config keys."""
    params = config.get("rope_parameters")
    out = {}
    if isinstance(params, dict) and (SLIDING in params or FULL in params):
        for t in (SLIDING, FULL):
            p = dict(params.get(t) or {})
            p.setdefault("rope_theta", _DEFAULT_THETA[t])
            out[t] = rope_parameters({"rope_parameters": p})
        return out
    theta, scaling = rope_parameters(dict(config, rope_theta=cfg_get(config, "rope_theta", _DEFAULT_THETA[FULL])))
    out[FULL] = (theta, scaling)
    out[SLIDING] = (float(cfg_get(config, "rope_local_base_freq", _DEFAULT_THETA[SLIDING])), None)
    return out


# A multimodal Gemma 3 checkpoint stores the text decoder under these prefixes (transformers 5.x, then 4.x).
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


def text_tensor_name(name: str) -> str | None:
    """A checkpoint tensor name -> its text-model name; None for vision tensors (not served)."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, repl in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return repl + name[len(prefix):]
    return name


class Gemma3Args(DecoderArgs):
    """The numbers the model needs, validated, from an HF ``Gemma3ForCausalLM`` config dict."""

    FAMILY = "Gemma 3"
    ARCHITECTURES = ("Gemma3ForCausalLM",)
    DEFAULT_ARCH = "Gemma3ForCausalLM"

    def __init__(self, config: dict):
        super().__init__(config)
        self.read_grouped_query_heads(config, default_head_dim=256)
        self.hidden_act = cfg_get(config, "hidden_activation", cfg_get(config, "hidden_act", "gelu_pytorch_tanh"))
        self.tie_word_embeddings = bool(cfg_get(config, "tie_word_embeddings", True))
        self.attention_bias = bool(cfg_get(config, "attention_bias", False))
        self.softmax_scale = float(cfg_get(config, "query_pre_attn_scalar", 256)) ** -0.5
        self.final_logit_softcapping = config.get("final_logit_softcapping")
        if config.get("attn_logit_softcapping") is not None:
            raise ConfigError(
                f"attn_logit_softcapping={config['attn_logit_softcapping']} is not supported (no attention backend "
                "soft-caps scores); Gemma 3 checkpoints leave it null"
            )
        if config.get("use_bidirectional_attention"):
            raise ConfigError("use_bidirectional_attention=true is not supported: kvforge runs causal decoders")
        self.layer_types = gemma3_layer_types(config, self.num_layers)
        window = config.get("sliding_window")
        if SLIDING in self.layer_types and not window:
            raise ConfigError("Gemma 3 config has sliding layers but no 'sliding_window'")
        self.windows = [int(window) if t == SLIDING else None for t in self.layer_types]
        self.rope = gemma3_rope(config)


class GemmaRMSNorm(RMSNorm):
    """``x / sqrt(mean(x^2) + eps) * (1 + weight)`` in float32, cast back to ``x.dtype`` (HF Gemma 3).

    :class:`~kvforge.models.layers.RMSNorm`'s forms (``forward(x)``, and ``forward(x, residual)`` returning
    ``(norm(x + residual), x + residual)``) and dispatch, the kernels in their zero-centred form
    (kvforge/kernels/triton_rms_norm.py); they differ from the PyTorch path only in the order of the sum
    of squares.
    """

    norm_is_plain_rms = False
    zero_centred = True

    def __init__(self, dim: int, eps: float, dtype=None):
        super().__init__(dim, eps, dtype=dtype)
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, a: Gemma3Args, layer_idx: int, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = a.layer_types[layer_idx]
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.qkv_proj = Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.attention_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, a.hidden_size, bias=a.attention_bias, dtype=dtype)
        self.q_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps, dtype=dtype)
        self.k_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps, dtype=dtype)

    def forward(self, ropes: dict, x: torch.Tensor, attn, rotaries: nn.ModuleDict) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = rotaries[self.layer_type].apply(ropes[self.layer_type], q, k)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(t, self.q_size))


class Gemma3DecoderLayer(nn.Module):
    """``x + post_attn_norm(attn(input_norm(x)))``, then ``+ post_ff_norm(mlp(pre_ff_norm(...)))``.

    ``forward(ropes, h, residual, ...)`` takes the previous layer's normed MLP output ``h`` and the residual
    stream before it (None at the first layer, where ``h`` is the scaled embedding) and returns this layer's
    pair, so each residual add is one kernel with the norm after it (:class:`GemmaRMSNorm`)."""

    def __init__(self, a: Gemma3Args, layer_idx: int, dtype=None):
        super().__init__()
        h, eps = a.hidden_size, a.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)
        self.self_attn = Gemma3Attention(a, layer_idx, dtype=dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)
        self.mlp = GatedMLP(h, a.intermediate_size, a.hidden_act, dtype=dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)

    def forward(self, ropes: dict, h: torch.Tensor, residual: torch.Tensor | None, attn,
                rotaries: nn.ModuleDict) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(ropes, h, attn, rotaries))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3 text decoder over a flat batch; ``attn(layer, q, k, v)`` is the runner's (see module docstring)."""

    ARGS = Gemma3Args
    args: Gemma3Args

    def __init__(self, config: dict, dtype: torch.dtype | None = None):
        super().__init__(config, dtype=dtype)
        a = self.args
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.embed_scale = a.hidden_size**0.5

    def make_layer(self, a: Gemma3Args, layer_idx: int, dtype) -> Gemma3DecoderLayer:
        return Gemma3DecoderLayer(a, layer_idx, dtype=dtype)

    def make_rotary(self, a: Gemma3Args) -> nn.ModuleDict:
        """One rotary per layer type; cos/sin computed once per step for each."""
        return nn.ModuleDict({t: RotaryEmbedding(a.head_dim, a.head_dim, *a.rope[t]) for t in sorted(set(a.layer_types))})

    def make_final_norm(self, a: Gemma3Args, dtype) -> GemmaRMSNorm:
        return GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, dtype=dtype)

    def fused_parameters(self) -> dict[str, list[tuple[str, int]]]:
        return attention_and_mlp_parts(self.args)

    # -- runner interface ----------------------------------------------------
    def sliding_window(self, layer_idx: int) -> int | None:
        return self.args.windows[layer_idx]

    def attention_sinks(self, layer_idx: int) -> torch.Tensor | None:
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        emb = self.model.embed_tokens
        # sqrt(hidden) rounded to the weight dtype first, as transformers does; a Python number, so the step
        # copies nothing to the device (CUDA-graph capture forbids that).
        h = emb(input_ids) * float(torch.tensor(self.embed_scale, dtype=emb.weight.dtype))
        rotaries = self.model.rotary
        ropes = {t: r.cos_sin(positions, h.dtype) for t, r in rotaries.items()}
        residual = None
        for layer in self.model.layers:
            h, residual = layer(ropes, h, residual, attn, rotaries)
        return self.model.norm(h) if residual is None else self.model.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.args.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def reset_buffers(self) -> None:
        for r in self.model.rotary.values():
            r.reset_parameters()

    # -- weights ---------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Text-model tensors (a multimodal checkpoint's renamed, its vision tensors skipped), loaded by name."""
        return super().load_weights((text, t) for name, t in weights if (text := text_tensor_name(name)) is not None)

"""The Llama family as one device-agnostic implementation.

Covers ``LlamaForCausalLM`` (Llama 2/3, llama3 rope scaling, SmolLM),
``MistralForCausalLM`` (sliding window), ``Qwen2ForCausalLM`` (q/k/v bias) and
``Qwen3ForCausalLM`` (per-head q/k RMSNorm), with or without tied embeddings.

The model runs a flat batch of ``T`` tokens from many sequences. It applies
rope to q and k and then hands ``(layer_idx, q[T, Hq, D], k[T, Hkv, D],
v[T, Hkv, D])`` to the ``attn`` callable supplied by the runner, which owns the
KV cache and returns ``[T, Hq, D]``.

Parameters mirror HF names except that q/k/v are fused into
``self_attn.qkv_proj`` and gate/up into ``mlp.gate_up_proj``;
:meth:`LlamaForCausalLM.load_weights` maps HF-named tensors onto them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from kvforge.errors import ConfigError
from kvforge.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, cfg_get, rope_parameters

AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
RopeCache = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, rotary_dim]

# Per-architecture structural differences.
_VARIANTS = {
    # arch: (qkv bias from arch (None: from config.attention_bias), o bias follows qkv?, q/k norm)
    "LlamaForCausalLM": dict(qkv_bias=None, o_bias_follows=True, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, o_bias_follows=True, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, o_bias_follows=False, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=None, o_bias_follows=True, qk_norm=True),
    "CsaRingTestForCausalLM": dict(qkv_bias=False, o_bias_follows=True, qk_norm=False),  # Llama + rings
}


class LlamaArgs:
    """The numbers the model needs, validated, from an HF config dict."""

    def __init__(self, config: dict):
        archs = config.get("architectures") or []
        self.arch = archs[0] if archs else "LlamaForCausalLM"
        if self.arch not in _VARIANTS:
            raise ConfigError(f"LlamaForCausalLM implementation cannot run {self.arch!r}")
        try:
            self.hidden_size = int(config["hidden_size"])
            self.num_layers = int(config["num_hidden_layers"])
            self.num_heads = int(config["num_attention_heads"])
            self.intermediate_size = int(config["intermediate_size"])
            self.vocab_size = int(config["vocab_size"])
        except KeyError as e:
            raise ConfigError(f"model config lacks required key {e.args[0]!r}") from None
        self.num_kv_heads = int(cfg_get(config, "num_key_value_heads", self.num_heads))
        self.head_dim = int(cfg_get(config, "head_dim", self.hidden_size // self.num_heads))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        self.rms_norm_eps = float(cfg_get(config, "rms_norm_eps", 1e-6))
        self.hidden_act = cfg_get(config, "hidden_act", "silu")
        self.tie_word_embeddings = bool(cfg_get(config, "tie_word_embeddings", False))
        self.rope_theta, self.rope_scaling = rope_parameters(config)
        partial = float(cfg_get(config, "partial_rotary_factor", 1.0))
        self.rotary_dim = int(self.head_dim * partial)
        v = _VARIANTS[self.arch]
        attn_bias = bool(cfg_get(config, "attention_bias", False))
        self.qkv_bias = attn_bias if v["qkv_bias"] is None else v["qkv_bias"]
        self.o_bias = self.qkv_bias if v["o_bias_follows"] and v["qkv_bias"] is None else False
        self.qk_norm = v["qk_norm"]
        self.mlp_bias = bool(cfg_get(config, "mlp_bias", False))
        scalar = config.get("query_pre_attn_scalar")
        self.softmax_scale = float(scalar if scalar is not None else self.head_dim) ** -0.5
        self.windows = self._sliding_windows(config)

    def _sliding_windows(self, config: dict) -> list[int | None]:
        window = config.get("sliding_window")
        layer_types = config.get("layer_types")
        if isinstance(layer_types, list) and len(layer_types) == self.num_layers:
            return [int(window) if t == "sliding_attention" and window else None for t in layer_types]
        if self.arch == "MistralForCausalLM":
            return [int(window) if window else None] * self.num_layers
        if self.arch.startswith("Qwen") and config.get("use_sliding_window") and window:
            first = int(cfg_get(config, "max_window_layers", 0))
            return [int(window) if i >= first else None for i in range(self.num_layers)]
        return [None] * self.num_layers


class LlamaAttention(nn.Module):
    def __init__(self, a: LlamaArgs, layer_idx: int, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size = a.num_heads * a.head_dim
        self.kv_size = a.num_kv_heads * a.head_dim
        self.qkv_proj = nn.Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=a.o_bias, dtype=dtype)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, rope: RopeCache, x: torch.Tensor, attn: AttnFn, rotary: RotaryEmbedding
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary.apply(rope, q, k)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs, layer_idx: int, dtype=None):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(a, layer_idx, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, a.hidden_act, bias=a.mlp_bias, dtype=dtype)

    def forward(
        self,
        rope: RopeCache,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        attn: AttnFn,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, residual)``: the layer's output stream is ``residual + mlp_out``, left unsummed.

        The stream entering the layer is ``x`` (first layer: ``residual is None``)
        or ``x + residual``; each sum is formed inside the following norm call
        (one fused kernel on GPU), in the same dtype and with the same operands
        as ``x = x + sublayer(norm(x))``, so the values are unchanged.
        """
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, attn, rotary)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, a: LlamaArgs, dtype=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList([LlamaDecoderLayer(a, i, dtype=dtype) for i in range(a.num_layers)])
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps, dtype=dtype)
        # One rotary for all layers: cos/sin are computed once per step.
        self.rotary = RotaryEmbedding(a.head_dim, a.rotary_dim, a.rope_theta, a.rope_scaling)


class LlamaForCausalLM(nn.Module):
    """One implementation for Llama / Mistral / Qwen2 / Qwen3 (see module docstring)."""

    def __init__(self, config: dict, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = dict(config)
        self.args = a = LlamaArgs(config)
        self.arch = a.arch
        self.num_layers = a.num_layers
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.hidden_size, self.vocab_size = a.hidden_size, a.vocab_size
        self.softmax_scale = a.softmax_scale
        self.tie_word_embeddings = a.tie_word_embeddings
        self.model = LlamaModel(a, dtype=dtype)
        self.lm_head = (
            None if a.tie_word_embeddings else nn.Linear(a.hidden_size, a.vocab_size, bias=False, dtype=dtype)
        )

    # -- runner interface ----------------------------------------------------
    def sliding_window(self, layer_idx: int) -> int | None:
        return self.args.windows[layer_idx]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        rotary = self.model.rotary
        rope = rotary.cos_sin(positions, h.dtype)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(rope, h, residual, attn, rotary)
        return self.model.norm(h) if residual is None else self.model.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, w).float()

    # -- weights ---------------------------------------------------------------
    def _stacked(self) -> dict[str, tuple[str, int, int]]:
        """HF projection name -> (our fused param suffix, row offset, rows)."""
        qs, kvs = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        inter = self.args.intermediate_size
        return {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, qs),
            "self_attn.k_proj": ("self_attn.qkv_proj", qs, kvs),
            "self_attn.v_proj": ("self_attn.qkv_proj", qs + kvs, kvs),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }

    def hf_param_names(self) -> list[str]:
        """Every HF-style tensor name this model consumes (useful for dummy/GGUF checks)."""
        out = []
        stacked = {v[0]: [] for v in self._stacked().values()}
        for hf, (ours, _, _) in self._stacked().items():
            stacked[ours].append(hf)
        for name, _ in self.named_parameters():
            for ours, hfs in stacked.items():
                if f".{ours}." in name:
                    prefix, suffix = name.split(f".{ours}.")
                    out.extend(f"{prefix}.{hf}.{suffix}" for hf in hfs)
                    break
            else:
                out.append(name)
        return out

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters (cast to param dtype/device).

        Returns the set of HF-style names written (compare with :meth:`hf_param_names`).
        Raises ConfigError on an unknown name or a shape mismatch.
        """
        params = dict(self.named_parameters())
        stacked = self._stacked()
        loaded: set[str] = set()
        unknown: list[str] = []
        for name, tensor in weights:
            if (
                "rotary_emb.inv_freq" in name
                or "rotary_emb.cos_cached" in name
                or "rotary_emb.sin_cached" in name
            ):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the copy anyway
            target, rows = name, None
            for hf, (ours, off, n) in stacked.items():
                if f".{hf}." in name:
                    target, rows = name.replace(f".{hf}.", f".{ours}."), (off, n)
                    break
            param = params.get(target)
            if param is None:
                unknown.append(name)
                continue
            dst = param if rows is None else param.narrow(0, rows[0], rows[1])
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ConfigError(
                    f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            loaded.add(name)
        if unknown:
            shown = ", ".join(unknown[:8]) + (" ..." if len(unknown) > 8 else "")
            raise ConfigError(f"{len(unknown)} checkpoint tensor(s) have no place in {self.arch}: {shown}")
        return loaded

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after ``to_empty``)."""
        for m in self.modules():
            if isinstance(m, RotaryEmbedding):
                m.reset_parameters()


# The other architectures are the same implementation; distinct names keep error messages honest.
class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass

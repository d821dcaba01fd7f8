"""The Llama family as one device-agnostic implementation.

Covers ``LlamaForCausalLM`` (Llama 2/3, llama3 rope scaling, SmolLM),
``MistralForCausalLM`` (sliding window), ``Qwen2ForCausalLM`` (q/k/v bias) and
``Qwen3ForCausalLM`` (per-head q/k RMSNorm), with or without tied embeddings.

The model runs a flat batch of ``T`` tokens from many sequences. It applies
rope to q and k and then hands ``(layer_idx, q[T, Hq, D], k[T, Hkv, D],
v[T, Hkv, D])`` to the ``attn`` callable supplied by the runner, which owns the
KV cache and returns ``[T, Hq, D]``; where the callable offers ``rope_attend``
(the runner's does) and q and k have no norm, it hands over q and k before rope
(``[T, Hq + Hkv, D]``, q's heads first) with the step's tables instead, so rope
can run where k is stored.

Parameters mirror HF names except that q/k/v are fused into
``self_attn.qkv_proj`` and gate/up into ``mlp.gate_up_proj``;
:meth:`LlamaForCausalLM.fused_parameters` declares the stacking.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvforge.models.decoder import (
    DecoderArgs,
    DecoderForCausalLM,
    PreNormDecoderLayer,
    attention_and_mlp_parts,
)
from kvforge.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, cfg_get
from kvforge.models.linear_route import Linear

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


class LlamaArgs(DecoderArgs):
    """The numbers the model needs, validated, from an HF config dict."""

    FAMILY = "Llama-family"
    ARCHITECTURES = tuple(_VARIANTS)
    DEFAULT_ARCH = "LlamaForCausalLM"

    def __init__(self, config: dict):
        super().__init__(config)
        self.read_grouped_query_heads(config)
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
        from kvforge.spec.architectures import dense_sliding_windows

        return dense_sliding_windows(config, self.arch, self.num_layers)


class LlamaAttention(nn.Module):
    def __init__(self, a: LlamaArgs, layer_idx: int, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size = a.num_heads * a.head_dim
        self.kv_size = a.num_kv_heads * a.head_dim
        self.qkv_proj = Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, a.hidden_size, bias=a.o_bias, dtype=dtype)
        # True where something else also reads the forward's ``x`` (a forward pre-hook): the norm before
        # this block then cannot be left to the q/k/v product's prologue.
        self.input_has_other_readers = False
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    @property
    def input_projection(self) -> Linear | None:
        """The one reader of the forward's ``x`` (kvforge/models/linear_route.py, ``norm_input``); None
        where it is not the only one."""
        return None if self.input_has_other_readers else self.qkv_proj

    def forward(
        self, rope: RopeCache, x: torch.Tensor, attn: AttnFn, rotary: RotaryEmbedding
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        t = qkv.shape[0]
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:  # q and k rotate as one tensor
            qk = qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            rope_attend = getattr(attn, "rope_attend", None)
            if rope_attend is not None:  # rope where the attention stores k (the runner's callable)
                out = rope_attend(self.layer_idx, qk, self.num_heads, v, rope, rotary)
                return self.o_proj(out.reshape(t, self.q_size))
            q, k = rotary.apply_packed(rope, qk, self.num_heads)
        else:
            q = self.q_norm(qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:qk_size].view(t, self.num_kv_heads, self.head_dim))
            q, k = rotary.apply(rope, q, k)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaForCausalLM(DecoderForCausalLM):
    """One implementation for Llama / Mistral / Qwen2 / Qwen3 (see module docstring)."""

    ARGS = LlamaArgs
    args: LlamaArgs

    def __init__(self, config: dict, dtype: torch.dtype | None = None):
        super().__init__(config, dtype=dtype)
        a = self.args
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim

    def make_layer(self, a: LlamaArgs, layer_idx: int, dtype) -> PreNormDecoderLayer:
        mlp = GatedMLP(a.hidden_size, a.intermediate_size, a.hidden_act, bias=a.mlp_bias, dtype=dtype)
        return PreNormDecoderLayer(a.hidden_size, a.rms_norm_eps, LlamaAttention(a, layer_idx, dtype=dtype), mlp,
                                   dtype=dtype)

    def make_rotary(self, a: LlamaArgs) -> RotaryEmbedding:
        return RotaryEmbedding(a.head_dim, a.rotary_dim, a.rope_theta, a.rope_scaling)

    def fused_parameters(self) -> dict[str, list[tuple[str, int]]]:
        return attention_and_mlp_parts(self.args)

    def input_major_modules(self) -> list[nn.Module]:
        mods = [self.head_module()]
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            mods += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        return mods

    def sliding_window(self, layer_idx: int) -> int | None:
        return self.args.windows[layer_idx]


# The other architectures are the same implementation; distinct names keep error messages honest.
class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass

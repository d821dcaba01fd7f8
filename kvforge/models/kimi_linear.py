"""Kimi-Linear (``KimiLinearForCausalLM``): Kimi Delta Attention (KDA) and MLA layers, MoE, device-agnostic.

Layers follow ``layer_types`` (else the checkpoint's ``linear_attn_config``: 1-indexed
``full_attn_layers`` / ``kda_layers``; else every 4th layer from index 4 is full attention).

* **KDA** (``self_attn`` of ``linear_attention`` layers): ``q_proj``, ``k_proj``, ``v_proj`` go
  through the short causal conv (SiLU, the q, k and v kernels ``[H * D, 1, W]`` stacked) continuing the
  sequence's conv state, then the gated delta rule with one gate per key channel
  ``g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)`` (float32) and
  ``beta = sigmoid(b_proj(x))`` (q/k L2-normalised, scale ``D^-0.5``), continuing its recurrent
  state; the output goes through the sigmoid-gated RMSNorm ``o_norm`` (gate
  ``g_b_proj(g_a_proj(x))``, weight applied in float32) and ``o_proj``. State operations are the
  runner's ``attn.short_conv`` / ``attn.delta_rule`` (kvforge/attention/linear_state.py).
* **MLA** (``full_attention`` layers): DeepSeek-V2's latent attention
  (:class:`kvforge.models.deepseek.MLAAttention`, ``attn.mla``) without rope: the
  ``qk_rope_head_dim`` features are shared by all heads as in DeepSeek but never rotated.
* **MLP**: ``mlp_layer_types`` (else the first ``first_k_dense_replace`` layers, default 1, dense):
  ``sparse`` layers are DeepSeek-V3 MoE (sigmoid router with ``e_score_correction_bias``, group-limited
  top-k, renormalised with ``moe_renormalize``, times ``routed_scaling_factor``, plus shared experts);
  ``dense`` layers a gated MLP of ``intermediate_size``.

Config keys are read under transformers' saved names (``num_experts``, ``num_experts_per_token``,
``num_expert_group``, ``num_shared_experts``, ``moe_renormalize``) or their aliases. Checkpoints use
the hub layout (what transformers also writes): MLPs under ``block_sparse_moe``, experts per expert
as ``w1`` (gate), ``w3`` (up), ``w2`` (down), ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, and the
forget gate's ``f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log`` directly under ``self_attn``.
Parameters keep those names except the fused ones (q/k/v convs into ``conv1d``; ``q_proj``, ``k_proj``,
``v_proj``, ``f_a_proj``, ``g_a_proj`` and ``b_proj``, which all read the layer's input, into one product
``in_proj``; ``f_b_proj`` and ``g_b_proj`` into ``fg_b_proj``, one batched product of the side-by-side
``f_a`` and ``g_a`` columns; gate/up of dense and shared MLPs) and the routed experts (stacked) under ``mlp``.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kvforge.attention.delta_rule_gates import DeltaGates
from kvforge.attention.linear_state import LinearStateLayout
from kvforge.errors import ConfigError
from kvforge.models.decoder import (
    DecoderArgs,
    DecoderForCausalLM,
    PreNormDecoderLayer,
    gate_up_parts,
)
from kvforge.models.deepseek import (
    MLAAttention,
    MoE,
    fuses_input_projections,
    input_projection_parts,
    read_mla_sizes,
)
from kvforge.models.layers import GatedMLP, cfg_get
from kvforge.models.linear_route import Linear
from kvforge.models.qwen3_next import FULL, LINEAR, GatedRMSNorm, hybrid_layer_types, short_conv_weight
from kvforge.models.stacked_experts import StackedExpertsCheckpoint

_EXPERT_WEIGHTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_WEIGHT_NAMES = {v: k for k, v in _EXPERT_WEIGHTS.items()}


def our_name(name: str) -> str:
    """A Kimi-Linear checkpoint name -> ours (``block_sparse_moe`` -> ``mlp``, ``w1/w3/w2`` -> ``gate/up/down_proj``)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"\.experts\.(\d+)\.(w[123])\.", lambda m: f".experts.{m[1]}.{_EXPERT_WEIGHTS[m[2]]}.", name)


def checkpoint_name(name: str) -> str:
    """The inverse of :func:`our_name`."""
    name = name.replace(".mlp.", ".block_sparse_moe.")
    return re.sub(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.",
                  lambda m: f".experts.{m[1]}.{_EXPERT_WEIGHT_NAMES[m[2]]}.", name)


def _first(config: dict, keys: tuple[str, ...], default):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


class KimiLinearArgs(DecoderArgs):
    """The numbers the model needs, validated, from an HF ``KimiLinearForCausalLM`` config dict.

    Carries the attribute names :class:`~kvforge.models.deepseek.MLAAttention`,
    :class:`~kvforge.models.deepseek.Gate` and :class:`~kvforge.models.deepseek.MoE` read.
    """

    FAMILY = "Kimi-Linear"
    ARCHITECTURES = ("KimiLinearForCausalLM",)
    DEFAULT_ARCH = "KimiLinearForCausalLM"

    def __init__(self, config: dict):
        super().__init__(config)
        # The LM head is its own weight whatever the config says (transformers never ties this architecture,
        # and its save_pretrained writes lm_head.weight).
        self.tie_word_embeddings = False
        # MLA
        read_mla_sizes(self, config)
        self.softmax_scale = self.qk_head_dim**-0.5
        # KDA
        lin = config.get("linear_attn_config") or {}
        self.linear_head_dim = int(_first(config, ("linear_head_dim",), lin.get("head_dim", 128)))
        self.linear_num_heads = int(_first(config, ("linear_num_heads",), lin.get("num_heads", 32)))
        self.conv_width = int(_first(config, ("linear_conv_kernel_dim",), lin.get("short_conv_kernel_size", 4)))
        if "layer_types" not in config and "full_attn_layers" in lin and "kda_layers" in lin:
            full = {int(i) - 1 for i in lin["full_attn_layers"]}
            config = dict(config, layer_types=[FULL if i in full else LINEAR for i in range(self.num_layers)])
        self.layer_types = hybrid_layer_types(config, self.num_layers, lambda i: FULL if i and i % 4 == 0 else LINEAR)
        if LINEAR in self.layer_types and self.hidden_act != "silu":
            raise ConfigError(f"Kimi-Linear KDA layers run their short conv with hidden_act; only 'silu' is "
                              f"supported, got {self.hidden_act!r}")
        if self.conv_width < 2:
            raise ConfigError(f"the short conv kernel size must be >= 2, got {self.conv_width}")
        # MoE (DeepSeek-V3 routing)
        self.v3 = True
        self.n_routed_experts = int(_first(config, ("num_experts", "num_local_experts", "n_routed_experts"), 0))
        self.top_k = int(_first(config, ("num_experts_per_token", "num_experts_per_tok"), 1))
        self.n_group = int(_first(config, ("num_expert_group", "n_group"), 1))
        self.topk_group = int(cfg_get(config, "topk_group", self.n_group))
        self.n_shared_experts = int(_first(config, ("num_shared_experts", "n_shared_experts"), 0))
        self.norm_topk_prob = bool(_first(config, ("moe_renormalize", "norm_topk_prob"), True))
        self.routed_scaling_factor = float(cfg_get(config, "routed_scaling_factor", 1.0))
        self.moe_intermediate_size = int(cfg_get(config, "moe_intermediate_size", self.intermediate_size))
        router = config.get("moe_router_activation_func", "sigmoid")
        if router != "sigmoid":
            raise ConfigError(f"Kimi-Linear router activation {router!r} is not supported (supported: sigmoid)")
        if self.n_routed_experts and self.n_routed_experts % self.n_group:
            raise ConfigError(f"num_experts {self.n_routed_experts} must be a multiple of num_expert_group "
                              f"{self.n_group}")
        mlp_types = config.get("mlp_layer_types")
        if mlp_types is None:
            dense = int(cfg_get(config, "first_k_dense_replace", 1))
            mlp_types = ["dense" if i < dense else "sparse" for i in range(self.num_layers)]
        if len(mlp_types) != self.num_layers or set(mlp_types) - {"dense", "sparse"}:
            raise ConfigError(f"config 'mlp_layer_types' must list {self.num_layers} entries of 'dense' / 'sparse', "
                              f"got {mlp_types!r}")
        if "sparse" in mlp_types and not self.n_routed_experts:
            raise ConfigError("Kimi-Linear config has sparse MLP layers but no experts (num_experts)")
        self.mlp_types = list(mlp_types)

    def linear_state_layout(self) -> LinearStateLayout:
        width = self.linear_num_heads * self.linear_head_dim
        return LinearStateLayout(conv_channels=3 * width, conv_width=self.conv_width,
                                 num_value_heads=self.linear_num_heads, key_dim=self.linear_head_dim,
                                 value_dim=self.linear_head_dim, num_key_heads=self.linear_num_heads,
                                 gate_per_channel=True)


class KimiDeltaAttention(nn.Module):
    """KDA (see the module docstring); called as ``self_attn(rope, x, attn, rotary)`` like attention."""

    def __init__(self, a: KimiLinearArgs, layer_idx: int, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.head_dim = a.linear_num_heads, a.linear_head_dim
        width = self.heads * self.head_dim
        # q, k, v, the gates' first projections and b_proj read the same input: one stacked product
        self.input_split = kda_input_split(a)
        self.in_proj = Linear(a.hidden_size, sum(self.input_split), bias=False, dtype=dtype)
        self.conv1d = nn.Conv1d(3 * width, 3 * width, a.conv_width, groups=3 * width, bias=False, dtype=dtype)
        # f_b_proj and g_b_proj stacked: one batched product of the f_a and g_a columns, which lie side by side
        self.fg_b_proj = nn.Linear(self.head_dim, 2 * width, bias=False, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.heads, 1, dtype=dtype))
        self.o_norm = GatedRMSNorm(self.head_dim, a.rms_norm_eps, torch.sigmoid, round_normed=False, dtype=dtype)
        self.o_proj = Linear(width, a.hidden_size, bias=False, dtype=dtype)

    @property
    def input_projection(self) -> Linear:
        """The one reader of the forward's ``x`` (kvforge/models/linear_route.py, ``norm_input``)."""
        return self.in_proj

    def second_gate_projections(self, fg_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(f_b_proj(f_a), g_b_proj(g_a))``, each ``[T, H * D]``, as one batched product of the stacked input
        product's ``[f_a | g_a]`` columns ``[T, 2 * D]`` by :attr:`fg_b_proj`'s two row blocks."""
        t, d = fg_a.shape[0], self.head_dim
        weight = self.fg_b_proj.weight.view(2, -1, d)
        both = torch.bmm(fg_a.reshape(t, 2, d).transpose(0, 1), weight.transpose(1, 2))
        return both[0], both[1]

    def forward(self, rope, x: torch.Tensor, attn, rotary) -> torch.Tensor:
        mixed, fg_a, b = self.in_proj(x).split(self.input_split, dim=-1)
        t, h, d = mixed.shape[0], self.heads, self.head_dim  # x may be a pending norm (the product's prologue)
        mixed = attn.short_conv(self.layer_idx, mixed, short_conv_weight(self.conv1d), None, "silu")
        q, k, v = (part.reshape(t, h, d) for part in mixed.split(h * d, dim=-1))
        f_b, g_b = self.second_gate_projections(fg_a)
        # the per-channel log decay -exp(A_log[h]) * softplus(f_b + dt_bias) and the write strength sigmoid(b),
        # computed by the kernels that take them (kvforge/attention/delta_rule_gates.py)
        o = attn.delta_rule(self.layer_idx, q, k, v, DeltaGates(f_b, self.dt_bias, self.A_log, b, d),
                            normalize_qk=True)
        return self.o_proj(self.o_norm(o, g_b.view(t, h, d)).reshape(t, h * d))


def kda_input_split(a: KimiLinearArgs) -> tuple[int, int, int]:
    """Columns of a KDA layer's stacked input product as the forward splits them: q, k and v together (the
    conv's input), ``f_a_proj`` and ``g_a_proj`` together (the second gate projections' input), ``b_proj``
    (:func:`kda_input_parts`' rows)."""
    q, k, v, f_a, g_a, b = (n for _, n in kda_input_parts(a))
    return q + k + v, f_a + g_a, b


def kda_input_parts(a: KimiLinearArgs) -> list[tuple[str, int]]:
    """The HF tensors stacked in a KDA layer's ``self_attn.in_proj``, in row order."""
    width = a.linear_num_heads * a.linear_head_dim
    return [("self_attn.q_proj", width), ("self_attn.k_proj", width), ("self_attn.v_proj", width),
            ("self_attn.f_a_proj", a.linear_head_dim), ("self_attn.g_a_proj", a.linear_head_dim),
            ("self_attn.b_proj", a.linear_num_heads)]


class NoRope(nn.Module):
    """The rotary of a model without positional rotation: MLA's rope features pass unchanged."""

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> None:
        return None

    def rotate(self, rope, x: torch.Tensor) -> torch.Tensor:
        return x

    def rotate_qk(self, rope, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def reset_parameters(self) -> None:
        pass


class KimiLinearForCausalLM(StackedExpertsCheckpoint, DecoderForCausalLM):
    """Kimi-Linear over a flat batch; ``attn`` must provide ``mla``, ``short_conv`` and ``delta_rule``."""

    ARGS = KimiLinearArgs
    args: KimiLinearArgs

    def make_layer(self, a: KimiLinearArgs, layer_idx: int, dtype) -> PreNormDecoderLayer:
        mixer = (KimiDeltaAttention(a, layer_idx, dtype=dtype) if a.layer_types[layer_idx] == LINEAR
                 else MLAAttention(a, layer_idx, dtype=dtype, fuse_inputs=fuses_input_projections(a)))
        mlp = (MoE(a, dtype=dtype) if a.mlp_types[layer_idx] == "sparse"
               else GatedMLP(a.hidden_size, a.intermediate_size, a.hidden_act, dtype=dtype))
        return PreNormDecoderLayer(a.hidden_size, a.rms_norm_eps, mixer, mlp, dtype=dtype)

    def make_rotary(self, a: KimiLinearArgs) -> NoRope:
        return NoRope()

    def fused_parameters(self) -> dict[str, list[tuple[str, int]]]:
        a = self.args
        width = a.linear_num_heads * a.linear_head_dim
        return {"mlp.gate_up_proj": gate_up_parts("mlp", a.intermediate_size),
                "mlp.shared_experts.gate_up_proj": gate_up_parts("mlp.shared_experts",
                                                                 a.moe_intermediate_size * a.n_shared_experts),
                "self_attn.conv1d": [(f"self_attn.{p}_conv1d", width) for p in "qkv"],
                "self_attn.in_proj": kda_input_parts(a),
                "self_attn.fg_b_proj": [("self_attn.f_b_proj", width), ("self_attn.g_b_proj", width)],
                **({"self_attn.fused_qkv_a_proj": input_projection_parts(a)} if fuses_input_projections(a) else {})}

    # -- checkpoint names: MLPs under ``block_sparse_moe``, experts' w1 / w3 / w2 ----------------
    def checkpoint_names(self, name: str, param: torch.Tensor) -> list[str]:
        return [checkpoint_name(n) for n in super().checkpoint_names(name, param)]

    def load_checkpoint_tensor(self, params, name: str, tensor: torch.Tensor):
        written = super().load_checkpoint_tensor(params, our_name(name), tensor)
        return None if written is None else [checkpoint_name(n) for n in written]

    def linear_state_layouts(self) -> dict[int, LinearStateLayout]:
        """Layer index -> the per-sequence state of each KDA layer."""
        layout = self.args.linear_state_layout()
        return {i: layout for i, t in enumerate(self.args.layer_types) if t == LINEAR}

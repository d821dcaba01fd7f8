"""Qwen3-Next (``Qwen3NextForCausalLM``): Gated DeltaNet and gated full-attention layers, MoE, device-agnostic.

Layers follow ``layer_types`` (else every ``full_attention_interval``-th layer, default 4, is full
attention; the others ``linear_attention``). Every norm is zero-centred: ``x / rms(x) * (1 + w)``
in float32 (:class:`~kvforge.models.gemma3.GemmaRMSNorm`, the same formula).

* **Gated DeltaNet** (``linear_attn``): ``in_proj_qkvz`` gives per key head ``[q | k | v | z]``
  (``v``, ``z`` of the ``Hv / Hk`` value heads it serves) and ``in_proj_ba`` ``[b | a]``; here both are
  one product, ``in_proj``, their rows regrouped at load as ``[q | k | v | z | b | a]`` over all heads
  (:func:`gdn_input_rows`), so the conv's input ``[q | k | v]`` is one slice of it; q, k, v
  go through the short causal conv (SiLU, ``conv1d.weight [D, 1, W]``) continuing the sequence's
  conv state, then the gated delta rule (q/k L2-normalised, scale ``K^-0.5``) continuing its
  recurrent state, with ``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)``; the
  output is normalised per value head with the SiLU-gated RMSNorm ``w * rms_norm(o) * silu(z)``
  and projected by ``out_proj``. The state operations are the runner's ``attn.short_conv`` and
  ``attn.delta_rule`` (:class:`kvforge.attention.linear_state.LinearStates`).
* **Gated attention** (``self_attn``): ``q_proj`` gives per head ``[q | gate]``; q/k get a
  zero-centred per-head RMSNorm and rope on the first ``partial_rotary_factor * head_dim``
  features (default 0.25); the attention output is multiplied by ``sigmoid(gate)`` before
  ``o_proj``.
* **MLP**: layers not in ``mlp_only_layers`` with ``(i + 1) % decoder_sparse_step == 0`` (and
  ``num_experts > 0``) are MoE: softmax router, top-``num_experts_per_tok`` (renormalised with
  ``norm_topk_prob``), plus one shared expert scaled by ``sigmoid(shared_expert_gate(x))``;
  the others a gated MLP of ``intermediate_size``.

Parameter names are transformers'; gate/up of the dense and shared MLPs are fused, the Gated DeltaNet's
two input projections stacked (above), routed
experts stacked (kvforge/models/stacked_experts.py). Multi-token-prediction tensors (``mtp.*``)
are skipped unless the model is built ``with_mtp`` (speculative method mtp): then they load into
``mtp`` (kvforge/models/qwen3_next_mtp.py) and :meth:`Qwen3NextForCausalLM.mtp_forward` runs it, through a
runner over the plan's proposer layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.attention.delta_rule_gates import DeltaGates
from kvforge.attention.linear_state import LinearStateLayout
from kvforge.errors import ConfigError
from kvforge.models.decoder import DecoderArgs, DecoderForCausalLM, gate_up_parts, required_int
from kvforge.models.deepseek import MoE
from kvforge.models.gemma3 import GemmaRMSNorm
from kvforge.models.layers import GatedMLP, RotaryEmbedding, cfg_get, fused_kernels, get_activation
from kvforge.models.linear_route import Linear
from kvforge.models.qwen3_next_mtp import Qwen3NextMTP
from kvforge.models.routed_experts import RoutedExperts
from kvforge.models.router_topk import RouterRule, router_topk, softmax_topk
from kvforge.models.stacked_experts import StackedExpertsCheckpoint

LINEAR, FULL = "linear_attention", "full_attention"


def hybrid_layer_types(config: dict, num_layers: int, default) -> list[str]:
    """``layer_types`` from the config (``linear_attention`` / ``full_attention``), else ``default(i)``."""
    types = config.get("layer_types")
    if types is None:
        return [default(i) for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {LINEAR, FULL}:
        raise ConfigError(f"config 'layer_types' must list {num_layers} entries of {LINEAR!r} / {FULL!r}, got {types!r}")
    return list(types)


def partial_rotary_factor(config: dict) -> float:
    """The fraction of each head's features that rope rotates, in transformers' order of priority: the value in
    ``rope_parameters``, then a top-level ``partial_rotary_factor``, then 0.25 (Qwen3-Next's default).

    A config can carry both, and they can disagree: some transformers versions write the config class's default
    at the top level next to the model's own value in ``rope_parameters``, and their models rotate by the latter.
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    return float(cfg_get(config, "partial_rotary_factor", 0.25))


class Qwen3NextArgs(DecoderArgs):
    """The numbers the model needs, validated, from an HF ``Qwen3NextForCausalLM`` config dict."""

    FAMILY = "Qwen3-Next"
    ARCHITECTURES = ("Qwen3NextForCausalLM",)
    DEFAULT_ARCH = "Qwen3NextForCausalLM"

    def __init__(self, config: dict):
        super().__init__(config)
        self.read_grouped_query_heads(config, default_head_dim=256)
        self.softmax_scale = self.head_dim**-0.5
        self.attention_bias = bool(cfg_get(config, "attention_bias", False))
        self.rotary_dim = int(self.head_dim * partial_rotary_factor(config))
        interval = int(cfg_get(config, "full_attention_interval", 4))
        self.layer_types = hybrid_layer_types(config, self.num_layers,
                                              lambda i: FULL if (i + 1) % interval == 0 else LINEAR)
        self.linear_num_key_heads = required_int(config, "linear_num_key_heads")
        self.linear_num_value_heads = required_int(config, "linear_num_value_heads")
        self.linear_key_head_dim = required_int(config, "linear_key_head_dim")
        self.linear_value_head_dim = required_int(config, "linear_value_head_dim")
        self.conv_width = int(cfg_get(config, "linear_conv_kernel_dim", 4))
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                              f"linear_num_key_heads ({self.linear_num_key_heads})")
        if LINEAR in self.layer_types and self.hidden_act != "silu":
            raise ConfigError(f"Qwen3-Next linear-attention layers run their short conv with hidden_act; "
                              f"only 'silu' is supported, got {self.hidden_act!r}")
        if self.conv_width < 2:
            raise ConfigError(f"linear_conv_kernel_dim must be >= 2, got {self.conv_width}")
        self.num_experts = int(cfg_get(config, "num_experts", 0))
        self.top_k = int(cfg_get(config, "num_experts_per_tok", 1))
        self.norm_topk_prob = bool(cfg_get(config, "norm_topk_prob", True))
        self.moe_intermediate_size = int(cfg_get(config, "moe_intermediate_size", self.intermediate_size))
        self.shared_expert_intermediate_size = int(cfg_get(config, "shared_expert_intermediate_size", 0))
        self.decoder_sparse_step = int(cfg_get(config, "decoder_sparse_step", 1))
        self.mlp_only_layers = set(cfg_get(config, "mlp_only_layers", []))

    def is_moe(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    def linear_state_layout(self) -> LinearStateLayout:
        key_total = self.linear_num_key_heads * self.linear_key_head_dim
        value_total = self.linear_num_value_heads * self.linear_value_head_dim
        return LinearStateLayout(conv_channels=2 * key_total + value_total, conv_width=self.conv_width,
                                 num_value_heads=self.linear_num_value_heads, key_dim=self.linear_key_head_dim,
                                 value_dim=self.linear_value_head_dim, num_key_heads=self.linear_num_key_heads,
                                 gate_per_channel=False)


#: The gate activations the fused kernel computes (kvforge/kernels/triton_gated_rms_norm.py), by function.
GATE_ACTIVATIONS = {torch.sigmoid: "sigmoid", F.silu: "silu"}


class GatedRMSNorm(nn.Module):
    """``weight * rms_norm(x) * act(gate)`` in float32, cast back to x's dtype (HF ``RMSNormGated``).

    ``round_normed``: the normalised x is rounded to x's dtype and multiplied by the weight in that
    dtype first (Qwen3-Next); otherwise the weight multiplies in float32 (Kimi-Linear). Where the fused
    kernels serve (kvforge/models/layers.py, ``fused_kernels``) one Triton kernel computes it.
    """

    def __init__(self, dim: int, eps: float, activation, round_normed: bool, dtype=None):
        super().__init__()
        self.eps = float(eps)
        self.act = activation
        self.round_normed = round_normed
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        activation = GATE_ACTIVATIONS.get(self.act)
        if (activation is not None and fused_kernels(x) is not None and x.numel() and x.dim() <= 3
                and gate.shape == x.shape and x.stride(-1) == 1 and gate.stride(-1) == 1
                and (not self.round_normed or self.weight.dtype == x.dtype)):
            from kvforge.kernels.triton_gated_rms_norm import gated_rms_norm

            return gated_rms_norm(x, gate, self.weight, self.eps, activation, self.round_normed)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * xf.to(x.dtype) if self.round_normed else self.weight.float() * xf
        return (normed * self.act(gate.float())).to(x.dtype)


def short_conv_weight(conv: nn.Conv1d) -> torch.Tensor:
    """``conv1d.weight [D, 1, W]`` as ``[D, W]`` (a view)."""
    return conv.weight[:, 0, :]


def gdn_input_rows(weight: torch.Tensor, key_heads: int, parts: tuple[int, ...]) -> torch.Tensor:
    """A Gated DeltaNet input projection's rows regrouped from per key head (``[p0 | p1 | ...]`` of head 0,
    then of head 1, ...; ``parts`` the rows of each ``p`` a key head) to per part (``p0`` of every head,
    then ``p1``, ...), head order kept within each part."""
    per_head = weight.reshape(key_heads, sum(parts), *weight.shape[1:]).split(list(parts), dim=1)
    return torch.cat([p.reshape(-1, *weight.shape[1:]) for p in per_head])


class GatedDeltaNet(nn.Module):
    """Qwen3-Next linear attention (see the module docstring)."""

    def __init__(self, a: Qwen3NextArgs, layer_idx: int, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.hk, self.hv = a.linear_num_key_heads, a.linear_num_value_heads
        self.dk, self.dv = a.linear_key_head_dim, a.linear_value_head_dim
        key_total, value_total = self.hk * self.dk, self.hv * self.dv
        conv_dim = 2 * key_total + value_total
        # in_proj_qkvz and in_proj_ba as one product, rows [q | k | v | z | b | a] (gdn_input_rows)
        self.input_split = (conv_dim, value_total, self.hv, self.hv)
        self.in_proj = Linear(a.hidden_size, sum(self.input_split), bias=False, dtype=dtype)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, a.conv_width, groups=conv_dim, bias=False, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.ones(self.hv, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(self.hv, dtype=dtype))
        self.norm = GatedRMSNorm(self.dv, a.rms_norm_eps, F.silu, round_normed=True, dtype=dtype)
        self.out_proj = Linear(value_total, a.hidden_size, bias=False, dtype=dtype)

    def checkpoint_rows(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The checkpoint's ``...in_proj_qkvz.weight`` / ``...in_proj_ba.weight`` (transformers' per-key-head
        layout) in :attr:`in_proj`'s row order; a tensor of another shape is named with the shape expected."""
        per = self.hv // self.hk
        parts = ((self.dk, self.dk, per * self.dv, per * self.dv) if ".in_proj_qkvz." in name else (per, per))
        want = (self.hk * sum(parts), self.in_proj.weight.shape[1])
        if tuple(weight.shape) != want:
            raise ConfigError(f"weight {name}: checkpoint shape {tuple(weight.shape)} != model shape {want}")
        return gdn_input_rows(weight, self.hk, parts)

    def forward(self, x: torch.Tensor, attn) -> torch.Tensor:
        t, hk, hv, dk, dv = x.shape[0], self.hk, self.hv, self.dk, self.dv
        mixed, z, b, a = self.in_proj(x).split(self.input_split, dim=-1)
        mixed = attn.short_conv(self.layer_idx, mixed, short_conv_weight(self.conv1d), None, "silu")
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        gates = DeltaGates(a, self.dt_bias, self.A_log, b, 1)  # computed by the kernels that take them
        o = attn.delta_rule(self.layer_idx, q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv), gates,
                            normalize_qk=True)
        o = self.norm(o, z.view(t, hv, dv))
        return self.out_proj(o.reshape(t, hv * dv))


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate, per-head zero-centred q/k norms and partial rope."""

    def __init__(self, a: Qwen3NextArgs, layer_idx: int, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        q_size, kv_size, bias = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.attention_bias
        self.q_proj = Linear(a.hidden_size, 2 * q_size, bias=bias, dtype=dtype)
        self.k_proj = Linear(a.hidden_size, kv_size, bias=bias, dtype=dtype)
        self.v_proj = Linear(a.hidden_size, kv_size, bias=bias, dtype=dtype)
        self.o_proj = Linear(q_size, a.hidden_size, bias=bias, dtype=dtype)
        self.q_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps, dtype=dtype)
        self.k_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps, dtype=dtype)

    def forward(self, rope, x: torch.Tensor, attn, rotary: RotaryEmbedding) -> torch.Tensor:
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, gate = self.q_proj(x).view(t, h, 2 * d).split([d, d], dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, hkv, d))
        v = self.v_proj(x).view(t, hkv, d)
        q, k = rotary.apply(rope, q.contiguous(), k)
        out = attn(self.layer_idx, q, k, v).reshape(t, h * d)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, h * d)))


class Qwen3NextMoE(MoE):
    """Softmax top-k routed experts plus one sigmoid-gated shared expert (routing as HF Qwen3-Next).

    Folded (:meth:`MoE.fold_shared_experts`), the shared expert joins the stack as ``S`` experts whose
    slots weigh ``sigmoid(shared_expert_gate(x))``: the router's and the shared gate's weights become one
    ``[E + 1, H]`` product, and the choice kernel writes the gate's sigmoid into the shared slots
    (``RouterRule.gated_shared``). Steps the expert kernel does not take run the shared experts apart, the
    gate applied as the unfolded block applies it."""

    def __init__(self, a: Qwen3NextArgs, dtype=None):
        nn.Module.__init__(self)
        e, i, h = a.num_experts, a.moe_intermediate_size, a.hidden_size
        self.inter, self.top_k, self.norm_topk_prob = i, a.top_k, a.norm_topk_prob
        self.gate = nn.Linear(h, e, bias=False, dtype=dtype)
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype))
        self.experts_down = nn.Parameter(torch.empty(e, h, i, dtype=dtype))
        self.act = get_activation(a.hidden_act)
        self.shared_expert = GatedMLP(h, a.shared_expert_intermediate_size, a.hidden_act, dtype=dtype)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False, dtype=dtype)

    def routed_per_token(self) -> int:
        return self.top_k

    def _shared_mlp(self) -> nn.Module | None:
        return self.shared_expert

    def _drop_shared_mlp(self) -> None:
        """The shared MLP goes; the router's and the shared gate's weights become views of one ``[E + 1, H]``
        block of :attr:`router_and_shared_gate` (one product gives both), whose rows are zero-padded to a
        multiple of 8 so the product's output rows stay 16-byte aligned (cuBLAS falls back to a slow kernel for
        an odd row length such as 513)."""
        self.shared_expert = None
        e, h = self.gate.weight.shape
        rows = -(-(e + 1) // 8) * 8
        both = torch.zeros(rows, h, dtype=self.gate.weight.dtype, device=self.gate.weight.device)
        both[:e] = self.gate.weight
        both[e:e + 1] = self.shared_expert_gate.weight
        self.router_and_shared_gate = both
        self.gate.weight = nn.Parameter(both[:e], requires_grad=False)
        self.shared_expert_gate.weight = nn.Parameter(both[e:e + 1], requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) of the router (the experts it holds all of)."""
        logits = self.gate(x)
        weights, ids = softmax_topk(logits, self.top_k, self.norm_topk_prob)
        return weights.to(logits.dtype), ids

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert scaled by its sigmoid gate."""
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.folded_shared
        if s:
            e = self.gate.weight.shape[0]
            logits = F.linear(x, self.router_and_shared_gate)[:, :e + 1]  # [T, E + 1] in x's dtype, as the gates'
            if self._folded_shared_in_kernel(x):
                rule = RouterRule(self.top_k, self.norm_topk_prob, shared=s, gated_shared=True)
                weights, ids = router_topk(logits, rule)
                return self.routed(x, weights.to(x.dtype), ids, shared_slots=s)
            weights, ids = softmax_topk(logits[:, :e], self.top_k, self.norm_topk_prob)
            shared = torch.sigmoid(logits[:, e:]) * self._folded_shared_apart(x)
            return self.routed(x, weights.to(x.dtype), ids, addend=shared)
        shared = self.shared(x)
        weights, ids = self.route(x)
        return self.routed(x, weights, ids, addend=shared)

    def routed_experts(self) -> RoutedExperts:
        """The stacked experts (folded shared experts left out), top-k of the router's (a plain linear)
        experts."""
        held = self.experts_down.shape[0] - self.folded_shared
        return RoutedExperts((self.experts_gate_up[:held], self.experts_down[:held]), self.top_k,
                             self.gate.weight.shape[0])


class Qwen3NextDecoderLayer(nn.Module):
    """``x + mixer(norm(x))``, then ``+ mlp(norm(...))``; the mixer is Gated DeltaNet or gated attention.

    ``forward(rope, h, residual, ...)`` takes the previous layer's MLP output ``h`` and the residual stream
    before it (None at the first layer, where ``h`` is the embedding) and returns this layer's pair, so
    each residual add is one kernel with the norm after it (:class:`GemmaRMSNorm`). ``layer_type``: the
    mixer, when it is not the one ``layer_types`` gives ``layer_idx`` (the MTP layer: full attention)."""

    def __init__(self, a: Qwen3NextArgs, layer_idx: int, dtype=None, layer_type: str | None = None):
        super().__init__()
        self.layer_type = layer_type or a.layer_types[layer_idx]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(a, layer_idx, dtype=dtype)
        else:
            self.self_attn = GatedAttention(a, layer_idx, dtype=dtype)
        self.mlp = (Qwen3NextMoE(a, dtype=dtype) if a.is_moe(layer_idx)
                    else GatedMLP(a.hidden_size, a.intermediate_size, a.hidden_act, dtype=dtype))
        self.input_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, dtype=dtype)

    def forward(self, rope, h: torch.Tensor, residual: torch.Tensor | None, attn,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.linear_attn(h, attn) if self.layer_type == LINEAR else self.self_attn(rope, h, attn, rotary)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3NextForCausalLM(StackedExpertsCheckpoint, DecoderForCausalLM):
    """Qwen3-Next over a flat batch; ``attn`` must also provide ``short_conv`` and ``delta_rule``."""

    ARGS = Qwen3NextArgs
    args: Qwen3NextArgs

    def __init__(self, config: dict, dtype: torch.dtype | None = None, with_mtp: bool = False):
        super().__init__(config, dtype=dtype)
        a = self.args
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        #: The checkpoint's first multi-token-prediction layer (``with_mtp``).
        self.mtp: Qwen3NextMTP | None = None
        if with_mtp:
            if int(config.get("mtp_num_hidden_layers") or config.get("num_nextn_predict_layers") or 0) < 1:
                raise ConfigError(f"{self.arch} config has no multi-token-prediction layer "
                                  f"(mtp_num_hidden_layers); build it without with_mtp")
            # Its own layer 0 (MoE by the rule for index 0, as the checkpoint's mtp.layers.0 is); its
            # attention writes layer 0 of the proposer's layers (the plan's draft).
            self.mtp = Qwen3NextMTP(a.hidden_size, a.rms_norm_eps,
                                    Qwen3NextDecoderLayer(a, 0, dtype=dtype, layer_type=FULL), dtype=dtype)

    def mtp_forward(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                    attn) -> torch.Tensor:
        """The MTP layer's head input [T, hidden] (kvforge/models/qwen3_next_mtp.py); ``hidden``: the previous
        hidden state of each row (the model's output, or this layer's own)."""
        return self.mtp.predict(self.model.embed_tokens(next_ids), positions, hidden, attn, self.model.rotary)

    def mtp_logits(self, out: torch.Tensor) -> torch.Tensor:
        """float32 logits of :meth:`mtp_forward`'s output: the target's head."""
        return self.compute_logits(out)

    def make_layer(self, a: Qwen3NextArgs, layer_idx: int, dtype) -> Qwen3NextDecoderLayer:
        return Qwen3NextDecoderLayer(a, layer_idx, dtype=dtype)

    def make_rotary(self, a: Qwen3NextArgs) -> RotaryEmbedding:
        return RotaryEmbedding(a.head_dim, a.rotary_dim, a.rope_theta, a.rope_scaling)

    def make_final_norm(self, a: Qwen3NextArgs, dtype) -> GemmaRMSNorm:
        return GemmaRMSNorm(a.hidden_size, a.rms_norm_eps, dtype=dtype)

    def fused_parameters(self) -> dict[str, list[tuple[str, int]]]:
        a = self.args
        key_total = a.linear_num_key_heads * a.linear_key_head_dim
        value_total = a.linear_num_value_heads * a.linear_value_head_dim
        return {"mlp.gate_up_proj": gate_up_parts("mlp", a.intermediate_size),
                "mlp.shared_expert.gate_up_proj": gate_up_parts("mlp.shared_expert",
                                                                a.shared_expert_intermediate_size),
                "linear_attn.in_proj": [("linear_attn.in_proj_qkvz", 2 * key_total + 2 * value_total),
                                        ("linear_attn.in_proj_ba", 2 * a.linear_num_value_heads)]}

    def load_checkpoint_tensor(self, params, name: str, tensor: torch.Tensor):
        """As the decoder's, with the Gated DeltaNet's two input projections regrouped into ``in_proj``'s
        row order first (:meth:`GatedDeltaNet.checkpoint_rows`)."""
        for hf in ("in_proj_qkvz", "in_proj_ba"):
            if f".linear_attn.{hf}." in name:
                try:
                    mixer = self.get_submodule(name.split(f".{hf}.")[0])
                except AttributeError:  # no Gated DeltaNet there: the loader names the tensor it has no place for
                    return None
                tensor = mixer.checkpoint_rows(name, tensor)
        return super().load_checkpoint_tensor(params, name, tensor)

    def linear_state_layouts(self) -> dict[int, LinearStateLayout]:
        """Layer index -> the per-sequence state of each linear-attention layer."""
        layout = self.args.linear_state_layout()
        return {i: layout for i, t in enumerate(self.args.layer_types) if t == LINEAR}

    def skips_checkpoint_tensor(self, name: str) -> bool:
        return (name.startswith("mtp.") and self.mtp is None) or super().skips_checkpoint_tensor(name)

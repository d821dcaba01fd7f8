"""DeepSeek-V2 / DeepSeek-V3: multi-head latent attention (MLA) and DeepSeekMoE, device-agnostic.

Attention (every layer is MLA): the query comes from ``q_proj`` or, with
``q_lora_rank``, from ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` and splits per
head into ``q_nope [Dn]`` and ``q_rope [P]``; ``kv_a_proj_with_mqa(x)`` gives
the latent (``kv_lora_rank`` R, normalised by ``kv_a_layernorm``) and one
shared rope key ``k_rope [P]``. Rope touches only the ``P`` rope features.
``q_proj`` (or ``q_a_proj``) and ``kv_a_proj_with_mqa`` read the same input,
so DeepSeek's layers stack them in one parameter, ``fused_qkv_a_proj`` (query
rows first; loaded from the two HF tensors), one product a layer
(:func:`fuses_input_projections`).
The model hands ``(layer, q_nope, q_rope, latent, k_rope, w_uk, w_uv)`` to
``attn.mla`` (the runner's MLA callable, see kvforge/engine/model_runner.py),
where ``w_uk [H, Dn, R]`` / ``w_uv [H, V, R]`` are the key and value halves of
``kv_b_proj.weight``; the backend caches ``[latent | k_rope]`` per token and
returns ``[T, H, V]``, which goes through ``o_proj``.

Rope: DeepSeek pairs rotary features interleaved ``(x0, x1), (x2, x3), ...``
(V2 always; V3 when ``rope_interleave`` is true, the default); otherwise the
rotate-half pairing. Rotated vectors are written de-interleaved (first all
pair-first components, then all pair-second ones) for q and k alike, so dot
products equal transformers'. YaRN (``rope_scaling.type == "yarn"``) changes
the frequencies, multiplies cos/sin by the attention factor
(``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` or
``attention_factor``) and the softmax scale by ``mscale(factor, mscale_all_dim)^2``.

MoE (layer ``i`` with ``n_routed_experts``, ``i >= first_k_dense_replace`` and
``i % moe_layer_freq == 0``; other layers use a dense MLP of
``intermediate_size``): shared experts (one gated MLP of
``n_shared_experts * moe_intermediate_size``) plus ``num_experts_per_tok``
routed experts chosen by the float32 router ``mlp.gate.weight``:

* V2: softmax scores; ``topk_method`` "greedy" or "group_limited_greedy"
  (keep the ``topk_group`` groups of ``n_group`` with the highest max score);
  weights are the top-k scores normalised when ``norm_topk_prob`` (and top-k
  > 1), else multiplied by ``routed_scaling_factor`` (the original DeepSeek-V2
  code; transformers ignores ``norm_topk_prob``, which V2 configs set false).
* V3: sigmoid scores; choice by ``scores + e_score_correction_bias`` within the
  ``topk_group`` groups with the highest sum of their top-2 biased scores;
  weights are the unbiased scores, normalised when ``norm_topk_prob``, times
  ``routed_scaling_factor``.

Weights use transformers' names; routed experts come per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``, the hub layout) or fused
(``mlp.experts.gate_up_proj`` [E, 2I, hidden], ``mlp.experts.down_proj``
[E, hidden, I]). Multi-token-prediction layers (index >= num_hidden_layers)
are skipped unless the model is built ``with_mtp`` (speculative method mtp): then the first one,
``model.layers.{num_hidden_layers}``, loads into ``mtp_layers`` (kvforge/models/deepseek_mtp.py) and
:meth:`DeepseekV2ForCausalLM.mtp_forward` runs it, through a runner over the plan's proposer layers (its
attention is their layer 0). FP8 block-quantized checkpoints (``weight_scale_inv``) are not
supported.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.errors import ConfigError
from kvforge.models.decoder import (
    DecoderArgs,
    DecoderForCausalLM,
    PreNormDecoderLayer,
    gate_up_parts,
    required_int,
)
from kvforge.models.deepseek_mtp import DeepseekMTPLayer
from kvforge.models.expert_gemm_route import gated_down_matmul, grouped_expert_matmul, use_triton_expert_gemm
from kvforge.models.expert_loop import sum_over_experts
from kvforge.models.expert_rows import group_by_expert, weighted_sum_per_token
from kvforge.models.grouped_mm import grouped_mm_problem
from kvforge.models.layers import GatedMLP, RMSNorm, act_and_mul, cfg_get, fused_kernels, get_activation
from kvforge.models.linear_route import Linear
from kvforge.models.routed_experts import RoutedExperts
from kvforge.models.router_topk import RouterRule, route
from kvforge.models.stacked_experts import StackedExpertsCheckpoint
from kvforge.models.yarn import yarn_attention_factor, yarn_inv_freq, yarn_mscale

LORA_NORM_EPS = 1e-6
"""eps of q_a_layernorm / kv_a_layernorm: fixed (not rms_norm_eps) in DeepSeek's and transformers' code."""


def read_mla_sizes(a: DecoderArgs, config: dict) -> None:
    """Sets on ``a`` the sizes :class:`MLAAttention` reads: ``kv_lora_rank``, ``qk_rope_head_dim``,
    ``qk_nope_head_dim``, ``v_head_dim``, ``q_lora_rank`` (None: no query LoRA), ``qk_head_dim`` and
    ``attention_bias``."""
    a.kv_lora_rank = required_int(config, "kv_lora_rank")
    a.qk_rope_head_dim = required_int(config, "qk_rope_head_dim")
    a.qk_nope_head_dim = required_int(config, "qk_nope_head_dim")
    a.v_head_dim = required_int(config, "v_head_dim")
    q_lora = config.get("q_lora_rank")
    a.q_lora_rank = int(q_lora) if q_lora else None
    a.qk_head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim
    a.attention_bias = bool(cfg_get(config, "attention_bias", False))


class DeepseekArgs(DecoderArgs):
    """The numbers the model needs, validated, from an HF config dict."""

    FAMILY = "DeepSeek"
    ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
    DEFAULT_ARCH = "DeepseekV3ForCausalLM"

    def __init__(self, config: dict):
        super().__init__(config)
        self.v3 = self.arch == "DeepseekV3ForCausalLM"
        read_mla_sizes(self, config)
        self.rope_interleave = bool(cfg_get(config, "rope_interleave", True)) if self.v3 else True
        # MoE
        self.n_routed_experts = int(cfg_get(config, "n_routed_experts", 0))
        self.n_shared_experts = int(cfg_get(config, "n_shared_experts", 0))
        self.moe_intermediate_size = int(cfg_get(config, "moe_intermediate_size", self.intermediate_size))
        self.top_k = int(cfg_get(config, "num_experts_per_tok", 1))
        self.first_k_dense_replace = int(cfg_get(config, "first_k_dense_replace", 0))
        self.moe_layer_freq = int(cfg_get(config, "moe_layer_freq", 1))
        self.routed_scaling_factor = float(cfg_get(config, "routed_scaling_factor", 1.0))
        self.norm_topk_prob = bool(cfg_get(config, "norm_topk_prob", self.v3))
        self.n_group = int(cfg_get(config, "n_group", 1))
        self.topk_group = int(cfg_get(config, "topk_group", self.n_group))
        default_method = "noaux_tc" if self.v3 else "greedy"
        self.topk_method = cfg_get(config, "topk_method", default_method)
        if self.v3:
            if cfg_get(config, "scoring_func", "sigmoid") != "sigmoid":
                raise ConfigError("DeepseekV3 supports scoring_func 'sigmoid' only")
        else:
            if self.topk_method not in ("greedy", "group_limited_greedy"):
                raise ConfigError(f"DeepseekV2 topk_method {self.topk_method!r} is not supported "
                                  f"(supported: greedy, group_limited_greedy)")
            if cfg_get(config, "scoring_func", "softmax") != "softmax":
                raise ConfigError("DeepseekV2 supports scoring_func 'softmax' only")
        uses_groups = self.v3 or self.topk_method == "group_limited_greedy"
        if self.n_routed_experts and uses_groups and self.n_routed_experts % self.n_group:
            raise ConfigError(f"n_routed_experts {self.n_routed_experts} must be a multiple of n_group {self.n_group}")
        # Rope and softmax scale
        self.max_position_embeddings = int(cfg_get(config, "max_position_embeddings", 4096))
        scale = self.qk_head_dim ** -0.5
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind != "yarn":
                raise ConfigError(f"DeepSeek rope scaling {kind!r} is not supported (supported: yarn)")
            mscale_all_dim = self.rope_scaling.get("mscale_all_dim") or 0
            if mscale_all_dim:
                m = yarn_mscale(self._yarn_factor(), float(mscale_all_dim))
                scale = scale * m * m
        self.softmax_scale = scale

    def _yarn_factor(self) -> float:
        s = self.rope_scaling
        if s.get("factor") is not None:
            return float(s["factor"])
        return self.max_position_embeddings / float(s["original_max_position_embeddings"])

    def is_moe(self, layer: int) -> bool:
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)


def latent_rows(rotary: nn.Module, rope, q_rope: torch.Tensor, kv: torch.Tensor,
                norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_rope, latent, k_rope)`` from ``q_rope [T, H, P]`` and the row ``kv [T, R + P]`` (the latent before
    ``norm``, then the key's rope features): the query's and the key's rope features rotated by ``rotary``
    (its ``rotate_qk``), the latent normalized; what the cache stores, made in separate launches."""
    p = q_rope.shape[-1]
    latent, k_rope = kv.split([kv.shape[-1] - p, p], dim=-1)
    q_rope, k_rope = rotary.rotate_qk(rope, q_rope, k_rope[:, None, :])
    return q_rope, norm(latent), k_rope[:, 0]


class DeepseekRotary(nn.Module):
    """Rope on the ``P`` rope features (default or YaRN frequencies), see the module docstring."""

    def __init__(self, a: DeepseekArgs):
        super().__init__()
        self.dim = a.qk_rope_head_dim
        if self.dim % 2:
            raise ConfigError(f"qk_rope_head_dim {self.dim} must be even")
        self.args = a
        self.interleave = a.rope_interleave
        self.attention_factor = 1.0
        self.register_buffer("inv_freq", torch.empty(self.dim // 2, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def _compute(self) -> tuple[torch.Tensor, float]:
        a, dim, base = self.args, self.dim, self.args.rope_theta
        s = a.rope_scaling
        if s is None:
            return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim), 1.0
        factor = a._yarn_factor()
        return yarn_inv_freq(dim, base, s, factor), yarn_attention_factor(s, factor)

    def reset_parameters(self) -> None:
        if self.inv_freq.device.type == "meta":
            return
        inv_freq, self.attention_factor = self._compute()
        with torch.no_grad():
            self.inv_freq.copy_(inv_freq)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, P / 2]`` cos and sin (times the YaRN attention factor)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        f = self.attention_factor
        return (freqs.cos() * f)[:, None, :].to(dtype), (freqs.sin() * f)[:, None, :].to(dtype)

    def rotate_qk(self, rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
                  k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`rotate` of ``q [T, Hq, P]`` and ``k [T, Hk, P]``: one fused Triton kernel on CUDA
        (kvforge/kernels/triton_rope.py, ``rope_qk_pairs``; the same products and roundings), else the
        formula twice."""
        cos, sin = rope
        kern = fused_kernels(q)
        if (kern is not None and q.dim() == 3 and k.dim() == 3 and q.shape[0] > 0
                and q.dtype == k.dtype == cos.dtype == sin.dtype
                and q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1):
            return kern[2].rope_qk_pairs(q, k, cos, sin, self.interleave)
        return self.rotate(rope, q), self.rotate(rope, k)

    def latent_rows(self, rope: tuple[torch.Tensor, torch.Tensor], q_rope: torch.Tensor, kv: torch.Tensor,
                    norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`latent_rows` with this rotary."""
        return latent_rows(self, rope, q_rope, kv, norm)

    def rotate(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``x [T, H, P]`` -> rotated, de-interleaved ``[T, H, P]``."""
        cos, sin = rope
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


#: Whether DeepSeek's layers stack their two input projections in one parameter (one product a layer).
FUSE_INPUT_PROJECTIONS = True


def fuses_input_projections(a: DeepseekArgs) -> bool:
    """Whether a DeepSeek layer stacks the query's input projection (``q_proj``, or ``q_a_proj`` with a query
    LoRA) and ``kv_a_proj_with_mqa`` in ``fused_qkv_a_proj``: when :data:`FUSE_INPUT_PROJECTIONS` is on and
    both have a bias or neither has (``q_proj`` never has one)."""
    return FUSE_INPUT_PROJECTIONS and (a.q_lora_rank is not None or not a.attention_bias)


def input_projection_parts(a: DeepseekArgs) -> list[tuple[str, int]]:
    """The HF tensors stacked in ``self_attn.fused_qkv_a_proj`` (``a``: the args of the heads held here)."""
    q = ("self_attn.q_proj", a.num_heads * a.qk_head_dim) if a.q_lora_rank is None else ("self_attn.q_a_proj",
                                                                                         a.q_lora_rank)
    return [q, ("self_attn.kv_a_proj_with_mqa", a.kv_lora_rank + a.qk_rope_head_dim)]


class MLAAttention(nn.Module):
    """One MLA layer (module docstring). ``fuse_inputs``: the two input projections as one parameter,
    ``fused_qkv_a_proj`` (:func:`fuses_input_projections` says where the model may)."""

    def __init__(self, a: DeepseekArgs, layer_idx: int, dtype=None, fuse_inputs: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.a = a
        h, qk = a.num_heads, a.qk_head_dim
        q_in = h * qk if a.q_lora_rank is None else a.q_lora_rank
        kv_in = a.kv_lora_rank + a.qk_rope_head_dim
        self.input_split = (q_in, kv_in)
        self.fuse_inputs = fuse_inputs
        if fuse_inputs:
            self.fused_qkv_a_proj = Linear(a.hidden_size, q_in + kv_in, bias=a.attention_bias, dtype=dtype)
        elif a.q_lora_rank is None:
            self.q_proj = Linear(a.hidden_size, q_in, bias=False, dtype=dtype)
        else:
            self.q_a_proj = Linear(a.hidden_size, q_in, bias=a.attention_bias, dtype=dtype)
        if a.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, LORA_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(a.q_lora_rank, h * qk, bias=False, dtype=dtype)
        if not fuse_inputs:
            self.kv_a_proj_with_mqa = Linear(a.hidden_size, kv_in, bias=a.attention_bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, LORA_NORM_EPS, dtype=dtype)
        self.kv_b_proj = nn.Linear(a.kv_lora_rank, h * (a.qk_nope_head_dim + a.v_head_dim), bias=False, dtype=dtype)
        self.o_proj = Linear(h * a.v_head_dim, a.hidden_size, bias=a.attention_bias, dtype=dtype)

    @property
    def input_projection(self) -> Linear | None:
        """The one reader of the forward's ``x`` where the input projections are stacked
        (kvforge/models/linear_route.py, ``norm_input``); None where two projections read it."""
        return self.fused_qkv_a_proj if self.fuse_inputs else None

    def forward(self, rope, x, attn, rotary: DeepseekRotary) -> torch.Tensor:
        a = self.a
        h, dn, p, r = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
        if self.fuse_inputs:
            q, kv = self.fused_qkv_a_proj(x).split(self.input_split, dim=-1)
        else:
            q = self.q_proj(x) if a.q_lora_rank is None else self.q_a_proj(x)
            kv = self.kv_a_proj_with_mqa(x)
        if a.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        t = q.shape[0]  # x may be a pending norm (the stacked projection's prologue), q is a tensor
        q_nope, q_rope = q.view(t, h, dn + p).split([dn, p], dim=-1)
        w = self.kv_b_proj.weight.view(h, dn + a.v_head_dim, r)
        mla_rows = getattr(attn, "mla_rows", None)
        if mla_rows is not None and isinstance(rotary, DeepseekRotary):  # the latent's norm and rope in the write
            out = mla_rows(self.layer_idx, q_nope, q_rope, kv, self.kv_a_layernorm, rope, rotary, w[:, :dn],
                           w[:, dn:])
        else:
            q_rope, latent, k_rope = latent_rows(rotary, rope, q_rope, kv, self.kv_a_layernorm)
            out = attn.mla(self.layer_idx, q_nope, q_rope, latent, k_rope, w[:, :dn], w[:, dn:])
        return self.o_proj(out.reshape(t, h * a.v_head_dim))


class Gate(nn.Module):
    """The float32 router (HF ``mlp.gate``): returns (weights [T, k], expert ids [T, k]) by
    :meth:`rule` (kvforge/models/router_topk.py)."""

    def __init__(self, a: DeepseekArgs):
        super().__init__()
        self.a = a
        e = a.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, a.hidden_size, dtype=torch.float32))
        if a.v3:
            self.e_score_correction_bias = nn.Parameter(torch.empty(e, dtype=torch.float32))
        self.launch_counter: torch.Tensor | None = None  # the one-launch router's (router_topk.route)
        self._rules: dict[int, RouterRule] = {}  # rule(shared), made once per slot count

    def _launch_counter(self, x: torch.Tensor) -> torch.Tensor:
        """This router's int32 zero on ``x``'s device (made at the first call there, before any capture)."""
        if self.launch_counter is None or self.launch_counter.device != x.device:
            self.launch_counter = torch.zeros(1, dtype=torch.int32, device=x.device)
        return self.launch_counter

    def rule(self, shared: int = 0) -> RouterRule:
        """The module docstring's choice as a :class:`RouterRule`. V3: sigmoid scores, the biased choice, groups
        scored by their top two, the weights renormalised (``norm_topk_prob``) and always times
        ``routed_scaling_factor``. V2: softmax scores, groups (``group_limited_greedy``) scored by their
        maximum, the weights renormalised (``norm_topk_prob`` and top-k > 1) or else times
        ``routed_scaling_factor``. DeepSeek's code divides by the chosen sum plus 1e-20 where it groups."""
        if shared not in self._rules:
            self._rules[shared] = self._make_rule(shared)
        return self._rules[shared]

    def _make_rule(self, shared: int) -> RouterRule:
        a = self.a
        if a.v3:
            return RouterRule(a.top_k, a.norm_topk_prob, a.routed_scaling_factor, shared, sigmoid=True,
                              n_group=a.n_group, topk_group=a.topk_group, group_score="top2_sum", renorm_eps=1e-20)
        renormalize = a.top_k > 1 and a.norm_topk_prob
        scale = 1.0 if renormalize else a.routed_scaling_factor
        if a.topk_method == "group_limited_greedy":
            return RouterRule(a.top_k, renormalize, scale, shared, n_group=a.n_group, topk_group=a.topk_group,
                              group_score="max", renorm_eps=1e-20)
        return RouterRule(a.top_k, renormalize, scale, shared)

    def forward(self, x: torch.Tensor, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``shared``: slots appended to every token's choice, the ids after the router's experts at weight 1
        (shared experts folded into the stacked ones, :meth:`MoE.fold_shared_experts`); the kernels write
        them themselves."""
        bias = self.e_score_correction_bias if self.a.v3 else None
        return route(x, self.weight, self.rule(shared), bias, self._launch_counter(x))


class MoE(nn.Module):
    """Routed experts (stacked weights) plus shared experts.

    :meth:`fold_shared_experts` may move the shared experts into the stack, behind the routed ones, as
    ``n_shared_experts`` experts of ``moe_intermediate_size`` every token runs at weight 1: the same sum
    (a gated MLP of ``S * I`` is the sum of ``S`` gated MLPs of ``I`` over its row blocks), in the routed
    experts' launches."""

    #: Whether :meth:`fold_shared_experts` may fold (a subclass whose forward calls ``shared_experts``
    #: itself says no).
    FOLDS_SHARED_EXPERTS = True
    #: Shared experts folded into the stack (the last ``folded_shared`` of ``experts_*``); 0: none.
    folded_shared = 0

    def __init__(self, a: DeepseekArgs, dtype=None):
        super().__init__()
        e, i = a.n_routed_experts, a.moe_intermediate_size
        self.inter = i
        self.gate = Gate(a)
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, a.hidden_size, dtype=dtype))
        self.experts_down = nn.Parameter(torch.empty(e, a.hidden_size, i, dtype=dtype))
        self.act = get_activation(a.hidden_act)
        self.shared_experts = (GatedMLP(a.hidden_size, i * a.n_shared_experts, a.hidden_act, dtype=dtype)
                               if a.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.folded_shared
        if s and self._folded_shared_in_kernel(x):
            return self.routed(x, *self.gate(x, shared=s), shared_slots=s)
        if s:
            shared = self._folded_shared_apart(x)
        else:
            shared = self.shared_experts(x) if self.shared_experts is not None else None
        weights, ids = self.gate(x)
        return self.routed(x, weights, ids, addend=shared)

    def _folded_shared_in_kernel(self, x: torch.Tensor) -> bool:
        """Whether the folded shared experts ride in the routed experts' products for ``x``: where the Triton
        expert kernel takes the step (decode-sized steps). In larger steps ``torch._grouped_mm`` would gather
        every token's row once more per shared expert, so they run apart (:meth:`_folded_shared_apart`)."""
        s, t = self.folded_shared, x.shape[0]
        return use_triton_expert_gemm(t * (self.routed_per_token() + s), x, self.experts_gate_up, s, t * s)

    def routed_per_token(self) -> int:
        """The routed experts each token takes (the router's top-k)."""
        return self.gate.a.top_k

    def _shared_mlp(self) -> nn.Module | None:
        """The shared experts' gated MLP that :meth:`fold_shared_experts` folds (None: nothing to fold)."""
        return self.shared_experts

    def _drop_shared_mlp(self) -> None:
        """After the fold: the shared MLP's module goes (its weights now sit in the stack)."""
        self.shared_experts = None

    @torch.no_grad()
    def fold_shared_experts(self) -> bool:
        """Move the shared experts into the stacked experts (see the class docstring); False where there is
        nothing to fold, the class does not fold, or it is done. New stacked tensors on the weights' device;
        the shared experts' module is dropped."""
        if not self.FOLDS_SHARED_EXPERTS or self.folded_shared:
            return False
        mlp = self._shared_mlp()
        if mlp is None:
            return False
        gate_up, down = mlp.gate_up_proj.weight, mlp.down_proj.weight  # [2 * S * I, H] (gate rows, up rows), [H, S * I]
        e, two_i, hidden = self.experts_gate_up.shape
        i = two_i // 2
        if mlp.intermediate_size % i or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
            return False
        s = mlp.intermediate_size // i
        stacked_gate_up = self.experts_gate_up.new_empty(e + s, two_i, hidden)
        stacked_gate_up[:e] = self.experts_gate_up
        stacked_gate_up[e:, :i] = gate_up[: s * i].view(s, i, hidden)
        stacked_gate_up[e:, i:] = gate_up[s * i:].view(s, i, hidden)
        stacked_down = self.experts_down.new_empty(e + s, hidden, i)
        stacked_down[:e] = self.experts_down
        stacked_down[e:] = down.view(hidden, s, i).permute(1, 0, 2)
        self.experts_gate_up = nn.Parameter(stacked_gate_up, requires_grad=False)
        self.experts_down = nn.Parameter(stacked_down, requires_grad=False)
        self._drop_shared_mlp()
        self.folded_shared = s
        return True

    def routed_experts(self) -> RoutedExperts:
        """The routed experts held here (stacked; folded shared experts left out), top-k of the router's
        experts (the router holds all of them)."""
        held = self.experts_down.shape[0] - self.folded_shared
        return RoutedExperts((self.experts_gate_up[:held], self.experts_down[:held]), self.gate.a.top_k,
                             self.gate.weight.shape[0])

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               valid: torch.Tensor | None = None, addend: torch.Tensor | None = None,
               shared_slots: int = 0) -> torch.Tensor:
        """``addend[t] + sum_k weights[t, k] * expert[ids[t, k]](x[t])`` over the slots this module holds.

        ``ids`` [T, k] index this module's experts; ``valid`` (bool [T, k], None = all) marks the slots
        whose expert is here (tensor parallelism splits experts by index); ``addend`` [T, hidden] (None:
        nothing), the shared experts' output, joins the grouped path's float32 sum before its rounding.
        ``shared_slots``: the last slots of ``ids`` are folded shared experts (every token's).
        On CUDA, where ``torch._grouped_mm`` works for the dtype, one grouped GEMM per projection (no host
        sync, so the step can be a CUDA graph); otherwise a loop over the experts that have tokens.
        """
        if x.is_cuda and grouped_mm_problem(x.device, x.dtype) is None:
            return self._routed_grouped(x, weights, ids, valid, addend, shared_slots)
        out = self._routed_loop(x, weights, ids, valid)
        return out if addend is None else out + addend

    def _routed_loop(self, x, weights, ids, valid=None) -> torch.Tensor:
        """Tokens sorted by expert; one pair of GEMMs per expert with tokens (counts read on the host)."""
        if valid is None:
            tok_all = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(ids.shape[1])
            e, w_all = ids.reshape(-1), weights.reshape(-1)
        else:
            tok_all, slot_all = valid.nonzero(as_tuple=True)
            e, w_all = ids[tok_all, slot_all], weights[tok_all, slot_all]
        return sum_over_experts(x, tok_all, e, w_all, self.experts_down.shape[0], self._expert)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Routed expert ``expert``'s gated MLP on rows ``x``."""
        gate, up = F.linear(x, self.experts_gate_up[expert]).split(self.inter, dim=-1)
        return F.linear(self.act(gate) * up, self.experts_down[expert])

    def _routed_grouped(self, x, weights, ids, valid=None, addend=None, shared_slots: int = 0) -> torch.Tensor:
        """Same sum with static shapes: (token, slot) rows sorted by expert, slots held elsewhere sorted
        last and zeroed; expert row ranges from a device-side count (no host sync)."""
        k = ids.shape[1]
        n = self.experts_down.shape[0]
        flat = ids.reshape(-1)
        if valid is not None:
            flat = torch.where(valid.reshape(-1), flat, torch.full_like(flat, n))
        rows = group_by_expert(flat, n, k, shared_slots)
        gate_up = grouped_expert_matmul(x, self.experts_gate_up, rows, gather=True)
        y = gated_down_matmul(gate_up, self.experts_down, rows, self.act)
        del gate_up
        return weighted_sum_per_token(y, rows, weights, valid, addend).to(x.dtype)

    def _folded_shared_apart(self, x: torch.Tensor) -> torch.Tensor:
        """The folded shared experts' sum over ``x`` [T, hidden] as dense products of the stack's last
        experts, one expert after the other (each operand contiguous), the down products accumulated into
        one output (cuBLAS ``addmm``): the weighted sum's addend."""
        first = self.experts_down.shape[0] - self.folded_shared
        out = None
        for e in range(first, self.experts_down.shape[0]):
            h = act_and_mul(F.linear(x, self.experts_gate_up[e]), self.act)
            out = F.linear(h, self.experts_down[e]) if out is None else torch.addmm(out, h, self.experts_down[e].t())
        return out


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV2ForCausalLM(StackedExpertsCheckpoint, DecoderForCausalLM):
    """DeepSeek-V2 / V3 (see module docstring); the runner's ``attn`` must provide ``attn.mla``.

    Routed experts load and decide CUDA-graph capture through :class:`StackedExpertsCheckpoint`."""

    ARGS = DeepseekArgs
    args: DeepseekArgs

    def __init__(self, config: dict, dtype: torch.dtype | None = None, with_mtp: bool = False):
        super().__init__(config, dtype)
        #: The checkpoint's first multi-token-prediction layer (``with_mtp``), keyed by its layer index.
        self.mtp_layers: nn.ModuleDict | None = None
        self._mtp_params: dict[str, nn.Parameter] | None = None
        if with_mtp:
            if int(config.get("num_nextn_predict_layers") or 0) < 1:
                raise ConfigError(f"{self.arch} config has no multi-token-prediction layer "
                                  f"(num_nextn_predict_layers); build it without with_mtp")
            a, n = self.args, self.num_layers
            block = self.make_layer(a, n, dtype)  # MoE or dense by its checkpoint index
            block.self_attn.layer_idx = 0  # its KV: layer 0 of the proposer's layers (the plan's draft)
            self.mtp_layers = nn.ModuleDict({str(n): DeepseekMTPLayer(
                a.hidden_size, a.vocab_size, a.rms_norm_eps, block.self_attn, block.mlp, dtype=dtype)})

    def mtp_forward(self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                    attn) -> torch.Tensor:
        """The MTP layer's head input [T, hidden] (see kvforge/models/deepseek_mtp.py); ``hidden``: the
        previous hidden state of each row (the model's output, or this layer's own)."""
        return self.mtp_layers[str(self.num_layers)].predict(next_ids, positions, hidden, attn, self.model.rotary)

    def mtp_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.mtp_layers[str(self.num_layers)].logits(out)

    def _is_mtp_tensor(self, name: str) -> bool:
        layer = _LAYER.match(name)
        return layer is not None and self.mtp_layers is not None and int(layer.group(1)) == self.num_layers

    def checkpoint_names(self, name: str, param: torch.Tensor) -> list[str]:
        if name.startswith("mtp_layers."):
            name = "model.layers." + name[len("mtp_layers."):]
        return super().checkpoint_names(name, param)

    def load_weights(self, weights) -> set[str]:
        """As the base class; the MTP layer's parameter view (:meth:`load_checkpoint_tensor`) is dropped
        afterwards, so that tensors replaced later (:meth:`MoE.fold_shared_experts`) are not held by it."""
        try:
            return super().load_weights(weights)
        finally:
            self._mtp_params = None

    def load_checkpoint_tensor(self, params, name: str, tensor: torch.Tensor):
        """The MTP layer's tensors load by their HF names into ``mtp_layers`` (a view of its parameters
        under ``model.layers.{n}``); everything else as for any layer."""
        if self._is_mtp_tensor(name):
            if self._mtp_params is None:
                self._mtp_params = {"model.layers." + k[len("mtp_layers."):]: p
                                    for k, p in self.named_parameters() if k.startswith("mtp_layers.")}
            params = self._mtp_params
        return super().load_checkpoint_tensor(params, name, tensor)

    def make_layer(self, a: DeepseekArgs, layer_idx: int, dtype) -> PreNormDecoderLayer:
        mlp = (MoE(a, dtype=dtype) if a.is_moe(layer_idx)
               else GatedMLP(a.hidden_size, a.intermediate_size, a.hidden_act, dtype=dtype))
        attn = MLAAttention(a, layer_idx, dtype=dtype, fuse_inputs=fuses_input_projections(a))
        return PreNormDecoderLayer(a.hidden_size, a.rms_norm_eps, attn, mlp, dtype=dtype)

    def make_rotary(self, a: DeepseekArgs) -> DeepseekRotary:
        return DeepseekRotary(a)

    def fused_parameters(self) -> dict[str, list[tuple[str, int]]]:
        """gate/up of the dense MLPs and of the shared experts (routed experts: see :meth:`load_checkpoint_tensor`),
        and the attention's input projections where :func:`fuses_input_projections`."""
        a = self.args
        parts = {"mlp.gate_up_proj": gate_up_parts("mlp", a.intermediate_size),
                 "mlp.shared_experts.gate_up_proj": gate_up_parts("mlp.shared_experts",
                                                                  a.moe_intermediate_size * a.n_shared_experts)}
        if fuses_input_projections(a):
            parts["self_attn.fused_qkv_a_proj"] = input_projection_parts(a)
        return parts

    def skips_checkpoint_tensor(self, name: str) -> bool:
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= self.num_layers and not self._is_mtp_tensor(name):
            return True  # multi-token-prediction layers (all of them, or those past the one built)
        return super().skips_checkpoint_tensor(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass

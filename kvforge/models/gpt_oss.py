"""gpt-oss (``GptOssForCausalLM``), device-agnostic PyTorch.

What differs from Llama:

* ``layer_types`` alternate sliding-window (``sliding_window`` tokens) and
  full attention (default: even layers slide);
* every attention layer has one learned sink logit per query head
  (``self_attn.sinks``, ``[num_heads]``): it joins the softmax denominator and
  has no value. The runner reads it with :meth:`GptOssForCausalLM.attention_sinks`
  and hands it to the attention backend; q/k/v/o projections carry biases;
* YaRN rope (``rope_parameters`` / ``rope_scaling`` of type ``yarn``): blended
  inverse frequencies and cos/sin multiplied by the attention factor;
* every MLP is a top-k mixture of experts: router ``F.linear`` with bias, top-k
  of the logits, softmax over the k chosen; expert ``e`` maps ``x`` to
  ``down_e(glu) + b``, with ``gate, up`` the even / odd columns of
  ``x @ gate_up_proj[e] + bias``, ``gate`` clamped above at ``limit``, ``up`` to
  ``[-limit, limit]`` and ``glu = (up + 1) * gate * sigmoid(alpha * gate)``
  (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0).

Expert weights keep transformers' shapes (``[E, in, out]``, gate/up columns
interleaved) and names, so checkpoint tensors load by name; their storage is
out-major (``[E, out, in]`` contiguous, seen through a transpose), the layout the
routed-experts kernel streams. MXFP4-quantized
expert tensors (``*_blocks`` / ``*_scales``) are refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.errors import ConfigError
from kvforge.models.decoder import DecoderArgs, DecoderForCausalLM, PreNormDecoderLayer, qkv_parts
from kvforge.models.expert_gemm_route import grouped_expert_matmul
from kvforge.models.expert_loop import sum_over_experts
from kvforge.models.expert_rows import group_by_expert, weighted_sum_per_token
from kvforge.models.grouped_mm import grouped_mm_problem
from kvforge.models.layers import RotaryEmbedding, cfg_get
from kvforge.models.linear_route import Linear
from kvforge.models.routed_experts import RoutedExperts
from kvforge.models.router_topk import RouterRule, router_topk
from kvforge.models.yarn import yarn_attention_factor, yarn_inv_freq

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' GptOssConfig defaults for configs that state no rope.
_DEFAULT_THETA = 150000.0
_DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def gpt_oss_rope(config: dict) -> tuple[float, dict | None]:
    """(rope theta, rope scaling or None) from ``rope_parameters`` (transformers 5.x) or ``rope_scaling``."""
    params = config.get("rope_parameters") or config.get("rope_scaling")
    theta = float(cfg_get(config, "rope_theta", _DEFAULT_THETA))
    if params is None:
        return theta, dict(_DEFAULT_YARN)
    params = dict(params)
    theta = float(params.get("rope_theta", theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ConfigError(f"gpt-oss rope type {kind!r} is not supported (supported: default, yarn)")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in params:
            raise ConfigError(f"gpt-oss yarn rope needs {key!r}; got {sorted(params)}")
    return theta, params


class GptOssArgs(DecoderArgs):
    """The numbers the model needs, validated, from an HF ``GptOssForCausalLM`` config dict."""

    FAMILY = "gpt-oss"
    ARCHITECTURES = ("GptOssForCausalLM",)
    DEFAULT_ARCH = "GptOssForCausalLM"

    def __init__(self, config: dict):
        super().__init__(config)
        self.read_grouped_query_heads(config)
        self.num_experts = int(cfg_get(config, "num_local_experts", cfg_get(config, "num_experts", 0)))
        self.top_k = int(cfg_get(config, "num_experts_per_tok", 4))
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"gpt-oss needs num_local_experts >= 1 and 1 <= num_experts_per_tok <= experts; got "
                              f"{self.num_experts} experts, top {self.top_k}")
        self.rms_norm_eps = float(cfg_get(config, "rms_norm_eps", 1e-5))
        self.swiglu_alpha = float(cfg_get(config, "swiglu_alpha", 1.702))
        self.swiglu_limit = float(cfg_get(config, "swiglu_limit", 7.0))
        self.attention_bias = bool(cfg_get(config, "attention_bias", True))
        self.softmax_scale = self.head_dim**-0.5
        types = config.get("layer_types")
        if types is None:
            types = [SLIDING if i % 2 == 0 else FULL for i in range(self.num_layers)]
        if not isinstance(types, list) or len(types) != self.num_layers or set(types) - {SLIDING, FULL}:
            raise ConfigError(f"config 'layer_types' must list {self.num_layers} entries of {SLIDING!r} / {FULL!r}, "
                              f"got {types!r}")
        self.layer_types = list(types)
        window = config.get("sliding_window")
        if SLIDING in self.layer_types and not window:
            raise ConfigError("gpt-oss config has sliding layers but no 'sliding_window'")
        self.windows = [int(window) if t == SLIDING else None for t in self.layer_types]
        self.rope_theta, self.rope_scaling = gpt_oss_rope(config)


class GptOssRotaryEmbedding(RotaryEmbedding):
    """Rotate-half rope with optional YaRN (kvforge/models/yarn.py): its inverse frequencies, cos and sin
    multiplied by its attention factor (in float32, before the cast to the activation dtype)."""

    def __init__(self, head_dim: int, theta: float, yarn: dict | None):
        self.yarn = yarn  # read by reset_parameters, which the base constructor calls
        self.attention_factor = 1.0 if yarn is None else yarn_attention_factor(yarn, float(yarn["factor"]))
        super().__init__(head_dim, head_dim, theta, None)

    def reset_parameters(self) -> None:
        if self.inv_freq.device.type == "meta":
            return
        if self.yarn is None:
            super().reset_parameters()
            return
        with torch.no_grad():
            self.inv_freq.copy_(yarn_inv_freq(self.head_dim, self.theta, self.yarn, float(self.yarn["factor"])))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        f = self.attention_factor
        return (emb.cos() * f).to(dtype), (emb.sin() * f).to(dtype)


class GptOssAttention(nn.Module):
    def __init__(self, a: GptOssArgs, layer_idx: int, dtype=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.qkv_proj = Linear(a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.attention_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, a.hidden_size, bias=a.attention_bias, dtype=dtype)
        self.sinks = nn.Parameter(torch.zeros(a.num_heads, dtype=dtype))

    def forward(self, rope, x: torch.Tensor, attn, rotary: RotaryEmbedding) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = rotary.apply(rope, q, k)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(t, self.q_size))


class GptOssRouter(nn.Module):
    """Top-k routing: softmax over the k largest ``x @ weight.T + bias`` logits, which is the softmax over
    all of them renormalised over the k chosen: :func:`router_topk`'s softmax rule with ``renormalize``
    (one kernel on CUDA after the product, where ``torch.topk`` and a softmax were two; ties go to the lower
    expert index)."""

    def __init__(self, a: GptOssArgs, dtype=None):
        super().__init__()
        self.top_k = a.top_k
        self.weight = nn.Parameter(torch.zeros(a.num_experts, a.hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(a.num_experts, dtype=dtype))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in the logits' dtype, expert ids [T, k])."""
        logits = F.linear(x, self.weight, self.bias)
        weights, ids = router_topk(logits, RouterRule(self.top_k, renormalize=True))
        return weights.to(logits.dtype), ids


class GptOssExperts(nn.Module):
    """``num_local`` experts with the clamped SwiGLU (see module docstring), HF names and layout.

    ``first`` is the global index of this module's first expert (tensor
    parallelism splits experts by index; TP=1 holds all of them).
    """

    def __init__(self, a: GptOssArgs, num_local: int | None = None, first: int = 0, dtype=None):
        super().__init__()
        e = a.num_experts if num_local is None else num_local
        h, i = a.hidden_size, a.intermediate_size
        self.first, self.num_local = first, e
        self.alpha, self.limit = a.swiglu_alpha, a.swiglu_limit
        # HF's [E, in, out] parameters, stored out-major ([E, out, in] contiguous, seen through a transpose):
        # the same names, shapes, values and loading, and the layout the routed-experts kernel streams.
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h, dtype=dtype).transpose(1, 2))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i, dtype=dtype))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i, dtype=dtype).transpose(1, 2))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h, dtype=dtype))

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert[ids[t, k]](x[t])`` over the slots whose expert this module holds.

        On CUDA, where ``torch._grouped_mm`` works for the dtype, one grouped product per projection (the
        Triton expert kernel or ``torch._grouped_mm``: kvforge/models/expert_gemm_route.py; no host sync, so
        decode steps can be CUDA graphs); otherwise a loop over the experts that have tokens.
        """
        if x.is_cuda and grouped_mm_problem(x.device, x.dtype) is None:
            return self.grouped(x, weights, ids)
        return self.loop(x, weights, ids)

    def loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert; one pair of GEMMs per expert with tokens (counts read on the host)."""
        local = ids - self.first
        held = (local >= 0) & (local < self.num_local)
        tok_all, slot_all = held.nonzero(as_tuple=True)
        return sum_over_experts(x, tok_all, local[tok_all, slot_all], weights[tok_all, slot_all], self.num_local,
                                self._expert)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``expert``'s clamped-SwiGLU MLP on rows ``x``."""
        gate_up = x @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
        return self.glu(gate_up) @ self.down_proj[expert] + self.down_proj_bias[expert]

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same sum with static shapes: (token, slot) rows sorted by expert, slots held by other ranks
        sorted last and zeroed; expert row ranges from a device-side count (no host sync)."""
        k = ids.shape[1]
        n = self.num_local
        local = ids - self.first
        held = (local >= 0) & (local < n)
        flat = torch.where(held, local, torch.full_like(local, n)).reshape(-1)
        rows = group_by_expert(flat, n, k)
        gate_up = grouped_expert_matmul(x, self.gate_up_proj.transpose(1, 2), rows, gather=True,
                                        bias=self.gate_up_proj_bias)
        y = grouped_expert_matmul(self.glu(gate_up), self.down_proj.transpose(1, 2), rows, gather=False,
                                  bias=self.down_proj_bias)
        del gate_up
        return weighted_sum_per_token(y, rows, weights, held).to(x.dtype)


class GptOssMLP(nn.Module):
    def __init__(self, a: GptOssArgs, dtype=None):
        super().__init__()
        self.router = GptOssRouter(a, dtype=dtype)
        self.experts = GptOssExperts(a, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)

    def routed_experts(self) -> RoutedExperts:
        """Every expert tensor held here (projections and their biases), top-k of the router's experts (the
        router holds all of them; tensor parallelism keeps a share of the experts)."""
        e = self.experts
        return RoutedExperts((e.gate_up_proj, e.gate_up_proj_bias, e.down_proj, e.down_proj_bias),
                             self.router.top_k, self.router.weight.shape[0])


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss decoder over a flat batch; ``attn(layer, q, k, v)`` is the runner's (see module docstring)."""

    ARGS = GptOssArgs
    args: GptOssArgs

    def __init__(self, config: dict, dtype: torch.dtype | None = None):
        super().__init__(config, dtype=dtype)
        a = self.args
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim

    def make_layer(self, a: GptOssArgs, layer_idx: int, dtype) -> PreNormDecoderLayer:
        return PreNormDecoderLayer(a.hidden_size, a.rms_norm_eps, GptOssAttention(a, layer_idx, dtype=dtype),
                                   GptOssMLP(a, dtype=dtype), dtype=dtype)

    def make_rotary(self, a: GptOssArgs) -> GptOssRotaryEmbedding:
        return GptOssRotaryEmbedding(a.head_dim, a.rope_theta, a.rope_scaling)

    def fused_parameters(self) -> dict[str, list[tuple[str, int]]]:
        return {"self_attn.qkv_proj": qkv_parts(self.args)}

    # -- runner interface ----------------------------------------------------
    def sliding_window(self, layer_idx: int) -> int | None:
        return self.args.windows[layer_idx]

    @property
    def cuda_graph_unsupported_reason(self) -> str | None:
        """Why decode steps cannot be captured (None: they can): the experts are capturable on CUDA where
        ``torch._grouped_mm`` works for the weights' dtype; otherwise they loop with host-side counts."""
        w = self.model.layers[0].mlp.experts.down_proj
        if w.device.type != "cuda":
            return "the MoE layers loop over experts with host-side token counts"
        problem = grouped_mm_problem(w.device, w.dtype)
        return f"the MoE layers loop over experts with host-side token counts ({problem})" if problem else None

    def attention_sinks(self, layer_idx: int) -> torch.Tensor:
        """The sink logits ``[num_heads on this rank]`` of layer ``layer_idx``."""
        return self.model.layers[layer_idx].self_attn.sinks

    # -- weights ---------------------------------------------------------------
    def load_checkpoint_tensor(self, params, name: str, tensor: torch.Tensor):
        if ".mlp.experts." in name and name.endswith(("_blocks", "_scales")):
            raise ConfigError(
                f"{name}: MXFP4-quantized expert weights are not supported; use a bf16/fp32 checkpoint "
                "(for example one saved by transformers with Mxfp4Config(dequantize=True))"
            )
        return super().load_checkpoint_tensor(params, name, tensor)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters; the set of HF names written.

        ConfigError on MXFP4 expert tensors, an unknown name, a shape mismatch or missing attention sinks.
        """
        loaded = super().load_weights(weights)
        no_sinks = [i for i in range(self.num_layers) if f"model.layers.{i}.self_attn.sinks" not in loaded]
        if no_sinks:
            raise ConfigError(
                f"the checkpoint has no attention sinks (model.layers.N.self_attn.sinks, [{self.num_heads}]) for "
                f"{len(no_sinks)} of {self.num_layers} layers (first: layer {no_sinks[0]}); gpt-oss attention "
                "needs one per layer: use a complete gpt-oss checkpoint"
            )
        return loaded

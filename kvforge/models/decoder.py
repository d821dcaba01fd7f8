"""The skeleton every decoder-only model here shares, so a model family writes only what differs.

A model is ``embed_tokens -> layers -> norm -> lm_head`` over a flat batch of
``T`` tokens. :class:`DecoderForCausalLM` owns that skeleton, the runner
interface (``forward``, ``compute_logits``, ``sliding_window``,
``reset_buffers``) and loading HF-named checkpoint tensors. A family supplies:

* ``ARGS``: a :class:`DecoderArgs` subclass reading its extra config keys and
  setting ``softmax_scale``;
* ``make_layer(args, index, dtype)``: usually a :class:`PreNormDecoderLayer`
  around the family's attention and MLP (or MoE) module;
* ``make_rotary(args)``: the module computing rope ``cos_sin`` once per step;
* optionally ``make_final_norm`` (default RMSNorm) and ``forward`` for a
  layer protocol other than :class:`PreNormDecoderLayer`'s;
* ``fused_parameters()``: which of its parameters stack several HF tensors
  (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``).

Parameter names mirror transformers' so checkpoints load by name, except the
fused ones declared in ``fused_parameters``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

import torch
from torch import nn

from kvforge.errors import ConfigError
from kvforge.models.layers import RMSNorm, cfg_get, rope_parameters
from kvforge.models.linear_route import linear, norm_input, stream_of


def required_int(config: dict, key: str) -> int:
    try:
        return int(config[key])
    except KeyError:
        raise ConfigError(f"model config lacks required key {key!r}") from None


class DecoderArgs:
    """The numbers every decoder reads from an HF config dict, validated.

    ``ARCHITECTURES`` lists the architecture names the family runs; a config
    without ``architectures`` gets ``DEFAULT_ARCH``. Subclasses read their own
    keys after calling this constructor and must set ``softmax_scale``.
    """

    FAMILY = ""
    ARCHITECTURES: tuple[str, ...] = ()
    DEFAULT_ARCH = ""

    def __init__(self, config: dict):
        archs = config.get("architectures") or []
        self.arch = archs[0] if archs else self.DEFAULT_ARCH
        if self.arch not in self.ARCHITECTURES:
            raise ConfigError(f"the {self.FAMILY} implementation cannot run {self.arch!r}; "
                              f"it runs {', '.join(self.ARCHITECTURES)}")
        self.hidden_size = required_int(config, "hidden_size")
        self.num_layers = required_int(config, "num_hidden_layers")
        self.num_heads = required_int(config, "num_attention_heads")
        self.intermediate_size = required_int(config, "intermediate_size")
        self.vocab_size = required_int(config, "vocab_size")
        self.rms_norm_eps = float(cfg_get(config, "rms_norm_eps", 1e-6))
        self.hidden_act = cfg_get(config, "hidden_act", "silu")
        self.tie_word_embeddings = bool(cfg_get(config, "tie_word_embeddings", False))
        self.rope_theta, self.rope_scaling = rope_parameters(config)
        self.softmax_scale = float("nan")

    def read_grouped_query_heads(self, config: dict, default_head_dim: int | None = None) -> None:
        """``num_kv_heads`` and ``head_dim`` of grouped-query attention, checked to divide the query heads."""
        self.num_kv_heads = int(cfg_get(config, "num_key_value_heads", self.num_heads))
        self.head_dim = int(cfg_get(config, "head_dim", default_head_dim or self.hidden_size // self.num_heads))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")


class PreNormDecoderLayer(nn.Module):
    """``x + attn(norm(x))``, then ``+ mlp(norm(...))``: the pre-norm residual block.

    ``self_attn(rope, h, attn, rotary)`` maps ``[T, hidden]`` to ``[T, hidden]``
    (it calls the runner's ``attn`` callable); ``mlp(h)`` maps ``[T, hidden]``
    to ``[T, hidden]`` (a gated MLP or a mixture of experts).
    """

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module, dtype=None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, dtype=dtype)
        self.mlp = mlp

    def forward(
        self, rope, x: torch.Tensor, residual: torch.Tensor | None, attn, rotary: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, residual)``: the layer's output stream is ``residual + mlp_out``, left unsummed.

        The stream entering the layer is ``x`` (first layer: ``residual is None``)
        or ``x + residual``; each sum is formed inside the following norm call
        (one fused kernel on GPU), in the same dtype and with the same operands
        as ``x = x + sublayer(norm(x))``, so the values are unchanged.
        """
        # A one-row CUDA step may compute each norm inside the sublayer's first product (norm_input).
        h, stream = norm_input(self.input_layernorm, x, residual, self.self_attn)
        h = self.self_attn(rope, h, attn, rotary)
        h, stream = norm_input(self.post_attention_layernorm, h, stream_of(stream), self.mlp)
        h = self.mlp(h)
        return h, stream_of(stream)


class DecoderModel(nn.Module):
    """Token embedding, the layers, the final norm and the rotary shared by every layer (HF ``model.*``)."""

    def __init__(self, a: DecoderArgs, layers: Iterable[nn.Module], rotary: nn.Module, norm: nn.Module,
                 dtype=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary = rotary  # cos/sin are computed once per step for all layers


def qkv_parts(a: DecoderArgs) -> list[tuple[str, int]]:
    """The HF tensors stacked in ``self_attn.qkv_proj``: q rows, then k, then v (grouped-query args)."""
    q_rows, kv_rows = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    return [("self_attn.q_proj", q_rows), ("self_attn.k_proj", kv_rows), ("self_attn.v_proj", kv_rows)]


def gate_up_parts(prefix: str, intermediate_size: int) -> list[tuple[str, int]]:
    """The HF tensors stacked in a GatedMLP's ``gate_up_proj`` under ``prefix``: gate rows first, then up."""
    return [(f"{prefix}.gate_proj", intermediate_size), (f"{prefix}.up_proj", intermediate_size)]


def attention_and_mlp_parts(a: DecoderArgs) -> dict[str, list[tuple[str, int]]]:
    """``fused_parameters`` of a layer with fused q/k/v and one gated MLP under ``mlp``."""
    return {"self_attn.qkv_proj": qkv_parts(a), "mlp.gate_up_proj": gate_up_parts("mlp", a.intermediate_size)}


def copy_checked(dst: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ConfigError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(tensor)


class DecoderForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied to the embedding or not); see the module docstring."""

    ARGS: type[DecoderArgs] = DecoderArgs

    def __init__(self, config: dict, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = dict(config)
        self.args = a = self.ARGS(config)
        self.arch = a.arch
        self.num_layers = a.num_layers
        self.hidden_size, self.vocab_size = a.hidden_size, a.vocab_size
        self.softmax_scale = a.softmax_scale
        self.tie_word_embeddings = a.tie_word_embeddings
        layers = [self.make_layer(a, i, dtype) for i in range(a.num_layers)]
        self.model = DecoderModel(a, layers, self.make_rotary(a), self.make_final_norm(a, dtype), dtype=dtype)
        self.lm_head = (
            None if a.tie_word_embeddings else nn.Linear(a.hidden_size, a.vocab_size, bias=False, dtype=dtype)
        )

    # -- what a family supplies ----------------------------------------------------
    def make_layer(self, a: DecoderArgs, layer_idx: int, dtype) -> nn.Module:
        raise NotImplementedError

    def make_rotary(self, a: DecoderArgs) -> nn.Module:
        raise NotImplementedError

    def make_final_norm(self, a: DecoderArgs, dtype) -> nn.Module:
        return RMSNorm(a.hidden_size, a.rms_norm_eps, dtype=dtype)

    def fused_parameters(self) -> dict[str, list[tuple[str, int]]]:
        """Our fused parameter (name fragment) -> the HF projections stacked in it, in row order, with their rows."""
        return {}

    def input_major_modules(self) -> list[nn.Module]:
        """The linear layers (and a tied head's embedding) whose weights only ever reach ``F.linear`` or
        ``F.embedding``, so the CPU runner may store them input-major (``layers.store_input_major``); none
        unless the family lists them."""
        return []

    def head_module(self) -> nn.Module:
        """The module holding the LM head's weight: ``lm_head``, or the embedding it is tied to."""
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    # -- runner interface ----------------------------------------------------------
    def sliding_window(self, layer_idx: int) -> int | None:
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        rotary = self.model.rotary
        rope = rotary.cos_sin(positions, h.dtype)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(rope, h, residual, attn, rotary)
        return self.model.norm(h) if residual is None else self.model.norm(h, residual)[0]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head_weight).float()

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after ``to_empty``)."""
        self.model.rotary.reset_parameters()

    # -- weights ---------------------------------------------------------------------
    def _fused_rows(self) -> dict[str, list[tuple[str, int, int]]]:
        """HF projection -> [(our fused parameter, first row, rows)]: more than one where the kinds of layer of
        a hybrid model stack one projection name into different parameters."""
        rows: dict[str, list[tuple[str, int, int]]] = {}
        for ours, parts in self.fused_parameters().items():
            start = 0
            for hf, n in parts:
                rows.setdefault(hf, []).append((ours, start, n))
                start += n
        return rows

    def checkpoint_names(self, name: str, param: torch.Tensor) -> list[str]:
        """The HF tensor names our parameter ``name`` is loaded from."""
        for ours, parts in self.fused_parameters().items():
            if f".{ours}." in name:
                prefix, suffix = name.split(f".{ours}.")
                return [f"{prefix}.{hf}.{suffix}" for hf, _ in parts]
        return [name]

    def hf_param_names(self) -> list[str]:
        """Every HF-style tensor name this model consumes (compare with what :meth:`load_weights` wrote)."""
        return [hf for name, p in self.named_parameters() for hf in self.checkpoint_names(name, p)]

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """Checkpoint tensors that have no parameter here on purpose: rope caches, a tied head's copy."""
        return "rotary_emb." in name or (name == "lm_head.weight" and self.lm_head is None)

    def load_checkpoint_tensor(
        self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor
    ) -> Collection[str] | None:
        """Copy one HF-named tensor into its parameter (or fused rows); the HF names written, None: no place.
        A projection that the kinds of layer of a hybrid model stack differently, or one stacks and another
        keeps apart (``q_proj``), loads into the stacked rows this layer has, else into its own parameter."""
        param, rows = None, None
        for hf, places in self._fused_rows().items():
            if f".{hf}." in name:
                for ours, start, n in places:
                    param = params.get(name.replace(f".{hf}.", f".{ours}."))
                    if param is not None:
                        rows = (start, n)
                        break
                break
        if param is None:
            param = params.get(name)
        if param is None:
            return None
        copy_checked(param if rows is None else param.narrow(0, *rows), name, tensor)
        return (name,)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters (cast to param dtype/device).

        Returns the set of HF-style names written (compare with :meth:`hf_param_names`).
        Raises ConfigError on an unknown name or a shape mismatch; a tensor without elements that has no place
        (transformers' zero-width module, e.g. Kimi-Linear's shared experts at ``num_shared_experts`` 0) is
        skipped.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unknown: list[str] = []
        for name, tensor in weights:
            if self.skips_checkpoint_tensor(name):
                continue
            written = self.load_checkpoint_tensor(params, name, tensor)
            if written is None and tensor.numel():  # an empty tensor (a module of size 0) holds nothing to load
                unknown.append(name)
            elif written is None:
                continue
            else:
                loaded.update(written)
        if unknown:
            shown = ", ".join(unknown[:8]) + (" ..." if len(unknown) > 8 else "")
            raise ConfigError(f"{len(unknown)} checkpoint tensor(s) have no place in {self.arch}: {shown}")
        return loaded


def build_uninitialised(make: Callable[[], nn.Module], device) -> nn.Module:
    """``make()`` on the meta device (no init runs), storage allocated on ``device``, buffers recomputed, eval."""
    with torch.device("meta"):
        model = make()
    model = model.to_empty(device=torch.device(device))
    model.reset_buffers()
    return model.eval()

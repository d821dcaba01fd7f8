"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, gated MLP.

Everything here is device-agnostic PyTorch and works on a flat batch of tokens
(``[T, ...]``), which is what the model runner feeds. On CUDA, RMSNorm (with the
residual add), rope and SiLU*mul dispatch to fused Triton kernels (see
``FUSED_KERNELS`` below); the PyTorch code stays the reference.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.env import ENV
from kvforge.errors import ConfigError
from kvforge.models.linear_route import Linear, silu_mul_linear

# ---------------------------------------------------------------------------
# Fused Triton kernels (kvforge/kernels/triton_{rms_norm,silu_mul,rope}.py)
# ---------------------------------------------------------------------------
# RMSNorm (with or without the residual add), SiLU*mul and rope dispatch to one
# Triton kernel each when the tensor is on a device in FUSED_DEVICES, triton is
# importable, FUSED_KERNELS is true and autograd is off (the kernels are
# inference-only). Everything else, in particular every CPU tensor, takes the
# plain PyTorch code below, which is the oracle the kernels are tested against
# (tests/test_fused_elementwise.py). KVFORGE_DISABLE_FUSED_KERNELS=1 in the
# environment (kvforge/env.py, read at import) turns the kernels off; so does setting
# ``kvforge.models.layers.FUSED_KERNELS = False`` before a forward (and before
# CUDA-graph capture, which records whichever path ran).
FUSED_KERNELS = not ENV.disable_fused_kernels
FUSED_DEVICES = ("cuda",)  # tests add "cpu" to run the kernels in Triton's interpreter
_kernels = None  # (rms_norm module, silu_mul module, rope module), or False without triton


def fused_kernels(x: torch.Tensor):
    """The kernel modules when ``x`` should take the fused path, else None."""
    global _kernels
    if not FUSED_KERNELS or x.device.type not in FUSED_DEVICES or torch.is_grad_enabled():
        return None
    if _kernels is None:
        from kvforge.kernels import triton_rms_norm, triton_rope, triton_silu_mul

        ok = triton_rms_norm.HAS_TRITON and triton_rope.HAS_TRITON and triton_silu_mul.HAS_TRITON
        _kernels = (triton_rms_norm, triton_silu_mul, triton_rope) if ok else False
    return _kernels or None


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 and cast back (as HF Llama).

    ``forward(x, residual)`` first forms the residual stream ``s = x + residual``
    (in the model dtype, as a plain ``+``) and returns ``(norm(s), s)``: the
    decoder layers call it so that the residual add and the next norm are one
    kernel on GPU. ``forward(x)`` returns ``norm(x)``.
    """

    #: The formula above exactly (a subclass that changes it sets this False): a one-row product may compute
    #: it in its prologue (kvforge/models/linear_route.py, ``norm_input``).
    norm_is_plain_rms = True
    #: The kernels' zero-centred form (kvforge/kernels/triton_rms_norm.py) for a subclass whose ``_norm`` is it.
    zero_centred = False

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=None, device=None):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        k = fused_kernels(x)
        if residual is None:
            if k is not None and x.numel() and x.dim() <= 3 and x.stride(-1) == 1:
                return k[0].rms_norm(x, self.weight, self.eps, zero_centred=self.zero_centred)
            return self._norm(x)
        if (
            k is not None
            and x.numel()
            and x.dim() <= 3
            and x.shape == residual.shape
            and x.dtype == residual.dtype
            and x.stride(-1) == 1
            and residual.stride(-1) == 1
        ):
            return k[0].fused_add_rms_norm(x, residual, self.weight, self.eps, zero_centred=self.zero_centred)
        s = x + residual
        return self._norm(s), s

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.device.type != "cpu":
            # Nothing to widen or narrow: torch's own RMSNorm is this formula in one call. (On CPU it is
            # composed of more operations than the formula below, two of them copies.)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        in_dtype = x.dtype
        xf = x if in_dtype == torch.float32 else x.float()
        # mean(x^2) as the sum of squares over n: the values of xf.pow(2).mean(-1), in fewer tensor calls.
        inv_rms = torch.linalg.vecdot(xf, xf).unsqueeze(-1).div_(xf.shape[-1]).add_(self.eps).rsqrt_()
        xf = xf * inv_rms
        return self.weight * (xf if in_dtype == torch.float32 else xf.to(in_dtype))


# ---------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def rope_parameters(config: dict) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling or None)`` from an HF config (transformers 4.x or 5.x style).

    transformers 5 writes ``rope_parameters = {"rope_type", "rope_theta", ...}``;
    older configs and most hub checkpoints use ``rope_theta`` + ``rope_scaling``.
    """
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    theta = config.get("rope_theta")
    if isinstance(params, dict) and params:
        if "rope_theta" in params:
            theta = params["rope_theta"]
        if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    if theta is None:
        theta = 10000.0
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
    return float(theta), scaling


def compute_inv_freq(rotary_dim: int, theta: float, scaling: dict | None, device=None) -> torch.Tensor:
    """float32 inverse frequencies ``[rotary_dim // 2]`` with the configured scaling applied."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        lo = float(scaling.get("low_freq_factor", 1.0))
        hi = float(scaling.get("high_freq_factor", 4.0))
        orig = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        lo_wavelen, hi_wavelen = orig / lo, orig / hi
        # Long wavelengths (low frequencies) are slowed down by `factor`; short ones kept; the band
        # between is interpolated linearly in orig/wavelen.
        scaled = torch.where(wavelen > lo_wavelen, inv_freq / factor, inv_freq)
        t = (orig / wavelen - lo) / (hi - lo)
        blended = (1 - t) * scaled / factor + t * scaled
        mid = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
        return torch.where(mid, blended, scaled)
    if kind == "freq_factors":
        # llama.cpp's representation of llama3 scaling: one divisor per frequency.
        factors = torch.tensor(scaling["factors"], dtype=torch.float32, device=device)
        if factors.numel() != inv_freq.numel():
            raise ConfigError(
                f"rope freq_factors has {factors.numel()} entries, expected {inv_freq.numel()} (rotary_dim / 2)"
            )
        return inv_freq / factors
    raise ConfigError(f"rope scaling type {kind!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")


def check_rope_scaling(scaling: dict | None) -> None:
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope scaling type {kind!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    required = {"linear": ("factor",), "llama3": ("factor", "original_max_position_embeddings")}
    for key in required.get(kind, ()):
        if key not in scaling:
            raise ConfigError(f"rope scaling {kind!r} needs {key!r}; got {sorted(scaling)}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """NeoX-style (rotate-half) RoPE, the HF Llama convention, on ``[T, H, D]`` tensors.

    cos/sin are computed on the fly from ``positions`` (a ``[T]`` tensor), in float32,
    then cast to the activation dtype; there is no length limit and no cache to size.
    Only the first ``rotary_dim`` features of each head rotate.
    """

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        check_rope_scaling(scaling)
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ConfigError(f"rotary dim {rotary_dim} must be even and <= head_dim {head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("inv_freq", torch.empty(rotary_dim // 2, dtype=torch.float32), persistent=False)
        self._last_signed_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re)compute ``inv_freq`` in place (needed after ``Module.to_empty``)."""
        if self.inv_freq.device.type == "meta":
            return
        with torch.no_grad():
            self.inv_freq.copy_(compute_inv_freq(self.rotary_dim, self.theta, self.scaling, device="cpu"))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, rotary_dim]`` cos and sin for ``positions`` (computed once per step, shared by layers)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(
        self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin
        kern = fused_kernels(q)
        if (
            kern is not None
            and q.dim() == 3
            and k.dim() == 3
            and q.shape[0] > 0
            and q.dtype == k.dtype == cos.dtype == sin.dtype
            and q.stride(-1) == 1
            and k.stride(-1) == 1
            and cos.stride(-1) == 1
            and sin.stride(-1) == 1
        ):
            return kern[2].rope_qk(q, k, cos, sin, self.rotary_dim)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def apply_packed(
        self, cos_sin: tuple[torch.Tensor, torch.Tensor], qk: torch.Tensor, num_q_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`apply` to q and k given as one ``[T, Hq + Hkv, D]`` tensor, q's heads first (the
        adjacent q and k columns of a fused projection); returns ``(q, k)``. Without the fused kernel both
        are rotated by one pass of the same elementwise formula (the values ``apply`` gives; q and k come
        back as views of one tensor)."""
        if fused_kernels(qk) is not None:
            return self.apply(cos_sin, qk[:, :num_q_heads], qk[:, num_q_heads:])
        rotated = self._rotate(qk, *cos_sin)
        return rotated[:, :num_q_heads], rotated[:, num_q_heads:]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply(self.cos_sin(positions, q.dtype), q, k)

    def _signed_sin(self, sin: torch.Tensor) -> torch.Tensor:
        """``sin`` with its first half negated, made once per step: every layer rotates with the same
        ``sin`` tensor (``cos_sin`` makes new tables each step and nothing writes into them), so the last
        one made, kept with the tensor it came from, serves the layers after the first."""
        last = self._last_signed_sin
        if last is not None and last[0] is sin:
            return last[1]
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        self._last_signed_sin = (sin, signed)
        return signed

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            # rotate_half(x) * sin, as the halves of x swapped (one flip) times sin with its first half
            # negated: the same products, since negating a factor is exact.
            half = self.rotary_dim // 2
            swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
            return x * cos + swapped * self._signed_sin(sin)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


# ---------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused in one ``gate_up_proj``.

    ``gate_up_proj.weight`` rows ``[:intermediate]`` are HF ``gate_proj``, the rest ``up_proj``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str = "silu",
        bias: bool = False,
        dtype=None,
        device=None,
    ):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype, device=device)
        self.act = get_activation(act)

    @property
    def input_projection(self) -> Linear:
        """The one reader of the forward's ``x`` (kvforge/models/linear_route.py, ``norm_input``)."""
        return self.gate_up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu:
            out = silu_mul_linear(gate_up, self.down_proj)  # one launch for a one-row step on CUDA
            if out is not None:
                return out
        return self.down_proj(act_and_mul(gate_up, self.act))


def act_and_mul(gate_up: torch.Tensor, act) -> torch.Tensor:
    """``act(gate) * up`` of ``gate_up = [gate | up]`` (last axis, halves of equal width): one fused kernel for
    SiLU over a 2-D row-major ``gate_up`` where the fused kernels run, else the two elementwise calls."""
    k = fused_kernels(gate_up)
    if k is not None and act is F.silu and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return k[1].silu_and_mul(gate_up)
    i = gate_up.shape[-1] // 2
    return act(gate_up[..., :i]) * gate_up[..., i:]


def store_input_major(modules) -> None:
    """Give each module's ``weight`` (``[out, in]``) input-major storage in place: the same values and shape,
    seen through a transpose of a contiguous ``[in, out]`` tensor (the Parameter object, and so any tying, is
    kept). ``F.linear`` then multiplies by that contiguous matrix; on CPU, at a few tokens per step, this
    streams the weight faster than the output-major layout (docs/BENCHMARKS.md, the CPU one-stream section).
    Only for modules whose weight reaches ``F.linear`` / ``F.embedding`` and is never viewed as contiguous;
    modules other than ``nn.Linear``, the routed :class:`~kvforge.models.linear_route.Linear` (whose route
    never takes an input-major weight) and ``nn.Embedding`` themselves (tensor-parallel shards, for one) are
    left as they are. Idempotent."""
    for m in modules:
        if type(m) not in (nn.Linear, Linear, nn.Embedding):
            continue
        w = m.weight
        if w.dim() == 2 and w.stride() != (1, w.shape[0]):
            w.data = w.data.t().contiguous().t()


_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_activation(name: str):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ConfigError(
            f"activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}"
        ) from None


def cfg_get(config: dict, key: str, default: Any = None) -> Any:
    """``config[key]`` treating an explicit None as missing."""
    v = config.get(key)
    return default if v is None else v

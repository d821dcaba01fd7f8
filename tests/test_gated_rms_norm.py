"""The gated RMSNorm kernel (kvforge/kernels/triton_gated_rms_norm.py) against a float64 evaluation of the
formula written here and against the PyTorch path of ``GatedRMSNorm`` (kvforge/models/qwen3_next.py), for
Qwen3-Next's form (the normed value rounded, the weight in x's dtype, SiLU gate) and Kimi-Linear's (the
weight in float32, sigmoid gate).

Tolerances (``eps`` = ``torch.finfo(dtype).eps``): the kernel reproduces every rounding of the PyTorch path;
only the float32 ``mean(x^2)`` reduction order and the hardware rsqrt / exp differ (a few float32 ulps).
In the rounded form that can flip the rounding of ``y`` and of ``w * y`` by one step each, and the output
rounds once more: ``2.01 * eps * |ref|`` against float64 (three roundings of at most ``eps / 2``, plus the
float32 slack) and ``2 * eps`` against torch, where at least 90% of the 16-bit elements must also be
bit-identical (a flip needs a value within float32 ulps of a rounding boundary); the float32 form rounds
only the output: ``1.01 * eps``.
float32: ``1e-5`` relative (a reduction over up to 256 terms, approximate exp). bf16 runs on a GPU only
(the interpreter truncates float32 -> bfloat16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_kernel_device import BF16_ROUNDING, DEVICE, INTERPRETED, requires_kernels

from kvforge.kernels.triton_gated_rms_norm import gated_rms_norm
from kvforge.models import layers
from kvforge.models.qwen3_next import GatedRMSNorm

pytestmark = requires_kernels

DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason=BF16_ROUNDING))]
FORMS = {"qwen3-next": ("silu", True), "kimi-linear": ("sigmoid", False)}


def _float64(x, gate, weight, eps, activation, round_normed):
    xf = x.double()
    y = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if round_normed:
        normed = (weight.double() * y.to(x.dtype).double()).to(x.dtype).double()
    else:
        normed = weight.double() * y
    g = gate.double()
    act = torch.sigmoid(g) if activation == "sigmoid" else g * torch.sigmoid(g)
    return normed * act


def _bound(dtype, round_normed, ref):
    if dtype == torch.float32:
        return 1e-5 * ref.abs() + 1e-6
    return (2.01 if round_normed else 1.01) * torch.finfo(dtype).eps * ref.abs() + 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("shape", [(5, 16), (3, 4, 32), (2, 3, 100)])
def test_matches_float64(dtype, form, shape):
    activation, round_normed = FORMS[form]
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    gate = (torch.randn(shape, generator=g) * 2).to(dtype).to(DEVICE)
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(dtype if round_normed else torch.float32).to(DEVICE)
    out = gated_rms_norm(x, gate, weight, 1e-6, activation, round_normed)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    ref = _float64(x.cpu(), gate.cpu(), weight.cpu(), 1e-6, activation, round_normed)
    assert ((out.cpu().double() - ref).abs() <= _bound(dtype, round_normed, ref)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", list(FORMS))
def test_strided_views_and_the_module_route(dtype, form, monkeypatch):
    """Head views of a wider projection (x and gate with row strides of their own): the module with the
    kernels on against the module's PyTorch path."""
    activation, round_normed = FORMS[form]
    t, h, d = 3, 4, 32
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(t, h, 3 * d, generator=g).to(dtype).to(DEVICE)
    x, gate = wide[..., :d], wide[..., 2 * d:] * 2
    norm = GatedRMSNorm(d, 1e-5, torch.sigmoid if activation == "sigmoid" else F.silu, round_normed,
                        dtype=dtype if round_normed else torch.float32).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(d, generator=g))
        monkeypatch.setattr(layers, "FUSED_DEVICES", ())
        want = norm(x, gate)
        monkeypatch.setattr(layers, "FUSED_DEVICES", (DEVICE,))
        calls = []
        import kvforge.kernels.triton_gated_rms_norm as kernel_module

        monkeypatch.setattr(kernel_module, "gated_rms_norm",
                            lambda *a, **k: calls.append(1) or gated_rms_norm(*a, **k))
        got = norm(x, gate)
    assert calls == [1]
    bound = 1e-5 * want.abs() + 1e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * want.abs()
    assert ((got.double() - want.double()).abs() <= bound.double()).all()
    if dtype != torch.float32:
        # the same roundings in the same order: a flipped rounding needs a value within a few float32 ulps
        # of a 16-bit rounding boundary, so nearly every element is bit-identical
        assert (got == want).double().mean().item() >= 0.9


def test_refuses_bad_inputs():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="activation"):
        gated_rms_norm(x, x, torch.ones(8, device=DEVICE), 1e-6, "relu", False)
    with pytest.raises(ValueError, match="one shape"):
        gated_rms_norm(x, torch.zeros(2, 4, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6, "silu", False)
    with pytest.raises(ValueError, match="weight shape"):
        gated_rms_norm(x, x, torch.ones(4, device=DEVICE), 1e-6, "silu", False)

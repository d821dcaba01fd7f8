"""The delta-rule gates (kvforge/models/delta_gates.py): the Triton kernel (compiled on a GPU, else in
Triton's interpreter) and the PyTorch path against float64 formulas written here, for Kimi-Linear's shapes
(one decay a head's feature, ``A_log [1, 1, H, 1]``, float32 ``dt_bias``) and Qwen3-Next's (one a value
head, ``a`` and ``b`` strided head-grouped halves of one projection).

Tolerances: ``g`` is float32 through a sum, ``exp``, ``log`` and a product, each within a few ulps:
``1e-5 * |ref|`` (softplus arguments from -30 to 30: the identity above 20, values down to 1e-13 below);
``beta`` rounds once to its dtype: ``eps * |ref|`` (fp32: ``1e-6``), plus one subnormal step where it
is that small (fp16 below 6e-5). bf16 runs on a GPU only (the
interpreter truncates float32 -> bfloat16)."""

from __future__ import annotations

import pytest
import torch
from triton_kernel_device import BF16_ROUNDING, DEVICE, INTERPRETED, KERNELS_RUN

from kvforge.models import delta_gates as gates
from kvforge.models import layers

DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason=BF16_ROUNDING))]


@pytest.fixture(params=["torch", "triton"])
def device(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(layers, "FUSED_KERNELS", False)
        dev = "cpu"
    elif not KERNELS_RUN:
        pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
    else:
        monkeypatch.setattr(layers, "FUSED_KERNELS", True)
        monkeypatch.setattr(layers, "FUSED_DEVICES", (DEVICE,))
        dev = DEVICE
    with torch.no_grad():
        yield dev


def _float64(f, dt_bias, a_log, b, head_dim):
    t = f.shape[0]
    x = f.reshape(t, -1).double() + dt_bias.reshape(-1).double()
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    decay = a_log.reshape(-1).double().exp().repeat_interleave(head_dim)
    return -decay * softplus, torch.sigmoid(b.reshape(t, -1).double())


def _check(g, beta, f, dt_bias, a_log, b, head_dim):
    want_g, want_beta = _float64(f.cpu(), dt_bias.cpu(), a_log.cpu(), b.cpu(), head_dim)
    assert g.dtype == torch.float32 and g.shape == want_g.shape
    assert beta.dtype == b.dtype and beta.shape == want_beta.shape
    assert ((g.cpu().double() - want_g).abs() <= 1e-5 * want_g.abs()).all()
    eps = 1e-6 if b.dtype == torch.float32 else torch.finfo(b.dtype).eps
    subnormal_step = torch.finfo(b.dtype).smallest_normal * torch.finfo(b.dtype).eps  # fp16: 2^-24
    assert ((beta.cpu().double() - want_beta).abs() <= eps * want_beta.abs() + subnormal_step).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_kimi_linear_shapes(device, dtype, tokens):
    h, d = 4, 16
    g0 = torch.Generator().manual_seed(tokens)
    f = (torch.linspace(-30, 30, tokens * h * d).view(tokens, h * d)
         + 0.01 * torch.randn(tokens, h * d, generator=g0)).to(dtype)
    dt_bias = torch.randn(h * d, generator=g0)  # float32, as the checkpoint keeps it
    a_log = torch.randn(1, 1, h, 1, generator=g0).to(dtype)
    b = (torch.randn(tokens, h, generator=g0) * 3).to(dtype)
    g, beta = gates.delta_gates(f.to(device), dt_bias.to(device), a_log.to(device), b.to(device), d)
    _check(g, beta, f, dt_bias, a_log, b, d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen3_next_strided_halves(device, dtype):
    t, hk, per = 3, 2, 4
    g0 = torch.Generator().manual_seed(11)
    ba = (torch.randn(t, hk, 2 * per, generator=g0) * 8).to(dtype)
    b, a = ba.split([per, per], dim=-1)  # views with a row stride of 2 * per
    dt_bias = torch.randn(hk * per, generator=g0).to(dtype)
    a_log = torch.randn(hk * per, generator=g0).to(dtype)
    g, beta = gates.delta_gates(a.to(device), dt_bias.to(device), a_log.to(device), b.to(device), 1) \
        if device == "cpu" else _on_device(ba, per, dt_bias, a_log, device)
    _check(g, beta, a, dt_bias, a_log, b, 1)


def _on_device(ba, per, dt_bias, a_log, device):
    b, a = ba.to(device).split([per, per], dim=-1)  # the views on the device, strides kept
    return gates.delta_gates(a, dt_bias.to(device), a_log.to(device), b, 1)


@pytest.mark.skipif(not KERNELS_RUN, reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
def test_kernel_refuses_bad_inputs():
    from kvforge.kernels.triton_delta_gates import delta_gates

    f, b = torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 2, device=DEVICE)
    with pytest.raises(ValueError, match="dt_bias of 8 values and A_log of 2"):
        delta_gates(f, torch.zeros(8, device=DEVICE), torch.zeros(3, device=DEVICE), b, 4)
    with pytest.raises(ValueError, match="one token count"):
        delta_gates(f, torch.zeros(8, device=DEVICE), torch.zeros(2, device=DEVICE), torch.zeros(3, 2), 4)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        delta_gates(torch.zeros(8, 2, device=DEVICE).t(), torch.zeros(8), torch.zeros(2), b, 4)

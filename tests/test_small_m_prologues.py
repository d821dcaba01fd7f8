"""The small-M kernel's prologues (kvforge/kernels/triton_small_m_linear.py): ``rms_norm_linear`` and
``silu_mul_linear`` against PyTorch's elementwise formulas followed by a float64 product.

References (never the code under test): the normed row is HF Llama's RMSNorm written out in torch
(``s = x + residual`` in the model dtype; ``weight * (s32 * rsqrt(mean(s32^2) + eps)).to(dtype)``), the
activated row ``F.silu(gate) * up`` in the model dtype; then ``ref = h @ w.T + b`` in float64.

Tolerance, per output element: the product's bound of tests/test_small_m_linear.py (float32 summation of
K exact products, one rounding to the dtype), plus two units in the last place of every element of the
kernel's input row, which move the output by at most ``2 * eps * (|h| @ |w|.T)``: the norm prologue
never rounds the normed row to the dtype where torch rounds it twice (``y`` and ``weight * y``: at most one
ulp together), SiLU-and-mul rounds where torch does but with the kernel's exp (a hardware approximation
on a GPU), and the interpreter truncates float32 -> bfloat16 where the GPU and torch round (one more ulp
on ``s`` or on the activation). A missing residual, norm weight or rsqrt, or a
swapped gate and up, moves the outputs by far more (checked: each such mistake fails these bounds).

The stream ``x + residual`` is a plain add rounded once: equal to torch's add on a GPU (both round to
nearest even); within one ulp in the interpreter (which truncates).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_kernel_device import DEVICE, INTERPRETED, requires_kernels, skip_unless_loaded_loop_bounds_work

from kvforge.kernels.triton_small_m_linear import (
    SmallMLinearConfig,
    rms_norm_linear,
    silu_mul_linear,
    small_m_linear_config,
)

pytestmark = requires_kernels
EPS = 1e-5


@pytest.fixture(autouse=True)
def _loop_bounds():
    skip_unless_loaded_loop_bounds_work()  # the K loops run over kernel arguments


def _randn(gen, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def _check(y, h, w, b):
    """``y`` against ``h @ w.T + b`` in float64, within the bound of the module docstring."""
    assert y.shape == (h.shape[0], w.shape[0]) and y.dtype == h.dtype
    hd, wd = h.double(), w.double()
    ref = hd @ wd.T
    scale = hd.abs() @ wd.abs().T
    if b is not None:
        ref, scale = ref + b.double(), scale + b.double().abs()
    g = 4 * (h.shape[1] + 1) * 2.0**-24
    eps = torch.finfo(h.dtype).eps
    bound = eps * (ref.abs() + g * scale) + g * scale + 2 * eps * scale
    err = (y.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3g}, {worst:.2f} x the bound"


def _torch_rms_norm(s, weight):
    sf = s.float()
    y = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + EPS)).to(s.dtype)
    return weight * y


def _config(split_k):
    return SmallMLinearConfig(block_n=16, block_k=32, split_k=split_k, num_warps=4, num_stages=2, use_dot=False)


# K a multiple of the chunk (even) and not (masked), with one and three K slices (the norm prologue runs a
# config asking for three in one), with and without bias.
CASES = [(40, 256, None), (40, 200, None), (24, 256, _config(1)), (24, 200, _config(3))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("residual", [True, False], ids=["add", "first-layer"])
@pytest.mark.parametrize("n,k,config", CASES, ids=["default-even", "default-masked", "split1", "split3"])
def test_rms_norm_linear(n, k, config, residual, dtype):
    gen = torch.Generator(DEVICE).manual_seed(n * k + residual)
    x = _randn(gen, 1, k, dtype=dtype, scale=3.0)
    r = _randn(gen, 1, k, dtype=dtype) if residual else None
    norm_w = (1 + _randn(gen, k, dtype=torch.float32, scale=0.3)).to(dtype)
    w = _randn(gen, n, k, dtype=dtype)
    b = _randn(gen, n, dtype=dtype) if k == 200 else None
    y, stream = rms_norm_linear(x, r, norm_w, EPS, w, b, config=config)
    s = x + r if residual else x
    if residual:
        assert stream.data_ptr() not in (x.data_ptr(), r.data_ptr())  # a new tensor: inputs untouched
        if INTERPRETED:
            torch.testing.assert_close(stream, s, rtol=torch.finfo(dtype).eps, atol=0)
        else:
            assert torch.equal(stream, s)  # one round-to-nearest add, as torch's
    else:
        assert stream is x
    _check(y, _torch_rms_norm(s, norm_w), w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,config", CASES, ids=["default-even", "default-masked", "split1", "split3"])
def test_silu_mul_linear(n, k, config, dtype):
    gen = torch.Generator(DEVICE).manual_seed(n + k)
    gate_up = _randn(gen, 1, 2 * k, dtype=dtype, scale=2.0)
    w = _randn(gen, n, k, dtype=dtype)
    b = _randn(gen, n, dtype=dtype) if k == 200 else None
    y = silu_mul_linear(gate_up, w, b, config=config)
    h = F.silu(gate_up[:, :k]) * gate_up[:, k:]
    _check(y, h, w, b)


def test_prologues_refuse_what_they_cannot_do():
    gen = torch.Generator(DEVICE).manual_seed(0)
    x = _randn(gen, 2, 64, dtype=torch.bfloat16)
    w = _randn(gen, 16, 64, dtype=torch.bfloat16)
    nw = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="one contiguous row"):
        rms_norm_linear(x, None, nw, EPS, w)  # two rows
    with pytest.raises(ValueError, match="must match x"):
        rms_norm_linear(x[:1], x[1:].float(), nw, EPS, w)
    with pytest.raises(ValueError, match="norm weight"):
        rms_norm_linear(x[:1], None, nw[:32], EPS, w)
    with pytest.raises(ValueError, match="one contiguous row"):
        silu_mul_linear(x[:, :63], w[:, :31])  # odd width
    with pytest.raises(ValueError, match="features"):
        silu_mul_linear(x[:1], w)  # [gate | up] of 32 each against a weight taking 64
    dot = SmallMLinearConfig(block_n=16, block_k=32, split_k=1, num_warps=4, num_stages=2, use_dot=True)
    with pytest.raises(ValueError, match="broadcast path"):
        rms_norm_linear(x[:1], None, nw, EPS, w, config=dot)
    assert not small_m_linear_config(1, 16, 64).use_dot  # the default for one row never asks for tl.dot

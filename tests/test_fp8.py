"""FP8 storage helpers: names, saturation, rounding bounds, scales.

Rounding bounds checked here (see kvforge/attention/fp8.py): for
|x / scale| in the normal range the round trip has relative error
<= 2^-4 (e4m3fn, 3 mantissa bits) or 2^-3 (e5m2, 2 bits); below the smallest
normal the absolute error is <= 2^-10 * scale (e4m3fn) or 2^-17 * scale (e5m2).
The nearest-value check is independent of the implementation: it decodes all
256 bit patterns and searches the table in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.attention import fp8
from kvforge.attention.fp8 import (
    DEFAULT_SCALE,
    as_head_scales,
    compute_scales,
    dequantize,
    fp8_format,
    fp8_max,
    quantize,
    resolve_kv_dtype,
)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8S = [E4M3, E5M2]
# Independent statement of the formats: (mantissa bits, max, min normal, subnormal step).
FACTS = {E4M3: (3, 448.0, 2.0**-6, 2.0**-9), E5M2: (2, 57344.0, 2.0**-14, 2.0**-16)}


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
    """|actual - expected| <= atol + rtol * |expected| elementwise, in float64, NaN never close.

    (torch.testing.assert_close costs seconds of lazy imports on first use.)
    """
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.double(), expected.double()
    err = (a - e).abs()
    ok = err <= atol + rtol * e.abs()
    if not bool(ok.all()):
        bad = int((~ok).sum())
        worst = torch.nan_to_num(err, nan=float("inf")).max().item()
        raise AssertionError(f"{bad}/{ok.numel()} elements differ; max abs error {worst:.3g} "
                             f"(atol {atol}, rtol {rtol})")


def _table(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, float64, sorted and unique."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float64)
    return torch.unique(vals[torch.isfinite(vals)])


@pytest.mark.parametrize(
    "name,expected",
    [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("half", torch.float16),
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("fp8", E4M3),
        ("FP8", E4M3),
        ("fp8_e4m3", E4M3),
        ("fp8_e5m2", E5M2),
    ],
)
def test_resolve_names(name, expected):
    assert resolve_kv_dtype(name, torch.bfloat16) is expected


def test_resolve_auto_and_errors():
    assert resolve_kv_dtype("auto", torch.float16) is torch.float16
    assert resolve_kv_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_dtype(E5M2) is E5M2
    with pytest.raises(ValueError):
        resolve_kv_dtype("auto")
    with pytest.raises(ValueError, match="fp8_e5m2"):
        resolve_kv_dtype("int4")
    with pytest.raises(ValueError):
        resolve_kv_dtype(torch.int8)


@pytest.mark.parametrize("dtype", FP8S)
def test_format_facts(dtype):
    bits, fmax, min_normal, step = FACTS[dtype]
    f = fp8_format(dtype)
    assert (f.mantissa_bits, f.max, f.min_normal, f.subnormal_step) == (bits, fmax, min_normal, step)
    assert fp8_max(dtype) == fmax == torch.finfo(dtype).max
    table = _table(dtype)
    assert table.max().item() == fmax
    assert table[table > 0].min().item() == step
    assert f.rel_error_bound == 2.0 ** -(bits + 1)
    assert fp8.is_fp8(dtype) and not fp8.is_fp8(torch.bfloat16)
    with pytest.raises(ValueError):
        fp8_max(torch.bfloat16)


@pytest.mark.parametrize("dtype", FP8S)
@pytest.mark.parametrize("scale", [1.0, 0.03125, 3.7])
def test_saturation(dtype, scale):
    fmax = FACTS[dtype][1]
    x = torch.tensor([1e6, -1e6, 1e30, -1e30, float("inf"), float("-inf"), fmax * scale * 1.01])
    q = quantize(x, scale, dtype)
    assert q.dtype is dtype
    qf = q.to(torch.float64)
    assert torch.isfinite(qf).all()
    assert qf.tolist() == [fmax, -fmax, fmax, -fmax, fmax, -fmax, fmax]
    d = dequantize(q, scale)
    assert torch.isfinite(d).all()
    assert d[0].item() == pytest.approx(fmax * scale, rel=1e-6)


@pytest.mark.parametrize("dtype", FP8S)
def test_nan_becomes_zero(dtype):
    x = torch.tensor([float("nan"), 1.0, float("nan")], dtype=torch.bfloat16)
    q = quantize(x, 1.0, dtype)
    assert q.to(torch.float32).tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("dtype", FP8S)
@pytest.mark.parametrize("scale", [1.0, 0.0123, 17.0])
def test_rounds_to_nearest_representable(dtype, scale):
    """quantize picks a nearest fp8 value (independent brute-force search over the table)."""
    torch.manual_seed(1)
    fmax = FACTS[dtype][1]
    table = _table(dtype)
    # log-uniform magnitudes from deep subnormal to past the max, both signs
    mag = torch.exp(torch.empty(4000, dtype=torch.float64).uniform_(math.log(1e-6), math.log(fmax * 2)))
    y = mag * torch.where(torch.rand(4000) < 0.5, -1.0, 1.0).double()
    x = (y * scale).to(torch.float32)
    q = quantize(x, scale, dtype).to(torch.float64)
    target = (x.to(torch.float64) / scale).clamp(-fmax, fmax)
    best = (target[:, None] - table[None, :]).abs().min(dim=1).values
    got = (target - q).abs()
    # float32 division may move the value by ~2^-24 relative before rounding
    assert torch.all(got <= best + target.abs() * 2.0**-22 + 1e-300)


@pytest.mark.parametrize("dtype", FP8S)
@pytest.mark.parametrize("scale", [1.0, 0.002, 250.0])
def test_round_trip_error_bounds(dtype, scale):
    bits, fmax, min_normal, step = FACTS[dtype]
    rel_bound, abs_bound = 2.0 ** -(bits + 1), step / 2
    torch.manual_seed(2)
    mag = torch.exp(torch.empty(20000, dtype=torch.float64).uniform_(math.log(min_normal), math.log(fmax)))
    x = (mag * scale * torch.where(torch.rand(20000) < 0.5, -1.0, 1.0).double()).to(torch.float32)
    d = dequantize(quantize(x, scale, dtype), scale).double()
    xd = x.double()
    rel = ((d - xd).abs() / xd.abs()).max().item()
    assert rel <= rel_bound * (1 + 2.0**-20)
    assert rel > rel_bound * 0.8  # the bound is tight, not vacuous
    # subnormal range: absolute bound
    xs = (torch.empty(5000, dtype=torch.float64).uniform_(-min_normal, min_normal) * scale).to(torch.float32)
    ds = dequantize(quantize(xs, scale, dtype), scale).double()
    err = (ds - xs.double()).abs().max().item()
    assert err <= abs_bound * scale * (1 + 2.0**-20)
    assert fp8_format(dtype).abs_error_bound == abs_bound


@settings(max_examples=100, deadline=None)
@given(
    x=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32),
    scale=st.floats(min_value=2.0**-10, max_value=2.0**10, width=32),
    e5=st.booleans(),
)
def test_round_trip_property(x, scale, e5):
    dtype = E5M2 if e5 else E4M3
    bits, fmax, _, step = FACTS[dtype]
    xt = torch.tensor([x], dtype=torch.float32)
    d = dequantize(quantize(xt, scale, dtype), scale).double().item()
    assert math.isfinite(d)
    clipped = max(-fmax * scale, min(fmax * scale, x))
    bound = max(2.0 ** -(bits + 1) * abs(clipped), step / 2 * scale) * (1 + 2.0**-20) + 1e-12 * abs(clipped)
    assert abs(d - clipped) <= bound


@pytest.mark.parametrize("dtype", FP8S)
def test_per_head_scales_match_scalar(dtype):
    torch.manual_seed(3)
    x = torch.randn(7, 3, 16) * torch.tensor([1.0, 50.0, 0.01])[None, :, None]
    s = torch.tensor([0.01, 0.5, 0.0001])
    q = quantize(x, s, dtype)
    for h in range(3):
        assert torch.equal(q[:, h].view(torch.uint8), quantize(x[:, h], float(s[h]), dtype).view(torch.uint8))
    d = dequantize(q, s, torch.bfloat16)
    assert d.dtype is torch.bfloat16
    for h in range(3):
        _close(d[:, h], (q[:, h].float() * s[h]).bfloat16(), atol=0, rtol=0)
    # head_axis selects where the per-head scale applies ([Hkv, T, D] layout)
    qt = quantize(x.transpose(0, 1), s, dtype, head_axis=0)
    assert torch.equal(qt.view(torch.uint8), q.transpose(0, 1).view(torch.uint8))
    with pytest.raises(ValueError):
        quantize(x, torch.ones(4), dtype)


def test_non_fp8_is_plain_cast():
    x = torch.randn(4, 2, 8)
    q = quantize(x, 123.0, torch.bfloat16)
    assert torch.equal(q, x.bfloat16())
    assert torch.equal(dequantize(q, 123.0), x.bfloat16().float())


@pytest.mark.parametrize("dtype", FP8S)
def test_compute_scales(dtype):
    fmax = FACTS[dtype][1]
    torch.manual_seed(4)
    x = torch.randn(64, 3, 32) * torch.tensor([2.0, 30.0, 0.1])[None, :, None]
    x[5, 1, 3] = float("nan")
    x[6, 2, 1] = float("inf")
    finite = torch.where(torch.isfinite(x), x, torch.zeros(()))
    st_ = compute_scales(x, "per_tensor", dtype)
    assert st_.shape == () and st_.dtype == torch.float32
    assert st_.item() == pytest.approx(finite.abs().max().item() / fmax, rel=1e-6)
    ph = compute_scales(x, "per_head", dtype)
    assert ph.shape == (3,)
    for h in range(3):
        assert ph[h].item() == pytest.approx(finite[:, h].abs().max().item() / fmax, rel=1e-6)
    # calibrated: the sample's amax lands on the format max and nothing saturates beyond it
    q = quantize(finite, ph, dtype).float()
    assert q.abs().amax(dim=(0, 2)).tolist() == [fmax] * 3
    deq = dequantize(quantize(finite, ph, dtype), ph)
    _close(deq.abs().amax(dim=(0, 2)), finite.abs().amax(dim=(0, 2)), rtol=1e-6, atol=0)
    # all-zero heads fall back to the documented default
    z = torch.zeros(4, 2, 8)
    z[:, 1] = 1.0
    zs = compute_scales(z, "per_head", dtype)
    assert zs[0].item() == DEFAULT_SCALE == 1.0
    assert zs[1].item() == pytest.approx(1.0 / fmax)
    assert compute_scales(torch.zeros(3, 2, 4), "per_tensor", dtype).item() == 1.0
    with pytest.raises(ValueError):
        compute_scales(x, "per_token", dtype)


def test_as_head_scales():
    assert as_head_scales(None, 3).tolist() == [1.0, 1.0, 1.0]
    assert as_head_scales(0.5, 2).tolist() == [0.5, 0.5]
    assert as_head_scales(torch.tensor(0.25), 2).tolist() == [0.25, 0.25]
    assert as_head_scales(torch.tensor([0.25]), 3).tolist() == [0.25] * 3
    t = as_head_scales(torch.tensor([1.0, 2.0], dtype=torch.float64), 2)
    assert t.dtype == torch.float32 and t.tolist() == [1.0, 2.0]
    with pytest.raises(ValueError):
        as_head_scales(torch.ones(3), 2)
    with pytest.raises(ValueError):
        as_head_scales(0.0, 2)
    with pytest.raises(ValueError):
        as_head_scales(float("inf"), 2)

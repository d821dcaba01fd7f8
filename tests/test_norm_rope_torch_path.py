"""The PyTorch paths of RMSNorm and rope (what CPU runs) against float64 evaluations of their formulas.

RMSNorm: ``w * x / sqrt(mean(x^2) + eps)``. A float32 input on CPU takes the formula as written; 16-bit inputs
widen to float32, normalise, round to the dtype and then multiply the weight (as transformers' Llama). Bounds:
float32 ``1e-5 * |ref|`` (a reduction over up to 1536 terms and two roundings); 16-bit ``1.01 * eps * |ref|``
(two roundings: the normalised value, then the weight product) plus the same float32 slack.

Rope on q and k packed in one ``[T, Hq + Hkv, D]`` tensor (``apply_packed``, used by the Llama family's
fused q/k/v projection) runs the elementwise formula of ``apply`` on each element, so its values must be
bit-identical to ``apply`` on the two parts; both are checked against float64 with the same tables:
``x * cos + rotate_half(x) * sin`` is ``rnd(rnd(a) +- rnd(b))``, within ``eps * (|a| + |b|)``.
"""

from __future__ import annotations

import pytest
import torch

from kvforge.models.layers import RMSNorm, RotaryEmbedding


def _norm_ref64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("t,n", [(1, 576), (7, 64), (33, 1536)])
def test_rms_norm_matches_float64(dtype, t, n):
    g = torch.Generator().manual_seed(t * n)
    norm = RMSNorm(n, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g) * 2)
    x = (torch.randn(t, n, generator=g) * 3).to(dtype)
    residual = torch.randn(t, n, generator=g).to(dtype)

    def check(out, stream):
        ref = _norm_ref64(stream, norm.weight, norm.eps)
        slack = 1e-5 * ref.abs() + torch.finfo(dtype).tiny
        bound = slack if dtype == torch.float32 else 1.01 * torch.finfo(dtype).eps * ref.abs() + slack
        assert out.dtype == dtype and out.shape == stream.shape
        assert bool(((out.double() - ref).abs() <= bound).all())

    with torch.no_grad():
        check(norm(x), x)
        normed, s = norm(x, residual)
    assert torch.equal(s, x + residual)
    check(normed, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_packed_rope_equals_apply_and_float64(dtype, rotary_dim):
    g = torch.Generator().manual_seed(rotary_dim)
    t, hq, hkv, d = 5, 9, 3, 64
    rotary = RotaryEmbedding(d, rotary_dim, 10000.0, None)
    positions = torch.tensor([0, 1, 17, 300, 4095])
    cos, sin = rotary.cos_sin(positions, dtype)
    # The packed q/k columns of a fused projection: a view with v's columns after them.
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    qk = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
    q, k = rotary.apply_packed((cos, sin), qk, hq)
    q_ref, k_ref = rotary.apply((cos, sin), qk[:, :hq], qk[:, hq:])
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert q.shape == (t, hq, d) and k.shape == (t, hkv, d)
    assert torch.equal(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), qk)  # the input is left as it was
    x = qk.double()
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    swapped = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    a, b = rot * cos.double(), swapped * sin.double()
    ref = torch.cat((a + b, rest), dim=-1)
    bound = torch.cat((torch.finfo(dtype).eps * (a.abs() + b.abs()), torch.zeros_like(rest)), dim=-1)
    got = torch.cat((q, k), dim=1).double()
    assert bool(((got - ref).abs() <= bound).all())

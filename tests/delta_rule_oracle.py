"""Float64 oracles for the gated delta rule and the short conv, written from their definitions.

They share no code with kvforge: the rule is applied token by token and head by head (state
decayed, delta written, output read), with the L2 normalisation, the scale and the key-head
sharing done here; the conv is a sum over kernel taps of ``cat(history, x)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_float64(q, k, v, g, beta, state=None, normalize=True, scale=None):
    """The rule's definition in float64, token by token and head by head."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    t_len, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    scale = dk**-0.5 if scale is None else scale
    s = [torch.zeros(dk, dv, dtype=torch.float64) if state is None else state[h].double().clone()
         for h in range(hv)]
    out = torch.zeros(t_len, hv, dv, dtype=torch.float64)
    for t in range(t_len):
        for h in range(hv):
            qh, kh = q[t, h // (hv // hk)], k[t, h // (hv // hk)]
            if normalize:
                qh = qh / torch.sqrt((qh * qh).sum() + 1e-6)
                kh = kh / torch.sqrt((kh * kh).sum() + 1e-6)
            decay = torch.exp(g[t, h])  # scalar or [K]
            s[h] = (decay * torch.ones(dk, dtype=torch.float64))[:, None] * s[h]
            pred = s[h].T @ kh
            s[h] = s[h] + torch.outer(kh, beta[t, h] * (v[t, h] - pred))
            out[t, h] = s[h].T @ (qh * scale)
    return out, torch.stack(s)


def random_inputs(t_len, hk=2, hv=4, dk=16, dv=8, per_channel=False, seed=0, repeated_keys=False):
    """Random rule inputs. ``repeated_keys``: nearly identical keys, beta ~ 1 and almost no decay, the
    case where a chunk's triangular system is hardest (its inverse's series has binomial-sized terms)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t_len, hk, dk, generator=gen)
    # Keys share a direction (as trained keys do): the chunk's triangular system then couples
    # distant tokens strongly, so an inexact solve shows.
    k = torch.randn(t_len, hk, dk, generator=gen) + 2.0 * torch.randn(1, hk, dk, generator=gen)
    v = torch.randn(t_len, hv, dv, generator=gen)
    gate_shape = (t_len, hv, dk) if per_channel else (t_len, hv)
    a = torch.empty(gate_shape[1:]).uniform_(0.01, 3.0, generator=gen)
    g = -a * F.softplus(torch.randn(gate_shape, generator=gen) - 2.0)
    beta = torch.rand(t_len, hv, generator=gen)
    if repeated_keys:
        k = torch.randn(1, hk, dk, generator=gen) + 0.01 * torch.randn(t_len, hk, dk, generator=gen)
        beta = 0.99 + 0.01 * beta
        g = 1e-3 * g
    return q, k, v, g, beta


def rel_err(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


def conv_float64(x, weight, bias, history, silu=True):
    """Causal depthwise convolution of ``cat(history, x)`` written as sums over the kernel taps."""
    xx = torch.cat([history.double(), x.double()])
    width = weight.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for i in range(width):
            out[t] += weight[:, i].double() * xx[t + i]
    if bias is not None:
        out = out + bias.double()
    return out * torch.sigmoid(out) if silu else out

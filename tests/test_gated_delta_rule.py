"""The PyTorch gated delta rule (recurrent and chunked forms) and the short causal conv1d.

Oracle: the float64 loops of tests/delta_rule_oracle.py, written from the definitions and
independent of kvforge's code. Inputs are float32 random normals with gates drawn like the models'
(``g = -exp(A) * softplus(x)``, so decays span from ~1 to ~exp(-30) per token).

Tolerances: the kvforge forms compute in float32. The recurrent form does the same operations as
the oracle in another precision: per token, a handful of K- and V-long dot products whose float32
rounding (~K * 2^-24 relative) is carried by a state whose norm stays O(1) (the rule keeps
``|S^T k|`` near ``|v|`` for unit keys), so over 70 tokens the error stays below 1e-5 of the
output magnitude: bound 2e-5 relative to max |out|. The chunked form also solves a unit
triangular system of size ``chunk_size`` (condition number up to ~chunk_size for unit keys and
beta < 1) and sums state contributions in another order: bound 1e-4 relative. Exact equality is
asserted nowhere: splitting a sequence changes the summation order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from delta_rule_oracle import conv_float64, naive_float64, random_inputs, rel_err

from kvforge.attention import causal_conv1d as conv
from kvforge.attention import gated_delta_rule as gdr

REC_TOL = 2e-5
CHUNK_TOL = 1e-4


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
def test_recurrent_matches_float64_definition(per_channel):
    q, k, v, g, beta = random_inputs(70, per_channel=per_channel)
    s0 = 0.3 * torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(5))
    out, s = gdr.recurrent(q, k, v, g, beta, s0, normalize_qk=True)
    ref_out, ref_s = naive_float64(q, k, v, g, beta, s0)
    assert out.dtype == torch.float32 and s.shape == (4, 16, 8)
    assert rel_err(out, ref_out) < REC_TOL
    assert rel_err(s, ref_s) < REC_TOL


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_matches_float64_definition_on_lengths_the_chunk_does_not_divide(per_channel, chunk):
    for t_len in (1, 37, 70):
        q, k, v, g, beta = random_inputs(t_len, per_channel=per_channel, seed=t_len)
        s0 = 0.3 * torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(t_len))
        out, s = gdr.chunked(q, k, v, g, beta, s0, chunk_size=chunk, normalize_qk=True)
        ref_out, ref_s = naive_float64(q, k, v, g, beta, s0)
        assert rel_err(out, ref_out) < CHUNK_TOL, (t_len, chunk)
        assert rel_err(s, ref_s) < CHUNK_TOL, (t_len, chunk)
        rec_out, rec_s = gdr.recurrent(q, k, v, g, beta, s0, normalize_qk=True)
        assert rel_err(out, rec_out.double()) < CHUNK_TOL


def test_explicit_scale_and_no_normalisation():
    q, k, v, g, beta = random_inputs(20, hk=4, seed=3)
    k = 0.1 * k  # unnormalised keys of norm ~1 keep the rule stable
    out, s = gdr.chunked(q, k, v, g, beta, chunk_size=8, scale=0.3)
    ref_out, ref_s = naive_float64(q, k, v, g, beta, normalize=False, scale=0.3)
    assert rel_err(out, ref_out) < CHUNK_TOL and rel_err(s, ref_s) < CHUNK_TOL


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar_gate", "per_channel_gate"])
def test_a_sequence_split_across_calls_equals_one_call(per_channel):
    q, k, v, g, beta = random_inputs(61, per_channel=per_channel, seed=11)
    one_out, one_s = gdr.chunked(q, k, v, g, beta, chunk_size=16, normalize_qk=True)
    outs, s = [], None
    cuts = [0, 5, 6, 29, 48, 60, 61]  # prefill pieces of every size, then single decode tokens
    for a, b in zip(cuts, cuts[1:]):
        form = gdr.recurrent if b - a == 1 else gdr.chunked
        kw = {} if b - a == 1 else {"chunk_size": 16}
        o, s = form(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s, normalize_qk=True, **kw)
        outs.append(o)
    assert rel_err(torch.cat(outs), one_out.double()) < CHUNK_TOL
    assert rel_err(s, one_s.double()) < CHUNK_TOL


def test_float64_inputs_compute_in_float64():
    q, k, v, g, beta = (x.double() for x in random_inputs(30, per_channel=True, seed=2))
    out, s = gdr.chunked(q, k, v, g, beta, chunk_size=8, normalize_qk=True)
    ref_out, ref_s = naive_float64(q, k, v, g, beta)
    assert out.dtype == torch.float64 and s.dtype == torch.float64
    assert rel_err(out, ref_out) < 1e-12 and rel_err(s, ref_s) < 1e-12


def test_bad_shapes_are_named():
    q, k, v, g, beta = random_inputs(4)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gdr.recurrent(q, k, v[:, :3], g[:, :3], beta[:, :3])
    with pytest.raises(ValueError, match=r"g must be \[T, Hv\]"):
        gdr.chunked(q, k, v, g[:, :2], beta)
    with pytest.raises(ValueError, match="state must be"):
        gdr.recurrent(q, k, v, g, beta, torch.zeros(4, 8, 8))


# ----------------------------------------------------------------------------- causal conv1d
def test_conv1d_matches_float64_and_transformers_convention():
    gen = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(9, 6, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    out, state = conv.causal_conv1d(x, weight, bias, None)
    assert rel_err(out, conv_float64(x, weight, bias, torch.zeros(3, 6))) < 1e-6
    assert torch.equal(state, x[-3:])  # the state is a copy of the last W - 1 inputs: exact
    # transformers' prefill: F.conv1d with W - 1 zeros of left padding, depthwise, then SiLU.
    hf = F.silu(F.conv1d(x.T[None], weight[:, None, :], bias, padding=3, groups=6)[0, :, :9].T)
    assert rel_err(out, hf.double()) < 1e-6


def test_conv1d_state_carried_across_calls_equals_one_call():
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(12, 5, generator=gen), torch.randn(5, 4, generator=gen)
    one, one_state = conv.causal_conv1d(x, weight, None, None, activation=None)
    outs, state = [], None
    for a, b in [(0, 2), (2, 3), (3, 9), (9, 10), (10, 11), (11, 12)]:  # shorter than the kernel, decode steps
        o, state = conv.causal_conv1d(x[a:b], weight, None, state, activation=None)
        outs.append(o)
    assert rel_err(torch.cat(outs), one.double()) < 1e-6
    assert torch.equal(state, one_state)


def test_conv1d_rejects_an_unknown_activation():
    with pytest.raises(ValueError, match="activation 'gelu'"):
        conv.causal_conv1d(torch.zeros(2, 3), torch.zeros(3, 4), None, None, activation="gelu")


@pytest.mark.parametrize("per_channel", [False, True], ids=["qwen3_next", "kimi_linear"])
def test_same_convention_as_transformers_torch_fallbacks(per_channel):
    """The models' reference functions (transformers' torch paths) agree on gates, norm, scale and state."""
    if per_channel:
        from transformers.models.kimi_linear.modeling_kimi_linear import (
            chunk_kimi_delta_attention as hf_chunk,
        )
        hk = 4  # KDA has one head count for q, k and v
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            torch_chunk_gated_delta_rule as hf_chunk,
        )
        hk = 2
    q, k, v, g, beta = random_inputs(21, hk=hk, per_channel=per_channel, seed=4)
    s0 = 0.3 * torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(9))
    want, want_s = hf_chunk(q[None], k[None], v[None], g=g[None], beta=beta[None], chunk_size=8,
                            initial_state=s0[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, s = gdr.chunked(q, k, v, g, beta, s0, chunk_size=16, normalize_qk=True)
    assert rel_err(out, want[0].double()) < CHUNK_TOL and rel_err(s, want_s[0].double()) < CHUNK_TOL


def test_chunked_with_repeated_keys():
    """Nearly identical keys, beta ~ 1, almost no decay: the hardest chunk system for a triangular solve."""
    q, k, v, g, beta = random_inputs(100, hk=1, hv=1, dk=32, seed=6, repeated_keys=True)
    out, s = gdr.chunked(q, k, v, g, beta, chunk_size=64, normalize_qk=True)
    ref_out, ref_s = naive_float64(q, k, v, g, beta)
    assert rel_err(out, ref_out) < CHUNK_TOL and rel_err(s, ref_s) < CHUNK_TOL

"""Fused elementwise Triton kernels (RMSNorm +- residual add, SiLU*mul, rope) vs PyTorch.

Two oracles per kernel, on the same random inputs (fresh normals, never zeros;
outputs are new tensors, so a row the kernel skipped would hold garbage and
fail the comparison):

* the plain PyTorch path of ``kvforge.models.layers`` (what CPU runs and what
  CUDA ran before the kernels), evaluated in the model dtype on the same device;
* a float64 evaluation of the same formula, which checks the arithmetic.

Tolerances (``eps`` = ``torch.finfo(dtype).eps``: 2^-7 bf16, 2^-10 fp16,
2^-23 fp32; one rounding to the dtype moves a value by at most ``eps/2`` of
its magnitude):

* RMSNorm: the new residual ``x + residual`` must be bit-identical to torch's
  add (same float32 sum, same single rounding). ``normed`` vs the torch path:
  the kernel reproduces every rounding of the torch path (fp32 math, cast to
  the dtype, then the weight multiply), so only the fp32 ``mean(x^2)``
  reduction order and the hardware rsqrt differ (a few fp32 ulps); that can
  flip the rounding of ``y`` by one step, which the weight multiply carries
  into the output: bound ``2 * eps * |ref|`` (bf16/fp16); fp32: ``1e-5``
  relative (reduction over up to 4096 terms). vs float64: two roundings
  (``y``, then ``w * y``): ``1.01 * eps * |ref|`` plus the same fp32 slack.
* SiLU*mul: torch rounds ``silu(g)`` to the dtype and then the product; the
  kernel does the same, with the hardware exp/division (a few fp32 ulps), so
  ``silu(g)`` may land one rounding step away (``eps * |silu|``), which the
  product carries (``eps * |out|``) before its own rounding can add one more
  step: vs torch ``2 * eps * |ref|``; vs float64 two roundings:
  ``1.01 * eps * |ref|``; fp32: both times 32 (approximate exp/div).
* Rope: torch evaluates ``x * cos + rotate_half(x) * sin`` as
  ``rnd(rnd(a) +- rnd(b))`` with products ``a, b``; vs float64 (with the same
  dtype cos/sin tables, so the kernel's arithmetic is what is checked) that is
  within ``eps * (|a| + |b|)``. The kernel asks for the same roundings, but the
  GPU compiler may contract a product and the sum into one FMA (fewer
  roundings, also within that bound), so vs torch the bound is the sum of
  both: ``2 * eps * (|a| + |b|)``; vs float64 ``1.01 * eps * (|a| + |b|)``.
  In the interpreter (no contraction) 16-bit results must be bit-identical.

A tiny Llama and a tiny Qwen3 (per-head q/k norm, partial rotary) forward with
the kernels must match the unfused forward (same device, same weights), and
on CUDA a graph-captured fused forward must replay to the eager fused result.

Runs compiled on CUDA, or in Triton's CPU interpreter elsewhere (tests/triton_kernel_device.py) at
fewer and smaller shapes; bf16 is skipped there (the interpreter truncates float32 -> bfloat16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_kernel_device import BF16_ROUNDING, DEVICE, INTERPRETED, requires_kernels

from kvforge.kernels.triton_rms_norm import fused_add_rms_norm, rms_norm
from kvforge.kernels.triton_rope import rope_qk, rope_qk_pairs
from kvforge.kernels.triton_silu_mul import silu_and_mul
from kvforge.models import layers
from kvforge.models.layers import RMSNorm, RotaryEmbedding, rotate_half

pytestmark = requires_kernels

DEV = DEVICE
DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason=BF16_ROUNDING))]
# The interpreter runs one program at a time in numpy: a few rows and a masked (non power of two) and an
# unmasked width cover the kernels' logic there.
TOKENS = (1, 7) if INTERPRETED else (1, 7, 256)
HIDDEN = (576, 64) if INTERPRETED else (4096, 2880, 576, 64)
INTERMEDIATE = (2880, 64) if INTERPRETED else (14336, 2880, 576, 64, 1000)


def _eps(dtype) -> float:
    return torch.finfo(dtype).eps


def _rand(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEV)


def _strided(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """``t``'s values in a view whose rows are ``pad`` elements wider apart (last dim contiguous)."""
    buf = torch.full((*t.shape[:-1], t.shape[-1] + pad), float("nan"), dtype=t.dtype, device=t.device)
    buf[..., : t.shape[-1]] = t
    view = buf[..., : t.shape[-1]]
    assert view.stride(-2) == t.shape[-1] + pad and view.stride(-1) == 1
    return view


def _check(out, ref, bound, what):
    """Elementwise ``|out - ref| <= bound`` with the worst offender in the message."""
    assert out.shape == ref.shape, what
    err = (out.double() - ref.double()).abs()
    bad = err > bound
    if bad.any():
        i = int(torch.argmax((err - bound).flatten()))
        pytest.fail(
            f"{what}: {int(bad.sum())}/{err.numel()} elements out of bound; worst at {i}: "
            f"out {out.flatten()[i].item()} ref {ref.flatten()[i].item()} bound {bound.flatten()[i].item()}"
        )


# ----------------------------------------------------------------- RMSNorm
def _norm_ref64(s: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    sd = s.double()
    return w.double() * sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps)


def _norm_bounds(ref, dtype, steps=(2, 1.01)):
    """(vs the PyTorch path, vs float64): ``steps`` rounding steps of the dtype each (16-bit), the second
    plus float32 slack; float32: 1e-5 relative both."""
    e = _eps(dtype)
    tiny = torch.finfo(dtype).tiny
    if dtype == torch.float32:
        return 1e-5 * ref.abs() + tiny, 1e-5 * ref.abs() + tiny
    return steps[0] * e * ref.abs() + tiny, steps[1] * e * ref.abs() + 1e-5 * ref.abs() + tiny


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("strided", [False, True])
def test_fused_add_rms_norm(dtype, n, t, strided):
    gen = torch.Generator().manual_seed(n * 1000 + t)
    norm = RMSNorm(n, eps=1e-5, dtype=dtype, device=DEV)
    with torch.no_grad():
        norm.weight.copy_(_rand((n,), dtype, gen, 0.2) + 1)
    x = _rand((t, n), dtype, gen, 0.5)
    res = _rand((t, n), dtype, gen, 4.0)
    if strided:
        x, res = _strided(x), _strided(res, pad=5)
    x_before, res_before = x.clone(), res.clone()
    with torch.no_grad():
        out, new_res = fused_add_rms_norm(x, res, norm.weight, norm.eps)
        torch_res = x + res
        torch_out = norm._norm(torch_res)
    assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs modified"
    assert out.dtype == dtype and new_res.dtype == dtype
    assert torch.equal(new_res, torch_res), "new residual differs from torch's add"
    vs_torch, vs_64 = _norm_bounds(torch_out, dtype)
    _check(out, torch_out, vs_torch, "normed vs torch")
    ref = _norm_ref64(torch_res, norm.weight, norm.eps)
    _check(out, ref, _norm_bounds(ref, dtype)[1], "normed vs float64")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("t", TOKENS)
def test_rms_norm(dtype, n, t):
    gen = torch.Generator().manual_seed(7 + n + t)
    w = _rand((n,), dtype, gen, 0.2) + 1
    x = _strided(_rand((t, n), dtype, gen, 3.0)) if t > 1 else _rand((t, n), dtype, gen, 3.0)
    out = rms_norm(x, w, 1e-6)
    norm = RMSNorm(n, eps=1e-6, dtype=dtype, device=DEV)
    with torch.no_grad():
        norm.weight.copy_(w)
        torch_out = norm._norm(x)
    vs_torch, _ = _norm_bounds(torch_out, dtype)
    _check(out, torch_out, vs_torch, "rms_norm vs torch")
    ref = _norm_ref64(x, w, 1e-6)
    _check(out, ref, _norm_bounds(ref, dtype)[1], "rms_norm vs float64")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_head_view(dtype):
    """Per-head norm (Qwen3 q_norm) on a ``[T, H, D]`` view of a fused qkv output, weight fp32 too."""
    gen = torch.Generator().manual_seed(11)
    t, h, d = 7, 5, 64
    qkv = _rand((t, (h + 4) * d), dtype, gen)
    q = qkv[:, : h * d].view(t, h, d)
    for w_dtype in (dtype, torch.float32):
        w = _rand((d,), w_dtype, gen, 0.2) + 1
        out = rms_norm(q, w, 1e-6)
        norm = RMSNorm(d, eps=1e-6, dtype=w_dtype, device=DEV)
        with torch.no_grad():
            norm.weight.copy_(w)
            torch_out = norm._norm(q)
        assert out.dtype == torch_out.dtype
        # Output may be fp32 (fp32 weight): its bound is still set by the rounding of y to `dtype`.
        _check(out, torch_out, _norm_bounds(torch_out, dtype)[0], f"head-view norm, weight {w_dtype}")


# The zero-centred norm computes in float32 throughout and rounds once: against torch's path the reduction
# order and rsqrt can move it by one rounding step; against float64 half a step plus the float32 slack.
ZERO_CENTRED_STEPS = (1.01, 0.51)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", HIDDEN)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_zero_centred_rms_norm(dtype, n, t, with_residual):
    """Gemma's ``x / rms(x) * (1 + w)`` (kvforge.models.gemma3.GemmaRMSNorm): alone and after the residual
    add, on strided rows, against the module's PyTorch path and a float64 evaluation."""
    from kvforge.models.gemma3 import GemmaRMSNorm

    gen = torch.Generator().manual_seed(3 * n + t + with_residual)
    norm = GemmaRMSNorm(n, 1e-6, dtype=dtype).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(_rand((n,), dtype, gen, 0.3))
    x = _strided(_rand((t, n), dtype, gen, 0.5))
    res = _rand((t, n), dtype, gen, 4.0) if with_residual else None
    with torch.no_grad():
        if with_residual:
            out, new_res = fused_add_rms_norm(x, res, norm.weight, norm.eps, zero_centred=True)
            s = x + res
            assert torch.equal(new_res, s), "new residual differs from torch's add"
        else:
            out, s = rms_norm(x, norm.weight, norm.eps, zero_centred=True), x
        torch_out = norm._norm(s)
    assert out.dtype == dtype
    vs_torch, _ = _norm_bounds(torch_out, dtype, ZERO_CENTRED_STEPS)
    _check(out, torch_out, vs_torch, "zero-centred norm vs torch")
    sd = s.double()
    ref = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight.double())
    _check(out, ref, _norm_bounds(ref, dtype, ZERO_CENTRED_STEPS)[1], "zero-centred norm vs float64")


# ----------------------------------------------------------------- SiLU * mul
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", INTERMEDIATE)
@pytest.mark.parametrize("t", TOKENS)
def test_silu_and_mul(dtype, inter, t):
    gen = torch.Generator().manual_seed(inter + t)
    gate_up = _rand((t, 2 * inter), dtype, gen, 2.0)
    if t > 1:
        gate_up = _strided(gate_up, pad=7)
    out = silu_and_mul(gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    torch_out = F.silu(gate) * up
    e, tiny = _eps(dtype), torch.finfo(dtype).tiny
    k = 32 if dtype == torch.float32 else 1
    _check(out, torch_out, 2 * k * e * torch_out.abs().double() + tiny, "silu*mul vs torch")
    g64, u64 = gate.double(), up.double()
    ref = g64 * torch.sigmoid(g64) * u64
    _check(out, ref, (k * 1.01) * e * ref.abs() + tiny, "silu*mul vs float64")


# ----------------------------------------------------------------- rope
ROPE_CASES = [
    # (q heads, kv heads, head_dim, rotary_dim, rope scaling)
    (32, 8, 128, 128, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)),  # Llama-3.1-8B
    (9, 3, 64, 64, None),  # SmolLM2-135M
    (8, 2, 128, 64, None),  # partial rotary, power-of-two tail
    (5, 1, 80, 32, dict(rope_type="linear", factor=2.0)),  # odd heads, 48-wide tail
    (4, 2, 16, 8, None),  # Qwen3-Next test shapes: quarter-width pairs, a tail as wide as the rotated part
    (4, 2, 32, 16, None),
]


def _rope_ref64(x, cos, sin, rd):
    """float64 ``x * cos + rotate_half(x) * sin`` on the first ``rd`` features, and its error scale."""
    xd, c, s = x.double(), cos.double(), sin.double()
    rot, rest = xd[..., :rd], xd[..., rd:]
    a, b = rot * c, rotate_half(rot) * s
    ref = torch.cat((a + b, rest), dim=-1)
    scale = torch.cat((a.abs() + b.abs(), torch.zeros_like(rest)), dim=-1)
    return ref, scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(ROPE_CASES)))
@pytest.mark.parametrize("t", TOKENS)
def test_rope_qk(dtype, case, t):
    hq, hk, d, rd, scaling = ROPE_CASES[case]
    gen = torch.Generator().manual_seed(case * 100 + t)
    rotary = RotaryEmbedding(d, rd, 500000.0, scaling).to(DEV)
    positions = torch.randint(0, 130000, (t,), generator=gen).to(DEV)
    cos, sin = rotary.cos_sin(positions, dtype)
    qkv = _rand((t, (hq + 2 * hk) * d), dtype, gen, 2.0)  # q and k are strided views of it
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    before = qkv.clone()
    qo, ko = rope_qk(q, k, cos, sin, rd)
    assert torch.equal(qkv, before), "inputs modified"
    tq, tk = rotary._rotate(q, cos, sin), rotary._rotate(k, cos, sin)
    e = _eps(dtype)
    for name, out, x, torch_out in (("q", qo, q, tq), ("k", ko, k, tk)):
        ref, scale = _rope_ref64(x, cos, sin, rd)
        assert torch.equal(out[..., rd:], x[..., rd:]), f"{name} pass-through features changed"
        tiny = torch.finfo(dtype).tiny
        _check(out, torch_out, 2 * e * scale + tiny, f"{name} vs torch")
        if INTERPRETED and dtype != torch.float32:
            assert torch.equal(out, torch_out), f"{name}: not bit-identical to torch"
        _check(out, ref, 1.01 * e * scale + tiny, f"{name} vs float64")


def test_rope_rejects_mismatched_tables():
    q = torch.zeros(3, 2, 8, device=DEV)
    with pytest.raises(ValueError, match="do not match"):
        rope_qk(q, q, torch.zeros(3, 1, 4, device=DEV), torch.zeros(3, 1, 4, device=DEV), 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("t", TOKENS)
def test_rope_qk_pairs_deepseek_layout(dtype, interleaved, t):
    """DeepSeek's rope features (kvforge/models/deepseek.py, ``DeepseekRotary``): 64 of them, half-width
    angle tables, pairs (x[2j], x[2j+1]) rotated into (out[j], out[j+32]) when interleaved; q heads a strided
    view of the q projection, k one head of the latent projection."""
    heads, dn, p, r = 16, 128, 64, 512
    gen = torch.Generator().manual_seed(t + 10 * interleaved)
    pos = torch.randint(0, 4096, (t,), generator=gen).double()
    inv = 1.0 / 10000.0 ** (torch.arange(0, p, 2, dtype=torch.float64) / p)
    ang = pos[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :].to(dtype).to(DEV), ang.sin()[:, None, :].to(dtype).to(DEV)
    q = _rand((t, heads, dn + p), dtype, gen, 2.0)[..., dn:]
    k = _rand((t, r + p), dtype, gen, 2.0)[:, None, r:]
    qo, ko = rope_qk_pairs(q, k, cos, sin, interleaved)
    e, tiny = _eps(dtype), torch.finfo(dtype).tiny
    for name, out, x in (("q", qo, q), ("k", ko, k)):
        xd, c, sn = x.double().cpu(), cos.double().cpu(), sin.double().cpu()
        x1, x2 = (xd[..., 0::2], xd[..., 1::2]) if interleaved else (xd[..., :p // 2], xd[..., p // 2:])
        ref = torch.cat((x1 * c - x2 * sn, x2 * c + x1 * sn), dim=-1)
        scale = torch.cat(((x1 * c).abs() + (x2 * sn).abs(), (x2 * c).abs() + (x1 * sn).abs()), dim=-1)
        _check(out.cpu(), ref, 1.01 * e * scale + tiny, f"{name} vs float64")


def test_deepseek_rotary_takes_the_kernel_and_matches_its_formula(monkeypatch):
    from kvforge.kernels import triton_rope
    from kvforge.models.deepseek import DeepseekArgs, DeepseekRotary

    monkeypatch.setattr(layers, "FUSED_DEVICES", (DEV,))
    monkeypatch.setattr(layers, "FUSED_KERNELS", True)
    calls = []
    real = triton_rope.rope_qk_pairs
    monkeypatch.setattr(triton_rope, "rope_qk_pairs", lambda *a: calls.append(a[-1]) or real(*a))
    cfg = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=64,
               num_hidden_layers=1, num_attention_heads=4, intermediate_size=96, kv_lora_rank=32,
               qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, vocab_size=64,
               max_position_embeddings=64, rms_norm_eps=1e-5, q_lora_rank=None)
    rotary = DeepseekRotary(DeepseekArgs(cfg)).to(DEV)
    gen = torch.Generator().manual_seed(3)
    rope = rotary.cos_sin(torch.arange(5).to(DEV), torch.float32)
    q, k = _rand((5, 4, 16), torch.float32, gen), _rand((5, 1, 16), torch.float32, gen)
    with torch.no_grad():
        qo, ko = rotary.rotate_qk(rope, q, k)
    assert calls == [True]  # DeepSeek-V2 pairs are interleaved
    _check(qo, rotary.rotate(rope, q), 1e-6 * q.abs().max() * torch.ones_like(qo), "q vs the formula")
    _check(ko, rotary.rotate(rope, k), 1e-6 * k.abs().max() * torch.ones_like(ko), "k vs the formula")


# ----------------------------------------------------------------- integration
def _tiny_model(arch, dtype, **extra):
    from kvforge.models.registry import build_model
    from kvforge.weights import load_weights

    config = dict(
        architectures=[arch], hidden_size=192, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, intermediate_size=320, vocab_size=300, rms_norm_eps=1e-5, **extra,
    )
    model = build_model(config, dtype, DEV)
    load_weights(model, None, "dummy", seed=5)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # dummy norms are all ones: make the weight multiply count
                p.copy_(_rand(p.shape, p.dtype, gen, 0.2) + 1)
    return model


class _CausalAttn:
    """One sequence, causal, no cache: ``attn(layer, q, k, v)`` for the model forward."""

    def __init__(self, scale):
        self.scale = scale

    def __call__(self, layer_idx, q, k, v):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=self.scale
        )
        return out.transpose(0, 1)


@pytest.fixture
def fused_on_device(monkeypatch):
    """Kernels on for DEV (the interpreter runs them on CPU); counts the kernel calls."""
    from kvforge.kernels import triton_rms_norm, triton_rope, triton_silu_mul

    monkeypatch.setattr(layers, "FUSED_DEVICES", (DEV,))
    monkeypatch.setattr(layers, "FUSED_KERNELS", True)
    calls = {}
    for mod, name in ((triton_rms_norm, "rms_norm"), (triton_rms_norm, "fused_add_rms_norm"),
                      (triton_silu_mul, "silu_and_mul"), (triton_rope, "rope_qk")):
        fn = getattr(mod, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **kw)

        monkeypatch.setattr(mod, name, counted)
    return calls


def _forward_fused_then_plain(model, float32_reference: bool = False):
    """``(fused, plain, reference)`` forwards of one prompt: with the kernels, without (the fixture's
    monkeypatch restores the switch), and, where asked, an unfused float32 copy of the model (else None)."""
    import copy

    t = 6 if INTERPRETED else 23
    ids = torch.randint(0, 300, (t,), generator=torch.Generator().manual_seed(1)).to(DEV)
    pos = torch.arange(t, device=DEV)
    attn = _CausalAttn(model.softmax_scale)
    with torch.inference_mode():
        fused = model(ids, pos, attn)
        layers.FUSED_KERNELS = False
        plain = model(ids, pos, attn)
        reference = copy.deepcopy(model).float()(ids, pos, attn) if float32_reference else None
    return fused, plain, reference


MODEL_CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen3-partial-rope": ("Qwen3ForCausalLM", dict(head_dim=32, partial_rotary_factor=0.5)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_model_forward_fused_matches_unfused(fused_on_device, dtype, case):
    arch, extra = MODEL_CASES[case]
    model = _tiny_model(arch, dtype, **extra)
    fused, plain, _ = _forward_fused_then_plain(model)
    n_layers = model.num_layers
    assert fused_on_device["fused_add_rms_norm"] == 2 * n_layers  # n-1 layer joins + post-attn x n + final
    assert fused_on_device["rope_qk"] == n_layers and fused_on_device["silu_and_mul"] == n_layers
    assert fused_on_device.get("rms_norm", 0) == (1 + (2 * n_layers if case.startswith("qwen3") else 0))
    rel = ((fused.double() - plain.double()).norm() / plain.double().norm()).item()
    # fp32: only reduction order / rsqrt differ. 16-bit: one-ulp rounding flips (see the norm
    # bounds above) propagate through 3 layers; a wrong kernel gives errors of order 1.
    assert rel <= (1e-5 if dtype == torch.float32 else 2e-2), rel


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma3_forward_fused_matches_unfused(fused_on_device, dtype):
    """Gemma 3's four zero-centred norms a layer: the residual adds join the input and pre-feedforward norms.

    16-bit: the fused and the unfused forward round the same values the same number of times, only in
    another summation order, so against a float32 forward of the same weights the fused one must be as
    close as the unfused one (up to 1.5x: rounding flips are random); a wrong kernel is off by order 1."""
    model = _tiny_model("Gemma3ForCausalLM", dtype, head_dim=32, sliding_window=4, query_pre_attn_scalar=32)
    fused, plain, reference = _forward_fused_then_plain(model, float32_reference=dtype != torch.float32)
    n_layers = model.num_layers
    assert fused_on_device["fused_add_rms_norm"] == 2 * n_layers  # n-1 layer joins + pre-feedforward x n + final
    assert fused_on_device["rms_norm"] == 1 + 4 * n_layers  # first input, post-attention, post-ff, q and k

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    if dtype == torch.float32:
        assert rel(fused, plain) <= 1e-5
    else:
        assert rel(fused, reference) <= 1.5 * rel(plain, reference) + 1e-3, (rel(fused, reference),
                                                                             rel(plain, reference))


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a GPU")
def test_fused_forward_in_cuda_graph(fused_on_device):
    model = _tiny_model("LlamaForCausalLM", torch.bfloat16)
    t = 16
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 300, (t,), generator=gen).to(DEV)
    pos = torch.arange(t, device=DEV) + 100
    attn = _CausalAttn(model.softmax_scale)
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(ids, pos, attn)  # warm-up compiles the kernels outside capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(ids, pos, attn)
        graph.replay()
        first = out.clone()
        ids.copy_(torch.randint(0, 300, (t,), generator=gen).to(DEV))
        pos.copy_(torch.arange(t, device=DEV) + 7)
        graph.replay()
        torch.cuda.synchronize()
        eager = model(ids, pos, attn)
    assert fused_on_device["rope_qk"] >= 3

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    # Same kernels, same inputs; only a GEMM algorithm choice could differ between graph and eager.
    assert rel(out, eager) <= 1e-2
    assert rel(first, eager) > 0.1  # the replay really recomputed from the new inputs

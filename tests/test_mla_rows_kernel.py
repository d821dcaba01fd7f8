"""An MLA layer's latent RMSNorm, rope and cache write in one kernel (kvforge/kernels/triton_mla_rows.py)
against PyTorch.

References: float64 formulas with the bound of the roundings the kernel is allowed (the norm: two roundings
to the model dtype, before and after the weight, plus float32's ``rsqrt``; the rope: one rounding of each
product and of the sum, ``1.01 * eps * (|a| + |b|)``), the engine's PyTorch path (``RMSNorm`` and
``DeepseekRotary.rotate``: within one ulp of the model dtype for the latent, whose sum of squares may be
reduced in another order and whose float32 ``rsqrt`` may differ, and within twice the rope bound), and PyTorch's fp8 cast of the separate norm and
rope kernels' outputs for quantized caches (compiled GPU only: the interpreter's fp8 casts round
differently, ``FP8_ROUNDING``). The engine test runs a tiny DeepSeek-V2 through the runner's ``mla_rows``
path with this kernel against transformers.
"""

from __future__ import annotations

import pytest
import torch
from triton_kernel_device import BF16_ROUNDING, DEVICE, FP8_ROUNDING, INTERPRETED, requires_kernels

from kvforge.kernels.triton_mla_rows import norm_rope_write_mla
from kvforge.kernels.triton_rms_norm import rms_norm
from kvforge.kernels.triton_rope import rope_qk_pairs
from kvforge.models.layers import RMSNorm

pytestmark = requires_kernels
DEV = DEVICE
BLOCK, BLOCKS, TOKENS = 16, 5, 7
EPS = 1e-6
#: (query heads, latent width R, rope width P)
CASES = [(4, 32, 8), (3, 48, 16)]  # the second: padded heads and latent width
if not INTERPRETED:
    CASES.append((16, 512, 64))  # DeepSeek-V2-Lite


def _setup(case, dtype, cache_dtype, seed):
    hq, r, p = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    width = hq * (16 + p) + r + p  # one fused product's row: q (nope + rope per head), then [latent | k_rope]
    fused = (torch.randn(TOKENS, width, generator=gen, dtype=torch.float64) * 2).to(dtype).to(DEV)
    q_rope = fused[:, : hq * (16 + p)].view(TOKENS, hq, 16 + p)[:, :, 16:]
    kv = fused[:, hq * (16 + p):]
    angles = torch.rand(TOKENS, 1, p // 2, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = (angles.cos() * 1.1).to(dtype).to(DEV), (angles.sin() * 1.1).to(dtype).to(DEV)  # a YaRN-like factor
    weight = (1 + 0.3 * torch.randn(r, generator=gen)).to(dtype).to(DEV)
    slots = torch.randperm(BLOCKS * BLOCK, generator=gen)[:TOKENS]
    slots[[1, 4]] = -1
    cache = torch.randn(BLOCKS, BLOCK, r + p, generator=gen).to(cache_dtype).to(DEV)  # junk everywhere
    scale = (torch.rand(1, generator=gen) + 0.25).to(DEV)
    return q_rope, kv, weight, cos, sin, slots.to(DEV), cache, scale, r


def _pairs(x, interleaved):
    return (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)


def _rope_bound(x, cos, sin, interleaved, dtype):
    """The float64 rotation of ``x [..., P]`` (de-interleaved) and ``1.01 * eps * (|a| + |b|)`` per element."""
    x1, x2 = (h.double() for h in _pairs(x, interleaved))
    c, s = cos.double(), sin.double()
    ref = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    mag = torch.cat(((x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()), dim=-1)
    return ref, 1.01 * torch.finfo(dtype).eps * mag + torch.finfo(dtype).tiny


def _norm_bound(x, weight, dtype):
    """The float64 RMSNorm of ``x [T, R]`` and its bound: two roundings to ``dtype`` and float32's rsqrt."""
    xd, w = x.double(), weight.double()
    ref = w * xd / (xd.pow(2).mean(-1, keepdim=True) + EPS).sqrt()
    return ref, (2.01 * torch.finfo(dtype).eps + 2.0**-21) * ref.abs() + torch.finfo(dtype).tiny


def _within(out, ref, bound, what):
    err = (out.double() - ref.double()).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())}/{err.numel()} out of bound, worst excess "
                           f"{(err - bound).max().item():.3g}")


def _torch_rotate(x, cos, sin, interleaved):
    """The engine's PyTorch rope (:meth:`kvforge.models.deepseek.DeepseekRotary.rotate`'s formula)."""
    x1, x2 = _pairs(x, interleaved)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(
    torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason=BF16_ROUNDING))])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_model_dtype_cache_holds_the_normed_latent_and_the_rotated_key(dtype, interleaved, case):
    q_rope, kv, weight, cos, sin, slots, cache, scale, r = _setup(case, dtype, dtype, seed=3 + case)
    before_kv, before_q, before_cache = kv.clone(), q_rope.clone(), cache.clone()
    qo = norm_rope_write_mla(q_rope, kv, weight, EPS, cos, sin, interleaved, cache, slots)
    assert torch.equal(kv, before_kv) and torch.equal(q_rope, before_q), "inputs modified"
    keep = slots >= 0
    rows = cache[slots[keep] // BLOCK, slots[keep] % BLOCK]
    c, s = cos[:, 0], sin[:, 0]
    # The query's rope features, every token (the skipped ones too).
    ref, bound = _rope_bound(q_rope, cos, sin, interleaved, dtype)
    _within(qo, ref, bound, "q vs float64")
    _within(qo, _torch_rotate(q_rope, cos, sin, interleaved), 2 * bound, "q vs torch")
    # The cached key's rope features.
    k = kv[keep, r:]
    ref, bound = _rope_bound(k, c[keep], s[keep], interleaved, dtype)
    _within(rows[:, r:], ref, bound, "cached k_rope vs float64")
    _within(rows[:, r:], _torch_rotate(k, c[keep], s[keep], interleaved), 2 * bound, "cached k_rope vs torch")
    # The cached latent.
    ref, bound = _norm_bound(kv[keep, :r], weight, dtype)
    _within(rows[:, :r], ref, bound, "cached latent vs float64")
    norm = RMSNorm(r, EPS, dtype=dtype).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(weight)
        torch_latent = norm._norm(kv[keep, :r])
    # One ulp (at most 2 eps relative) of the rounded latent, and float32's rsqrt where the dtype is float32.
    ulp = (2 * torch.finfo(dtype).eps + 2.0**-21) * torch_latent.double().abs()
    _within(rows[:, :r], torch_latent, ulp, "cached latent vs torch's RMSNorm")
    untouched = torch.ones(BLOCKS * BLOCK, dtype=torch.bool, device=DEV)
    untouched[slots[keep]] = False
    assert torch.equal(cache.view(-1, cache.shape[-1])[untouched], before_cache.view(-1, cache.shape[-1])[untouched])


@pytest.mark.skipif(INTERPRETED, reason=FP8_ROUNDING)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fp8_cache_holds_the_quantized_rows(cache_dtype, case):
    """The cached row is PyTorch's fp8 cast of the separate norm and rope kernels' outputs over the scale
    (those kernels are checked against float64 in tests/test_fused_elementwise.py), within one fp8 step
    where the latent's sum of squares rounds differently; the query equals the rope kernel's."""
    dtype = torch.bfloat16
    q_rope, kv, weight, cos, sin, slots, cache, scale, r = _setup(case, dtype, cache_dtype, seed=30 + case)
    qo = norm_rope_write_mla(q_rope, kv, weight, EPS, cos, sin, True, cache, slots, scale)
    rq, rk = rope_qk_pairs(q_rope, kv[:, None, r:], cos, sin, True)
    assert torch.equal(qo, rq)
    keep = slots >= 0
    rows = cache[slots[keep] // BLOCK, slots[keep] % BLOCK]
    latent = rms_norm(kv[:, :r], weight, EPS)
    fmax = torch.finfo(cache_dtype).max
    want = (torch.cat([latent, rk[:, 0]], dim=-1)[keep].float() / scale).clamp(-fmax, fmax).to(cache_dtype)
    assert torch.equal(rows[:, r:].view(torch.uint8), want[:, r:].view(torch.uint8)), "k_rope bytes differ"
    step = (rows[:, :r].float() - want[:, :r].float()).abs()
    assert (step <= want[:, :r].float().abs() * 2.0**-2 + 2.0**-16).all(), "latent off by more than one fp8 step"
    assert (step > 0).float().mean() <= 0.01, "latent bytes differ in more than 1% of the elements"


def test_saturation_skipped_slots_and_short_slot_mappings():
    """Overflow saturates to +-fmax for fp8 caches (values chosen so every cast is exact: the interpreter runs
    this too); -1 slots and tokens past the slot mapping stay unstored while their queries rotate."""
    dtype = torch.float16
    hq, r, p = 2, 16, 8
    cos = torch.ones(4, 1, p // 2, dtype=dtype, device=DEV)  # angle 0: rope keeps every value
    sin = torch.zeros(4, 1, p // 2, dtype=dtype, device=DEV)
    q = torch.arange(4 * hq * p, dtype=dtype, device=DEV).view(4, hq, p)
    kv = torch.ones(4, r + p, dtype=dtype, device=DEV)
    kv[0, r:r + 2] = 1e4  # over e4m3's 448 after the 0.5 scale
    kv[0, r + 2:r + 4] = -1e4
    weight = torch.ones(r, dtype=dtype, device=DEV)
    slots = torch.tensor([5, -1, 20], device=DEV)  # token 3 is past the mapping
    cache = torch.full((2, BLOCK, r + p), 3.0, device=DEV).to(torch.float8_e4m3fn)
    before = cache.clone()
    scale = torch.full((1,), 0.5, device=DEV)
    qo = norm_rope_write_mla(q, kv, weight, 0.0, cos, sin, False, cache, slots, scale)
    assert torch.equal(qo, q)
    flat = cache.view(2 * BLOCK, r + p).float()
    assert (flat[5, :r] == 2).all()  # a row of ones normalizes to ones, over the 0.5 scale
    assert (flat[5, r:r + 2] == 448).all() and (flat[5, r + 2:r + 4] == -448).all() and (flat[5, r + 4:] == 2).all()
    assert (flat[20] == 2).all()
    untouched = [i for i in range(2 * BLOCK) if i not in (5, 20)]
    assert torch.equal(cache.view(2 * BLOCK, -1)[untouched].view(torch.uint8),
                       before.view(2 * BLOCK, -1)[untouched].view(torch.uint8))


def test_bad_inputs_are_refused():
    q = torch.zeros(3, 2, 8, device=DEV)
    kv = torch.zeros(3, 40, device=DEV)
    w = torch.zeros(32, device=DEV)
    cos = torch.zeros(3, 1, 4, device=DEV)
    cache = torch.zeros(2, BLOCK, 40, device=DEV)
    slots = torch.zeros(3, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="do not fit"):
        norm_rope_write_mla(q, kv[:, :39], w, EPS, cos, cos, True, cache, slots)
    with pytest.raises(ValueError, match="cos/sin"):
        norm_rope_write_mla(q, kv, w, EPS, cos[:2], cos[:2], True, cache, slots)
    with pytest.raises(ValueError, match="dtype mismatch"):
        norm_rope_write_mla(q, kv, w.half(), EPS, cos, cos, True, cache, slots)
    with pytest.raises(ValueError, match="per-tensor scale"):
        norm_rope_write_mla(q, kv, w, EPS, cos, cos, True, cache.to(torch.float8_e4m3fn), slots)


@pytest.mark.skipif(not INTERPRETED, reason="the CUDA engine takes this path by default (tests/test_engine_gpu.py)")
@pytest.mark.parametrize("case", ["v2_group_limited", "v3_no_interleave"])
def test_engine_with_the_rows_made_in_the_cache_write_matches_transformers(tmp_path, monkeypatch, case):
    """A tiny DeepSeek (float32) on CPU whose MLA backend makes its rows with this kernel (interpreted) through
    the runner's ``mla_rows`` path: prefill and decode logits against transformers within the bound of
    tests/test_deepseek_mla.py's engine test."""
    pytest.importorskip("transformers")
    from test_deepseek_mla import _hf_last_logits, _save_hf

    from kvforge import LLM
    from kvforge.attention.backends.mla_reference import MLAReferenceBackend
    from kvforge.models import layers

    calls = []

    def norm_rope_and_write_mla(self, kv, slot_mapping, q_rope, kv_rows, norm_weight, eps, cos, sin, interleaved):
        calls.append(q_rope.shape[0])
        return norm_rope_write_mla(q_rope, kv_rows, norm_weight, eps, cos, sin, interleaved, kv.cache, slot_mapping,
                                   kv.k_scale)

    monkeypatch.setattr(layers, "FUSED_DEVICES", ("cpu",))
    monkeypatch.setattr(layers, "FUSED_KERNELS", True)
    monkeypatch.setattr(MLAReferenceBackend, "fuses_mla_rows", True, raising=False)
    monkeypatch.setattr(MLAReferenceBackend, "norm_rope_and_write_mla", norm_rope_and_write_mla)
    hf = _save_hf(tmp_path, case)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 20,
              progress=False, device="cpu")
    g = torch.Generator().manual_seed(1)
    p1 = torch.randint(0, 256, (13,), generator=g).tolist()
    cont = torch.randint(0, 256, (4,), generator=g).tolist()
    runner, table = llm.engine.runner, [40, 7, 33, 12, 25]
    max_diff, scale = 0.0, 1.0
    logits = runner.run([(p1, 0, table)], [len(p1) - 1])
    rows = [(logits[0], list(p1))]
    seq = list(p1)
    for tok in cont:
        logits = runner.run([([tok], len(seq), table)], [0])
        seq.append(tok)
        rows.append((logits[0], list(seq)))
    assert len(calls) == (1 + len(cont)) * 3, calls  # three MLA layers a step took the kernel
    for row, ids in rows:
        ref = _hf_last_logits(hf, ids)
        max_diff, scale = max(max_diff, (row - ref).abs().max().item()), max(scale, ref.abs().max().item())
    assert max_diff <= 1e-4 * scale, (max_diff, scale)

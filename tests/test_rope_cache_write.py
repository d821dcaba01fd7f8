"""Rope on q and k with the paged cache write of k and v in one kernel
(kvforge/kernels/triton_rope_cache_write.py) against PyTorch.

References: the rotate-half formula in float64 (error bound ``1.01 * eps * (|x cos| + |rot(x) sin|)``, one
rounding of each product and of the sum), PyTorch's own rotation in the activation dtype (the engine's
CPU path; within twice that bound, bit-identical in the interpreter, where no FMA contraction happens) and
PyTorch's fp8 cast for the quantized cache (compiled GPU only: the interpreter's fp8 casts round
differently, ``FP8_ROUNDING``). The engine test runs a tiny Llama with the fused kernel in the runner's
path against Hugging Face transformers.
"""

from __future__ import annotations

import pytest
import torch
from triton_kernel_device import BF16_ROUNDING, DEVICE, FP8_ROUNDING, INTERPRETED, requires_kernels

from kvforge.kernels.triton_rope import rope_qk
from kvforge.kernels.triton_rope_cache_write import rope_and_write_kv
from kvforge.models.layers import RotaryEmbedding

pytestmark = requires_kernels
DEV = DEVICE
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
CASES = [
    # (q heads, kv heads, head_dim, rotary_dim, rope scaling)
    (8, 2, 64, 64, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=64)),
    (5, 3, 48, 32, None),  # padded heads and features, a 16-wide tail that passes through
]
if not INTERPRETED:
    CASES.append((32, 8, 128, 128, None))  # Llama-3.1-8B
BLOCK, BLOCKS, TOKENS = 16, 6, 9


def _setup(case, dtype, cache_dtype, seed):
    hq, hkv, d, rd, scaling = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding(d, rd, 500000.0, scaling).to(DEV)
    cos, sin = rotary.cos_sin(torch.randint(0, 100000, (TOKENS,), generator=gen).to(DEV), dtype)
    qkv = (torch.randn(TOKENS, (hq + 2 * hkv) * d, generator=gen, dtype=torch.float64) * 2).to(dtype).to(DEV)
    qk = qkv[:, : (hq + hkv) * d].view(TOKENS, hq + hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(TOKENS, hkv, d)
    slots = torch.randperm(BLOCKS * BLOCK, generator=gen)[:TOKENS]
    slots[[2, 6]] = -1
    cache = torch.randn(BLOCKS, 2, hkv, BLOCK, d, generator=gen).to(cache_dtype).to(DEV)  # junk everywhere
    k_scale = (torch.rand(hkv, generator=gen) + 0.25).to(DEV)
    v_scale = (torch.rand(hkv, generator=gen) + 0.25).to(DEV)
    return rotary, cos, sin, qk, hq, v, slots.to(DEV), cache, k_scale, v_scale


def _slot_rows(cache, slots):
    """``[T, 2, Hkv, D]``: the cache rows at ``slots`` (each >= 0)."""
    bs = cache.shape[3]
    return cache[slots // bs, :, :, slots % bs]


def _bound(x, cos, sin, rd, dtype):
    """The float64 rotation of ``x`` and ``1.01 * eps * (|a| + |b|)`` per element (0 on the tail)."""
    xd, c, s = x.double(), cos.double(), sin.double()
    half = rd // 2
    x1, x2, ch, sh = xd[..., :half], xd[..., half:rd], c[..., :half], s[..., :half]
    ref = torch.cat((x1 * ch - x2 * sh, x2 * ch + x1 * sh, xd[..., rd:]), dim=-1)
    mag = torch.cat(((x1 * ch).abs() + (x2 * sh).abs(), (x2 * ch).abs() + (x1 * sh).abs(),
                     torch.zeros_like(xd[..., rd:])), dim=-1)
    return ref, 1.01 * torch.finfo(dtype).eps * mag + torch.finfo(dtype).tiny


def _within(out, ref, bound, what):
    err = (out.double() - ref.double()).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())}/{err.numel()} out of bound, worst excess "
                           f"{(err - bound).max().item():.3g}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(
    torch.bfloat16, marks=pytest.mark.skipif(INTERPRETED, reason=BF16_ROUNDING))])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_model_dtype_cache_holds_rotated_k_and_v(dtype, case):
    rotary, cos, sin, qk, hq, v, slots, cache, ks, vs = _setup(case, dtype, dtype, seed=10 + case)
    rd = rotary.rotary_dim
    q, k = qk[:, :hq], qk[:, hq:]
    before_inputs, before_cache = qk.clone(), cache.clone()
    qo = rope_and_write_kv(q, k, v, cos, sin, rd, cache, slots, ks, vs)
    assert torch.equal(qk, before_inputs), "inputs modified"
    keep = slots >= 0
    rows = _slot_rows(cache, slots[keep])
    torch_q, torch_k = rotary._rotate(q, cos, sin), rotary._rotate(k, cos, sin)
    for name, out, x, torch_out in (("q", qo, q, torch_q), ("cached k", rows[:, 0], k[keep], torch_k[keep])):
        c, s = (cos, sin) if name == "q" else (cos[keep], sin[keep])
        ref, bound = _bound(x, c, s, rd, dtype)
        _within(out, ref, bound, f"{name} vs float64")
        _within(out, torch_out, 2 * bound, f"{name} vs torch")
        if INTERPRETED:
            assert torch.equal(out, torch_out), f"{name}: not bit-identical to torch in the interpreter"
        assert torch.equal(out[..., rd:], x[..., rd:]), f"{name}: tail features changed"
    assert torch.equal(rows[:, 1], v[keep]), "cached v differs from v"
    untouched = torch.ones(BLOCKS * BLOCK, dtype=torch.bool, device=DEV)
    untouched[slots[keep]] = False
    flat = cache.permute(0, 3, 1, 2, 4).reshape(BLOCKS * BLOCK, -1)
    flat_before = before_cache.permute(0, 3, 1, 2, 4).reshape(BLOCKS * BLOCK, -1)
    assert torch.equal(flat[untouched], flat_before[untouched]), "a slot not in the mapping changed"


@pytest.mark.skipif(INTERPRETED, reason=FP8_ROUNDING)
@pytest.mark.parametrize("cache_dtype", list(FP8_MAX), ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fp8_cache_holds_the_quantized_rotation(cache_dtype, case):
    """The cached k is PyTorch's fp8 cast of the rope kernel's k over the scale (that kernel is checked
    against float64 in tests/test_fused_elementwise.py; both round each product once, so the bf16 values
    the cast sees are the same), v likewise; q equals the rope kernel's."""
    dtype = torch.bfloat16
    rotary, cos, sin, qk, hq, v, slots, cache, ks, vs = _setup(case, dtype, cache_dtype, seed=20 + case)
    rd = rotary.rotary_dim
    q, k = qk[:, :hq], qk[:, hq:]
    qo = rope_and_write_kv(q, k, v, cos, sin, rd, cache, slots, ks, vs)
    rq, rk = rope_qk(q, k, cos, sin, rd)
    assert torch.equal(qo, rq)
    keep = slots >= 0
    rows = _slot_rows(cache, slots[keep])
    fmax = FP8_MAX[cache_dtype]
    exp_k = (rk[keep].float() / ks[None, :, None]).clamp(-fmax, fmax).to(cache_dtype)
    exp_v = (v[keep].float() / vs[None, :, None]).clamp(-fmax, fmax).to(cache_dtype)
    assert torch.equal(rows[:, 0].view(torch.uint8), exp_k.view(torch.uint8))
    assert torch.equal(rows[:, 1].view(torch.uint8), exp_v.view(torch.uint8))
    # And against float64: one fp8 rounding (half an ulp: 2^-4 relative for e4m3, 2^-3 for e5m2, or half the
    # smallest subnormal) on top of the bf16 rotation's bound.
    ref, bound = _bound(k[keep], cos[keep], sin[keep], rd, dtype)
    rel, sub = (2.0**-4, 2.0**-10) if cache_dtype == torch.float8_e4m3fn else (2.0**-3, 2.0**-17)
    scale = ks[None, :, None].double()
    err_bound = (rel * ref.abs() + sub * scale) * (1 + 2.0**-7) + bound
    _within(rows[:, 0].double() * scale, ref, err_bound, "dequantized k vs float64")


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
def test_saturation_nan_and_skipped_slots(cache_dtype):
    """Finite overflow and +-inf saturate to +-fmax, NaN is stored as 0 (fp8 caches); -1 slots stay
    untouched. Values chosen so every cast is exact (the interpreter runs this test too)."""
    if cache_dtype == torch.bfloat16 and INTERPRETED:
        pytest.skip(BF16_ROUNDING)
    hq, hkv, d = 2, 1, 16
    dtype = torch.bfloat16 if not INTERPRETED else torch.float16
    cos = torch.ones(3, 1, d, dtype=dtype, device=DEV)  # angle 0: rope leaves every value as it is
    sin = torch.zeros(3, 1, d, dtype=dtype, device=DEV)
    qk = torch.ones(3, hq + hkv, d, dtype=dtype, device=DEV)
    v = torch.ones(3, hkv, d, dtype=dtype, device=DEV)
    qk[0, hq:, :4] = 1e4  # over e4m3's 448 after the 0.5 scale
    qk[0, hq:, 4:8] = -1e4
    v[0, :, :4] = float("nan")
    v[0, :, 4:8] = float("-inf")
    slots = torch.tensor([5, -1, 20], device=DEV)
    cache = torch.full((2, 2, hkv, BLOCK, d), 3.0, device=DEV).to(cache_dtype)
    before = cache.clone()
    scale = torch.full((hkv,), 0.5, device=DEV)
    qo = rope_and_write_kv(qk[:, :hq], qk[:, hq:], v, cos, sin, d, cache, slots, scale, scale)
    assert torch.equal(qo, qk[:, :hq])  # q of the skipped token too
    rows = _slot_rows(cache, torch.tensor([5, 20], device=DEV)).float()
    if cache_dtype == torch.float8_e4m3fn:
        assert (rows[0, 0, 0, :4] == 448).all() and (rows[0, 0, 0, 4:8] == -448).all()
        assert (rows[0, 1, 0, :4] == 0).all() and (rows[0, 1, 0, 4:8] == -448).all()
        assert (rows[0, 0, 0, 8:] == 2).all() and (rows[1] == 2).all()  # 1 / 0.5
    else:
        assert torch.isnan(rows[0, 1, 0, :4]).all() and (rows[0, 1, 0, 4:8] == float("-inf")).all()
    untouched = [s for s in range(2 * BLOCK) if s not in (5, 20)]
    flat, flat_before = (c.permute(0, 3, 1, 2, 4).reshape(2 * BLOCK, -1) for c in (cache, before))
    assert torch.equal(flat[untouched].view(torch.uint8), flat_before[untouched].view(torch.uint8))


def test_bad_shapes_are_refused():
    x = torch.zeros(3, 4, 16, device=DEV)
    cos = torch.zeros(3, 1, 16, device=DEV)
    cache = torch.zeros(2, 2, 2, 16, 16, device=DEV)
    slots = torch.zeros(3, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="does not hold"):
        rope_and_write_kv(x, x[:, :3], x[:, :3], cos, cos, 16, cache, slots, None, None)
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_and_write_kv(x, x[:, :2], x[:, :2], cos, cos, 15, cache, slots, None, None)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_and_write_kv(x, x[:, :2], x[:, :2], cos[:2], cos[:2], 16, cache, slots, None, None)
    with pytest.raises(ValueError, match="fp8 kv cache needs"):
        rope_and_write_kv(x, x[:, :2], x[:, :2], cos, cos, 16, cache.to(torch.float8_e4m3fn), slots, None, None)


@pytest.mark.skipif(not INTERPRETED, reason="the CUDA engine takes this path by default (tests/test_engine_gpu.py)")
@pytest.mark.parametrize("case", ["llama3", "qwen2"])
def test_engine_with_rope_in_the_cache_write_matches_transformers(tmp_path, monkeypatch, case):
    """A tiny Llama (and Qwen2, with q/k/v bias) on CPU whose attention backend rotates k into the cache
    with this kernel (interpreted) through the runner's ``rope_attend`` path: prompt logits and greedy
    tokens against transformers, as tests/test_engine_vs_hf.py checks the plain path."""
    pytest.importorskip("transformers")
    from greedy_agreement import assert_greedy_agrees, top2_margins
    from test_engine_vs_hf import _save_hf, engine_with_matching_prompt_logits

    from kvforge import SamplingParams
    from kvforge.attention.backends.torch_reference import TorchReferenceBackend
    from kvforge.models import layers

    calls = []

    def rope_and_write_cache(self, kv, slot_mapping, q, k, v, cos, sin, rotary_dim):
        calls.append(q.shape[0])
        return rope_and_write_kv(q, k, v, cos, sin, rotary_dim, kv.cache, slot_mapping, kv.k_scale, kv.v_scale)

    monkeypatch.setattr(layers, "FUSED_DEVICES", ("cpu",))
    monkeypatch.setattr(layers, "FUSED_KERNELS", True)
    monkeypatch.setattr(TorchReferenceBackend, "fuses_rope_with_cache_write", True, raising=False)
    monkeypatch.setattr(TorchReferenceBackend, "rope_and_write_cache", rope_and_write_cache)
    hf = _save_hf(tmp_path, case)
    g = torch.Generator().manual_seed(1)
    llm, prompt, tol = engine_with_matching_prompt_logits(tmp_path, hf, g)
    assert calls, "the runner did not take the fused path"
    prompts = [prompt[:7], torch.randint(0, 256, (30,), generator=g).tolist()]
    calls.clear()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(calls) >= 2 * 6, "decode steps did not take the fused path"
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            run = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                              eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        assert_greedy_agrees(out.outputs[0].token_ids, run.sequences[0, len(p):].tolist(),
                             top2_margins(torch.cat(run.logits)), tol, what=f"{case} prompt of {len(p)}")

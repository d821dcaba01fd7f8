"""The Triton MLA backend: its declaration is the contract, walked on the GPU.

Every combination a CUDA MLA backend declares (KV dtype x query dtype x heads
per rank x batch size) runs through the backend's own ``mla_decode`` and is
compared with the PyTorch reference over the dequantized latent cache in
float32 (a float32 copy of the same query). Bounds, relative to max|ref|:

* model-dtype query: 2**-6. The kernel's only roundings are P to 16 bits
  for the P.C dot (relative 2**-9 bf16 / 2**-11 fp16, fp8 -> fp16 is exact)
  and the bf16/fp16 output (2**-9); float32 caches use IEEE dots. Observed
  errors are listed in docs/MLA.md.
* fp8 query (where declared): 2**-4. Each query row is rounded to e4m3
  (relative 2**-4 per element), which perturbs every score by about
  2**-4 x |q||c| / sqrt(R) before the softmax.

Undeclared combinations must be refused by the kernel, and the planner never
routes them (tests/test_plan_query_dtype.py). GPU tests skip without CUDA; the
combination walk itself and the refusals also run on CPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kvforge.attention import mla_reference as ref
from kvforge.attention.metadata import AttentionMetadata
from kvforge.planner.registry import builtin_backends

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HEADS = (1, 8, 16, 32, 64, 128)
BATCHES = (1, 33)
R, P = 512, 64
TORCH_KV = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
            "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
MODEL_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
               "fp8_e4m3": torch.bfloat16, "fp8_e5m2": torch.bfloat16}
BOUND = {None: 2.0 ** -6, "fp8_e4m3": 2.0 ** -4}


#: The decode entry of each CUDA MLA backend (what its backend object calls for decode steps).
KERNEL_ENTRY = {"triton_mla": "kvforge.kernels.triton_mla_decode", "torch_mla_reference": "kvforge.attention.mla_reference"}


def cuda_mla_backends():
    return [d for d in builtin_backends() if "mla" in d.layer_kinds and "cuda" in d.platforms]


MODEL_DTYPES = ("bfloat16", "float16", "float32")
TORCH_MODEL = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def declared_combinations(decl):
    """(model dtype, kv dtype, query dtype or None, heads per rank, batch) for every combination ``decl``
    accepts. The natural pairs (the cache in the model dtype, fp8 caches under bf16) walk every head
    count and batch; the other model-dtype x KV-dtype pairs walk 1, 16 and 128 heads at batch 33."""
    for kv in sorted(decl.kv_dtypes):
        for model in MODEL_DTYPES:
            natural = MODEL_DTYPE[kv] == TORCH_MODEL[model]
            for heads in HEADS if natural else (1, 16, 128):
                for batch in BATCHES if natural else (33,):
                    yield model, kv, None, heads, batch
                    if decl.quantized_query.accepts(kv, heads, model, R + P):
                        yield model, kv, kv, heads, batch


def _batch(batch, kv, heads, device, block_size=16, seed=0, model=None):
    """Random paged latent cache (NaN in unused rows), lengths covering 1, 15-17, 1000 and 3000."""
    g = torch.Generator().manual_seed(seed)
    fixed = [1, 15, 16, 17, 1000, 3000]
    lens = (fixed + torch.randint(1, 400, (batch,), generator=g).tolist())[:batch] if batch > 1 else [1000]
    per = [-(-n // block_size) for n in lens]
    nblocks = sum(per) + 5
    perm = torch.randperm(nblocks, generator=g)
    tables = torch.zeros(batch, max(per), dtype=torch.int32)
    slots, at = [], 0
    for i, n in enumerate(lens):
        ids = perm[at:at + per[i]]
        at += per[i]
        tables[i, :per[i]] = ids.to(torch.int32)
        pos = torch.arange(n)
        slots.append(ids[pos // block_size] * block_size + pos % block_size)
    slots = torch.cat(slots)
    cache = torch.full((nblocks, block_size, R + P), float("nan"), device=device).to(TORCH_KV[kv])
    scale = torch.tensor([0.02 if kv.startswith("fp8") else 1.0], device=device)
    latent = torch.randn(slots.numel(), R, generator=g) * 0.5
    k_rope = torch.randn(slots.numel(), P, generator=g) * 2.0
    ref.write_mla_cache(latent.to(device), k_rope.to(device), cache, slots.to(device), scale)
    meta = AttentionMetadata(torch.arange(batch + 1, dtype=torch.int32, device=device),
                             torch.tensor(lens, dtype=torch.int32, device=device), tables.to(device),
                             torch.full((batch,), -1, dtype=torch.int64, device=device), 1, max(lens), block_size)
    dt = TORCH_MODEL[model] if model else MODEL_DTYPE[kv]
    q_latent = (torch.randn(batch, heads, R, generator=g) * 0.2).to(dt).to(device)
    q_rope = (torch.randn(batch, heads, P, generator=g) * 0.2).to(dt).to(device)
    return cache, meta, q_latent, q_rope, scale


def test_walk_covers_both_regimes_where_declared():
    for decl in cuda_mla_backends():
        combos = list(declared_combinations(decl))
        assert {c[1] for c in combos} == set(decl.kv_dtypes)
        for model, kv, qd, heads, _ in combos:
            if qd is not None:
                assert decl.quantized_query.accepts(kv, heads, model, R + P) and model != "float32"
    assert cuda_mla_backends(), "no CUDA MLA backend declared"
    # triton_mla declares the e4m3 query at 1-16 heads: the walk must reach it at every such head count it has
    walked = {(kv, heads) for d in cuda_mla_backends() for _, kv, qd, heads, _ in declared_combinations(d) if qd}
    assert walked == {("fp8_e4m3", h) for h in HEADS if h <= 16}, walked


@pytest.mark.parametrize("kv,model,message", [("bfloat16", None, "needs an fp8_e4m3 cache"),
                                               ("fp8_e5m2", None, "needs an fp8_e4m3 cache"),
                                               ("float32", None, "needs an fp8_e4m3 cache"),
                                               ("fp8_e4m3", "float32", "16-bit models")])
def test_kernel_refuses_an_undeclared_fp8_query(kv, model, message):
    """No declaration routes an fp8 query to a non-e4m3 cache or a float32 model; the kernel refuses both
    before launching."""
    from kvforge.kernels.triton_mla_decode import mla_decode

    cache, meta, q_latent, q_rope, scale = _batch(2, kv, 16, "cpu", model=model)
    with pytest.raises(ValueError, match=message):
        mla_decode(q_latent, q_rope, cache, meta, scale, 0.1, query_dtype="fp8_e4m3")
    for decl in cuda_mla_backends():
        for heads in (1, 8, 16, 128):
            assert not decl.quantized_query.accepts(kv, heads, model or "bfloat16", R + P)


def test_reference_refuses_a_quantized_query():
    cache, meta, q_latent, q_rope, scale = _batch(2, "fp8_e4m3", 16, "cpu")
    w = torch.zeros(16, 8, R)
    with pytest.raises(ValueError, match="not declared"):
        ref.mla_attention(q_latent[:, :, :8], q_rope, cache, meta, scale, 0.1, w, w, query_dtype="fp8_e4m3")


@pytest.fixture(params=["gluon_routed", "tl.dot"])
def mla_kernel(request, monkeypatch):
    """Run a GPU test as routed (the Gluon kernels where the routing table sends the call, on sm_90) and
    again with routing off, so the tl.dot kernel, which serves whenever the Gluon gate is closed, keeps
    its H200 coverage."""
    if request.param == "tl.dot":
        import dataclasses

        from kvforge.attention.routing import mla as mla_routing

        monkeypatch.setattr(mla_routing, "WGMMA", dataclasses.replace(mla_routing.WGMMA, max_heads=0))
    return request.param


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("decl", cuda_mla_backends(), ids=lambda d: d.name)
def test_every_declared_combination_matches_fp32_reference(decl, mla_kernel):
    impl = importlib.import_module(KERNEL_ENTRY[decl.name])
    worst = {}
    for model, kv, qd, heads, batch in declared_combinations(decl):
        cache, meta, q_latent, q_rope, scale = _batch(batch, kv, heads, "cuda", seed=heads + batch, model=model)
        out = torch.full_like(q_latent, float("nan"))  # poisoned: every row must be written
        try:
            impl.mla_decode(q_latent, q_rope, cache, meta, scale, 192 ** -0.5, query_dtype=qd, out=out)
        except Exception as e:  # name the combination that failed to launch
            raise AssertionError(f"(model, kv, query, heads, batch) = {(model, kv, qd, heads, batch)}: {e}") from e
        want = ref.mla_decode(q_latent.float(), q_rope.float(), cache, meta, scale, 192 ** -0.5)
        assert torch.isfinite(out).all(), (model, kv, qd, heads, batch)
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        worst[(model, kv, qd)] = max(worst.get((model, kv, qd), 0.0), err)
        assert err <= BOUND[qd], (model, kv, qd, heads, batch, err)
    print("\nworst relative error per (model dtype, kv dtype, query dtype):",
          {f"{k[0]}/{k[1]}/{k[2] or 'model'}": f"{v:.2e}" for k, v in sorted(worst.items(), key=str)})


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_split_k_and_block_sizes(kv, mla_kernel):
    """Forced split counts (1 .. 32) and block sizes 1, 16, 64 give the same answer as the reference."""
    from kvforge.kernels.triton_mla_decode import mla_decode

    for bs in (1, 16, 64):
        cache, meta, q_latent, q_rope, scale = _batch(6, kv, 16, "cuda", block_size=bs, seed=bs)
        want = ref.mla_decode(q_latent.float(), q_rope.float(), cache, meta, scale, 0.1)
        for splits in (1, 2, 7, 32):
            got = mla_decode(q_latent, q_rope, cache, meta, scale, 0.1, num_splits=splits)
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            assert err <= 2.0 ** -6, (bs, splits, err)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bfloat16", "float32", "fp8_e4m3", "fp8_e5m2"])
def test_triton_cache_write_equals_reference_bits(kv):
    from kvforge.kernels.triton_mla_cache_write import write_mla_cache

    g = torch.Generator().manual_seed(3)
    n = 300
    latent = torch.randn(n, R, generator=g) * 30
    k_rope = torch.randn(n, P, generator=g)
    latent[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6])
    slots = torch.randperm(64 * 16, generator=g)[:n]
    slots[::7] = -1
    scale = torch.tensor([0.05], device="cuda")
    a = torch.zeros(64, 16, R + P, dtype=TORCH_KV[kv], device="cuda")
    b = torch.zeros_like(a)
    latent_c, rope_c = latent.to(MODEL_DTYPE[kv]).cuda(), k_rope.to(MODEL_DTYPE[kv]).cuda()
    if kv.startswith("fp8") or kv == "float32":
        latent_c, rope_c = latent.cuda(), k_rope.cuda()
    if not kv.startswith("fp8"):
        latent_c[0, :4] = 0  # non-fp8 caches store NaN/inf as they are; keep the comparison NaN-free
    ref.write_mla_cache(latent_c, rope_c, a, slots.cuda(), scale)
    write_mla_cache(latent_c, rope_c, b, slots.cuda(), scale)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- the engine on GPU with tiny DeepSeek models ---------------------------------------------------------------
def _deepseek(tmp_path, dtype=torch.float32, dense=False):
    """Tiny random DeepSeek-V3 (test_deepseek_mla's "v3_sigmoid_bias" case); ``dense``: no MoE layers, so
    decode steps can be CUDA graphs on any torch (MoE layers need a working torch._grouped_mm)."""
    import test_deepseek_mla as t

    dense_layers = {"first_k_dense_replace": t.BASE["num_hidden_layers"]} if dense else {}
    t._save_hf(tmp_path, "v3_sigmoid_bias", dtype=dtype, **dense_layers)
    return str(tmp_path)


def _llm(path, device, **kw):
    from kvforge import LLM

    kw.setdefault("dtype", "float32")
    return LLM(path, block_size=16, skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False,
               device=device, max_num_seqs=8, **kw)


def _greedy(llm, n=12):
    from kvforge import SamplingParams

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (k,), generator=g).tolist() for k in (5, 11, 17, 40, 90)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cudagraph"])
@pytest.mark.parametrize("prefill", ["expanded", "absorbed", "auto", "sdpa"])
def test_gpu_deepseek_fp32_triton_equals_cpu_reference(tmp_path, monkeypatch, eager, prefill):
    """float32 weights and latent cache: the Triton MLA path (IEEE fp32 dots) gives the CPU reference's greedy
    tokens, with prefill steps expanded (the reference or, "sdpa", torch's fused attention), absorbed, or chosen
    by length (the engine argument ``mla_prefill_mode``)."""
    path = _deepseek(tmp_path, dense=not eager)
    cpu = _greedy(_llm(path, "cpu"))
    gpu = _llm(path, "cuda", enforce_eager=eager, mla_prefill_mode=prefill)
    assert {layer.backend for layer in gpu.plan.layers} == {"triton_mla"}
    assert _greedy(gpu) == cpu
    if not eager:
        assert gpu.engine.stats()["graph_steps"] >= 10


@needs_cuda
@pytest.mark.gpu
def test_gpu_moe_deepseek_fp32_graphs_capture_or_are_refused_up_front(tmp_path):
    """MoE layers in float32 on CUDA: decode steps are captured when torch._grouped_mm passes its probe
    (which includes a capture), else refused with the probe's reason; never a failed capture. Greedy
    tokens equal the CPU reference either way."""
    path = _deepseek(tmp_path)
    cpu = _greedy(_llm(path, "cpu"))
    gpu = _llm(path, "cuda")
    reason = gpu.engine.rank_counters()[0]["graphs_off_reason"] or ""
    assert "capture failed" not in reason, reason
    assert _greedy(gpu) == cpu


def test_failed_capture_reason_names_the_innermost_kvforge_line():
    """A failed CUDA-graph capture's reason ends with where the forbidden operation ran: the deepest kvforge
    frame of the first exception in the chain (a capture that an op invalidated raises again on exit, from
    the ``with`` line), with that first message; empty outside the package."""
    from kvforge.attention.triton_mla import per_token_metadata
    from kvforge.engine.model_runner import _failure_origin

    with pytest.raises(AttributeError) as info:
        per_token_metadata(None, 1)
    where = _failure_origin(info.value)
    assert where.startswith(" at kvforge/attention/triton_mla.py:") and where.endswith("(per_token_metadata)")

    class FakeCapture:  # like torch.cuda.graph: __exit__ raises again when the capture was invalidated
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            raise RuntimeError("operation failed due to a previous error during capture")

    with pytest.raises(RuntimeError) as info:
        with FakeCapture():
            per_token_metadata(None, 1)
    where = _failure_origin(info.value)
    assert " at kvforge/attention/triton_mla.py:" in where and "(per_token_metadata); first error AttributeError" in where
    try:
        raise RuntimeError("outside the package")
    except RuntimeError as e:
        assert _failure_origin(e) == ""


def test_moe_deepseek_refuses_cuda_graphs_with_a_reason(tmp_path):
    from kvforge.engine.cuda_graphs import graphs_unsupported_reason
    from kvforge.models.deepseek import DeepseekV2ForCausalLM

    class FakeRunner:  # only what graphs_unsupported_reason reads
        device = torch.device("cuda")
        backends = [type("Backend", (), {"name": "triton_mla", "captures_cuda_graphs": True})()]
        pool = type("Pool", (), {"ring_pages": 0})()
        plan = type("Plan", (), {"layers": [type("Layer", (), {"kind": "mla"})()]})()
        linear_states = None

    import test_deepseek_mla as t

    cfg = {**t.BASE, **t.CASES["v3_sigmoid_bias"][2], "architectures": ["DeepseekV3ForCausalLM"],
           "model_type": "deepseek_v3"}
    runner = FakeRunner()
    runner.model = DeepseekV2ForCausalLM(cfg)
    assert "MoE" in graphs_unsupported_reason(runner)
    runner.model = DeepseekV2ForCausalLM({**cfg, "first_k_dense_replace": cfg["num_hidden_layers"]})
    assert graphs_unsupported_reason(runner) is None


@needs_cuda
@pytest.mark.gpu
def test_gpu_deepseek_fp8_vs_bf16_latent_agreement(tmp_path):
    """bf16 model, fp8 e4m3 vs bf16 latent cache on the Triton path: teacher-forced top-1 agreement (printed;
    asserted >= 0.85 as on CPU, where it is 0.90) and greedy position match (printed)."""
    path = _deepseek(tmp_path, torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    text = torch.randint(0, 256, (120,), generator=g).tolist()
    runs, logits = {}, {}
    for kv in ("auto", "fp8"):
        llm = _llm(path, "cuda", dtype="bfloat16", kv_cache_dtype=kv)
        runs[kv] = _greedy(llm, 16)
        logits[kv] = llm.engine.compute_prompt_logits(text)
    same = sum(a == b for x, y in zip(runs["auto"], runs["fp8"]) for a, b in zip(x, y))
    total = sum(map(len, runs["auto"]))
    top1 = (logits["auto"].argmax(-1) == logits["fp8"].argmax(-1)).float().mean().item()
    print(f"\nGPU fp8 vs bf16 latent cache: teacher-forced top-1 {top1:.3f}; greedy {same}/{total} positions equal")
    assert top1 >= 0.85


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_gpu_deepseek_at_mla_widths_runs_the_wgmma_kernel(tmp_path, monkeypatch, kv):
    """The engine tests above use latent 32, which the wgmma kernel does not take. This tiny DeepSeek has
    DeepSeek's MLA widths (latent 512, rope 64, 16 heads; three dense layers, hidden 64) in bf16, so
    absorbed prefill and decode steps reach the wgmma kernel (counted; eager, so every call is seen). Its teacher-forced
    logits are checked against the float32 CPU engine on the same weights: top-1 agreement >= 0.9 with a
    bf16 cache, >= 0.8 with fp8, whose per-tensor scale is 1.0 here. Values and greedy tokens are printed."""
    import test_deepseek_mla as t

    from kvforge.kernels import gluon_mla_decode as gm
    from kvforge.kernels.gluon_support import gluon_runs_on

    if not gluon_runs_on(torch.empty(1, device="cuda")):
        pytest.skip("the Gluon gate is closed on this device / Triton")
    t._save_hf(tmp_path, "v3_sigmoid_bias", dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64,
               qk_nope_head_dim=32, v_head_dim=32, num_attention_heads=16,
               first_k_dense_replace=t.BASE["num_hidden_layers"])  # fmt: skip
    calls = []
    real = gm.mla_decode_wgmma
    monkeypatch.setattr(gm, "mla_decode_wgmma", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(11)
    text = torch.randint(0, 256, (120,), generator=g).tolist()
    want = _llm(str(tmp_path), "cpu").engine.compute_prompt_logits(text).float()
    gpu = _llm(str(tmp_path), "cuda", dtype="bfloat16", kv_cache_dtype=kv, enforce_eager=True)
    got = gpu.engine.compute_prompt_logits(text).float().cpu()
    prefill_calls = len(calls)
    tokens = _greedy(gpu, 8)
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    rel = ((got - want).abs().max() / want.abs().max()).item()
    print(f"\nMLA widths, {kv} cache: wgmma calls {prefill_calls} prefill + {len(calls) - prefill_calls} more; "
          f"top-1 {top1:.3f}, max |logit diff| {rel:.3e} of max; greedy {tokens[0]}")
    assert prefill_calls > 0 and len(calls) > prefill_calls
    assert top1 >= (0.9 if kv == "auto" else 0.8)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("heads", [8, 16, 128])
def test_fp8_query_regime_numerics_whether_declared_or_not(heads):
    """The fp8-query regime's accuracy is measured at every head count the benchmark covers, declared or not,
    so the declaration can rest on a measurement (bound 2**-4 of max|ref|, see the module docstring)."""
    from kvforge.kernels.triton_mla_decode import mla_decode

    for batch in BATCHES:
        cache, meta, q_latent, q_rope, scale = _batch(batch, "fp8_e4m3", heads, "cuda", seed=heads * batch)
        got = mla_decode(q_latent, q_rope, cache, meta, scale, 192 ** -0.5, query_dtype="fp8_e4m3")
        want = ref.mla_decode(q_latent.float(), q_rope.float(), cache, meta, scale, 192 ** -0.5)
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        print(f"\nfp8 query, {heads} heads, batch {batch}: relative error {err:.2e}")
        assert err <= BOUND["fp8_e4m3"], err

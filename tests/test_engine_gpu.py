"""The engine on CUDA (Triton backend, decode CUDA graphs) against the CPU engine.

GPU tests skip without CUDA. Without a GPU this file still checks that the
Triton backend's declaration matches the kernel's own constants, that a CUDA
plan routes every layer to ``triton_paged``, and that the CUDA-graph input path
(static, padded buffers; padding rows with slot -1 / seq_len 1) gives the
greedy tokens of eager on CPU (``DecodeGraphs(capture=False)`` runs the same
static inputs without capturing).

Padding, graphs, another device and another kernel change the summation order, so greedy tokens
are compared by the near-tie rule of tests/greedy_agreement.py: identical until a position where
the reference's top-2 logit margin is below the stated tolerance.

Tiny random Llama: hidden 128, 4 heads / 2 KV heads (head dim 32, the
kernel's smallest), 2 layers, vocab 256, max_position_embeddings 2048 (so the
graphs' pinned split-K factor is 8 for small batches and the split path runs).
"""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import FP32_LOGIT_TOL, assert_outputs_agree

transformers = pytest.importorskip("transformers")

from kvforge import LLM, SamplingParams  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CFG = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=256, vocab_size=256, max_position_embeddings=2048, rms_norm_eps=1e-5)
PROMPT_LENS = (5, 17, 40, 130, 300)  # 5 sequences: the graph batch pads to 8


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _llm(path, device, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_dtype", "auto")
    return LLM(path, block_size=16, skip_tokenizer_init=True, kv_cache_memory=1 << 24, progress=False,
               device=device, max_num_seqs=16, **kw)


def _greedy(llm, prompts, n=24):
    """Request outputs with the top-2 logprobs the near-tie rule reads."""
    return llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2), use_tqdm=False)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


# ---- no GPU needed -------------------------------------------------------------------------------------------
def test_triton_declaration_matches_kernel_constants():
    from kvforge.attention.triton_backend import TRITON_PAGED
    from kvforge.kernels import triton_paged_attention as k
    from kvforge.kv_dtypes import canonical_kv_dtype

    assert TRITON_PAGED.head_sizes == frozenset(k.SUPPORTED_HEAD_SIZES)
    assert TRITON_PAGED.kv_dtypes == frozenset(canonical_kv_dtype(d) for d in k.SUPPORTED_KV_DTYPES)
    assert TRITON_PAGED.block_sizes.multiple_of == k.BLOCK_SIZE_MULTIPLE
    assert not TRITON_PAGED.quantized_query.kv_dtypes and not k.ACCEPTS_QUANTIZED_QUERY


@pytest.mark.parametrize("kv", ["auto", "fp8", "fp32"])
def test_cuda_plan_picks_triton(kv):
    import kvforge

    plan = kvforge.plan("llama-3.1-8b", kv_cache_dtype=kv, device="cuda", gpu_memory=141 * 10**9)
    assert {layer.backend for layer in plan.layers} == {"triton_paged"}
    assert plan.block_size == 16


def test_static_padded_decode_path_matches_eager_cpu(tiny_llama):
    from kvforge.engine.cuda_graphs import DecodeGraphs

    prompts = _prompts()
    eager = _greedy(_llm(tiny_llama, "cpu"), prompts)
    llm = _llm(tiny_llama, "cpu")
    llm.engine.runner.graphs = DecodeGraphs(llm.engine.runner, max_num_seqs=16, capture=False)
    assert_outputs_agree(_greedy(llm, prompts), eager, FP32_LOGIT_TOL)
    stats = llm.engine.stats()
    assert stats["graph_steps"] >= 20 and stats["eager_steps"] >= 1


# ---- GPU -----------------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cudagraph"])
def test_gpu_fp32_matches_cpu_greedy(tiny_llama, eager):
    """fp32 weights, fp32 KV: the Triton kernel runs IEEE fp32 dots (relative error ~1e-6 vs float64, see
    docs/KERNELS.md), so greedy tokens follow the CPU reference engine's (near-tie rule, FP32_LOGIT_TOL)."""
    prompts = _prompts()
    cpu = _greedy(_llm(tiny_llama, "cpu"), prompts)
    gpu_llm = _llm(tiny_llama, "cuda", enforce_eager=eager)
    assert {layer.backend for layer in gpu_llm.plan.layers} == {"triton_paged"}
    assert gpu_llm.plan.kv_cache_dtype == "float32"
    assert (gpu_llm.engine.runner.graphs is None) == eager
    assert_outputs_agree(_greedy(gpu_llm, prompts), cpu, FP32_LOGIT_TOL)
    if not eager:
        assert gpu_llm.engine.stats()["graph_steps"] >= 20


@needs_cuda
def test_gpu_rope_runs_inside_the_cache_write(tiny_llama, monkeypatch):
    """On the Triton backend the Llama family rotates q and k in the cache-write kernel
    (kvforge/kernels/triton_rope_cache_write.py): every eager step calls it once a layer and the separate
    rope kernel never runs; greedy tokens follow the CPU engine's (near-tie rule, FP32_LOGIT_TOL)."""
    from kvforge.attention.backends import triton_paged
    from kvforge.kernels import triton_rope

    calls = []
    fused = triton_paged.rope_and_write_kv
    monkeypatch.setattr(triton_paged, "rope_and_write_kv", lambda *a: calls.append(a[0].shape[0]) or fused(*a))
    monkeypatch.setattr(triton_rope, "rope_qk", lambda *a: pytest.fail("the separate rope kernel ran"))
    prompts = _prompts()
    cpu = _greedy(_llm(tiny_llama, "cpu"), prompts)
    gpu_llm = _llm(tiny_llama, "cuda", enforce_eager=True, warm_up=False)
    got = _greedy(gpu_llm, prompts)
    steps = gpu_llm.engine.stats()["eager_steps"]
    assert len(calls) == CFG["num_hidden_layers"] * steps
    assert_outputs_agree(got, cpu, FP32_LOGIT_TOL)


@needs_cuda
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cudagraph"])
def test_gpu_async_scheduling_matches_cpu_greedy(tiny_llama, eager):
    """--async-scheduling on the GPU (in-flight tokens gathered on the device, also into the graph's static
    input buffer): fp32 greedy tokens follow the synchronous CPU engine's (near-tie rule); every block is
    freed at the end."""
    prompts = _prompts()
    cpu = _greedy(_llm(tiny_llama, "cpu"), prompts)
    llm = _llm(tiny_llama, "cuda", enforce_eager=eager, async_scheduling=True)
    assert_outputs_agree(_greedy(llm, prompts), cpu, FP32_LOGIT_TOL)
    stats = llm.engine.stats()
    assert stats["kv_blocks_used"] == 0
    if not eager:
        assert stats["graph_steps"] >= 20


@needs_cuda
@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8")])
def test_gpu_cudagraph_matches_eager(tiny_llama, dtype, kv):
    """Graph replay vs eager on the GPU. The graph pads the batch (GEMM shapes change) and pins split-K
    (8 splits here vs the eager heuristic's 1: another merge order), so logits may differ in the last bits
    of their dtype and a near-tie may flip: near-tie rule, with FP32_LOGIT_TOL for float32 and, for
    bfloat16, 8 bf16 steps at the largest |logit| (2^-5 of it; 4x that with an fp8 KV cache, whose
    rounding the merge order also moves). The greedy position match is printed."""
    prompts = _prompts()
    eager_llm = _llm(tiny_llama, "cuda", dtype=dtype, kv_cache_dtype=kv, enforce_eager=True)
    eager = _greedy(eager_llm, prompts)
    graph_llm = _llm(tiny_llama, "cuda", dtype=dtype, kv_cache_dtype=kv)
    graph = _greedy(graph_llm, prompts)
    assert graph_llm.engine.stats()["graph_steps"] >= 20
    same = sum(a == b for x, y in zip(_tokens(eager), _tokens(graph)) for a, b in zip(x, y))
    same /= sum(map(len, _tokens(eager)))
    print(f"\ncudagraph vs eager ({dtype}, kv {kv}): greedy position match {same:.3f}")
    if dtype == "float32":
        tol = FP32_LOGIT_TOL
    else:
        scale = max(1.0, eager_llm.engine.compute_prompt_logits(prompts[-1]).abs().max().item())
        tol = scale * 2.0**-5 * (4 if kv == "fp8" else 1)
    assert_outputs_agree(graph, eager, tol)


@needs_cuda
def test_gpu_named_graph_sizes_capture_and_follow_cpu(tiny_llama):
    """``cuda_graph_sizes=[6, 3]``: only batches of 3 and 6 are captured; five sequences replay the size-6
    graph (one padding row) until two finish, then the size-3 graph. fp32 greedy tokens follow the CPU
    reference engine's (near-tie rule, FP32_LOGIT_TOL)."""
    prompts = _prompts()
    lens = [20, 20, 20, 8, 8]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in lens]
    requests = [{"prompt_token_ids": p} for p in prompts]
    cpu = _llm(tiny_llama, "cpu").generate(requests, params, use_tqdm=False)
    llm = _llm(tiny_llama, "cuda", cuda_graph_sizes=[6, 3])
    graphs = llm.engine.runner.graphs
    assert graphs.sizes == [3, 6] and {b for b, _, _ in graphs.graphs} == {3, 6}
    assert_outputs_agree(llm.generate(requests, params, use_tqdm=False), cpu, FP32_LOGIT_TOL)
    assert llm.engine.stats()["graph_steps"] >= 15


@needs_cuda
def test_gpu_fp8_vs_bf16_kv_agreement(tiny_llama):
    """bf16 model: fp8 e4m3 KV vs bf16 KV. Teacher-forced next-token top-1 agreement over the same text
    (the robust number) must be >= 0.85 (H200 2026-11-29: 0.980; the CPU reference engine: 0.96); greedy
    position match (diverges after the first flip on a near-uniform random model) is printed (H200: 0.562)."""
    prompts = _prompts()
    runs = {}
    for kv in ("bf16", "fp8"):
        llm = _llm(tiny_llama, "cuda", dtype="bfloat16", kv_cache_dtype=kv)
        runs[kv] = (_tokens(_greedy(llm, prompts, n=48)), llm.engine.compute_prompt_logits(prompts[-1]).argmax(-1))
    greedy = sum(a == b for x, y in zip(runs["bf16"][0], runs["fp8"][0]) for a, b in zip(x, y))
    greedy /= sum(map(len, runs["bf16"][0]))
    teacher = (runs["bf16"][1] == runs["fp8"][1]).float().mean().item()
    print(f"\nfp8 vs bf16 KV on GPU: teacher-forced top-1 agreement {teacher:.3f}, greedy position match {greedy:.3f}")
    assert teacher >= 0.85


@needs_cuda
def test_gpu_one_warp_fp8_decode_graphs_match_eager(tmp_path):
    """A batch large enough for the one-warp row of the fp8 decode table (16 sequences x 8 KV heads of size
    128 = 128 programs, >= 0.75 per SM on an H100/H200): graph replay (split count pinned at the 2048-token
    bucket) against eager (the rule's count at the real contexts), bf16 model, fp8 e4m3 KV, near-tie rule at
    4 x 2^-5 of the largest |logit| as for the small model above. Where the Gluon gate is open, the eager
    decode steps are asserted to have run the one-warp program."""
    from kvforge.attention.routing import paged as paged_routing
    from kvforge.kernels.gluon_support import gluon_runs_on
    from kvforge.kernels.triton_paged_attention import _LAST_LAUNCH

    cfg = dict(CFG, hidden_size=256, num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval().float()
    model.save_pretrained(tmp_path, safe_serialization=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = 16
    if batch * 8 < paged_routing.GLUON_FP8_WARP1.min_programs_per_sm * sms:
        pytest.skip(f"{sms} SMs: 16 x 8 programs are below the one-warp row's threshold")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (5 + 17 * i,), generator=g).tolist() for i in range(batch)]
    eager_llm = _llm(str(tmp_path), "cuda", dtype="bfloat16", kv_cache_dtype="fp8", enforce_eager=True)
    eager = _greedy(eager_llm, prompts)
    if gluon_runs_on(torch.empty(1, device="cuda")):
        launched = _LAST_LAUNCH["attn"]
        assert launched.name == "_gluon_fp8_decode_warp_kernel" and launched.metadata.num_warps == 1
    graph_llm = _llm(str(tmp_path), "cuda", dtype="bfloat16", kv_cache_dtype="fp8")
    graph = _greedy(graph_llm, prompts)
    assert graph_llm.engine.stats()["graph_steps"] >= 20
    scale = max(1.0, eager_llm.engine.compute_prompt_logits(prompts[-1]).abs().max().item())
    assert_outputs_agree(graph, eager, scale * 2.0**-5 * 4)


@needs_cuda
def test_gpu_chunks_before_the_last_compute_no_logits(tiny_llama):
    """A lone 300-token prompt in 64-token steps on CUDA: the chunks before its last compute no logits (an
    empty row list once meant every row), and the greedy tokens follow the CPU engine's."""
    prompt = _prompts()[-1]
    cpu = _greedy(_llm(tiny_llama, "cpu"), [prompt], n=4)
    llm = _llm(tiny_llama, "cuda", max_num_batched_tokens=64)
    model = llm.engine.runner.model
    compute, rows_seen = model.compute_logits, []

    def recording(hidden):
        rows_seen.append(hidden.shape[0])
        return compute(hidden)

    model.compute_logits = recording
    try:
        gpu = _greedy(llm, [prompt], n=4)
    finally:
        model.compute_logits = compute
    chunks = -(-len(prompt) // 64)
    assert rows_seen[:chunks] == [0] * (chunks - 1) + [1]
    assert_outputs_agree(gpu, cpu, FP32_LOGIT_TOL)

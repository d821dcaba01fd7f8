"""The planner's activation reserve against the live tensor bytes the real model modules reach on CPU.

Tiny random configs run a step of ``T`` tokens through the model's modules (the attention backend is
represented by the output it returns, which is all the Triton backends allocate besides their split-K
partials) and through the head and the sampler; the peak of live tensor bytes is measured by
tests/live_tensor_peak.py. The rule (platform "cpu": the unfused code the CPU runs) must be at least the
measured peak and at most 1.5x it: the rule counts every tensor of its peak phase as alive at once,
while the code frees some (a temporary of an expression) a moment before the next is allocated, and
bounds the router's and rope's temporaries by their largest case.
"""

from __future__ import annotations

import pytest
import torch
from live_tensor_peak import LiveTensorPeak

from kvforge.engine.sampler import Sampler
from kvforge.engine.sampling_params import SamplingParams
from kvforge.models.decoder import build_uninitialised
from kvforge.models.deepseek import DeepseekV3ForCausalLM
from kvforge.models.gemma3 import Gemma3ForCausalLM
from kvforge.models.gpt_oss import GptOssForCausalLM
from kvforge.models.llama import LlamaForCausalLM
from kvforge.models.qwen3_next import Qwen3NextForCausalLM
from kvforge.planner.activations import activation_reserve
from kvforge.spec.architectures import spec_from_hf_config

torch.set_num_threads(1)

LLAMA = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
             rms_norm_eps=1e-5, torch_dtype="float32")
QWEN3 = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32, "intermediate_size": 96}
# Two routed experts, both chosen by every token: the CPU expert loop runs each on all T rows, the
# largest load a routing can give.
DEEPSEEK = dict(architectures=["DeepseekV3ForCausalLM"], hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, moe_intermediate_size=48, n_routed_experts=2,
                n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
                kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5, torch_dtype="float32")

# Many wide heads, small MLPs: the MLA attention phase is the peak.
DEEPSEEK_MLA = {**DEEPSEEK, "num_attention_heads": 8, "qk_nope_head_dim": 32, "v_head_dim": 32, "kv_lora_rank": 64,
                "intermediate_size": 64, "moe_intermediate_size": 16}
# gpt-oss: sliding and full layers with sinks, clamped-SwiGLU experts (two, both chosen by every token).
GPT_OSS = dict(architectures=["GptOssForCausalLM"], hidden_size=64, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
               num_experts_per_tok=2, sliding_window=32, vocab_size=512, max_position_embeddings=1024,
               rms_norm_eps=1e-5, torch_dtype="float32")
# Qwen3-Next: three Gated DeltaNet layers and one gated attention layer, MoE with a shared expert.
QWEN3_NEXT = dict(architectures=["Qwen3NextForCausalLM"], hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2,
                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5, torch_dtype="float32")

QWEN3_NEXT_MOE = {**QWEN3_NEXT, "moe_intermediate_size": 256}
QWEN3_NEXT_FULL = {**QWEN3_NEXT, "layer_types": ["full_attention"] * 4, "num_attention_heads": 8, "head_dim": 32}

# Gemma 3: sandwich norms in float32 on every device, a GELU MLP (never the fused SiLU kernel), two rope tables.
GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], hidden_size=64, intermediate_size=176, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32, query_pre_attn_scalar=16,
              vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-6, torch_dtype="float32",
              layer_types=["sliding_attention", "full_attention"])


class OutputOnlyAttention:
    """Returns a zero output of the backend's shape: what a Triton backend allocates for a prefill step (the
    linear-attention kernels, kvforge/kernels/triton_causal_conv1d.py and triton_gated_delta_rule.py, too)."""

    def __call__(self, layer, q, k, v):
        return torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)

    def mla(self, layer, q_nope, q_rope, latent, k_rope, w_uk, w_uv):
        return torch.zeros(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1], dtype=q_nope.dtype)

    def short_conv(self, layer, x, weight, bias, activation):
        return torch.zeros_like(x)

    def delta_rule(self, layer, q, k, v, gates, *, scale=None, normalize_qk=True):
        gates.values()  # a prompt step computes the gates before the kernels
        return torch.zeros_like(v)


def _model(cls, config, dtype=torch.float32):
    torch.manual_seed(0)
    model = build_uninitialised(lambda: cls(config, dtype=dtype), "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return model


HEAD_PHASES = ("sampler", "prompt logprobs")


def _forward_peak(model, tokens: int) -> int:
    ids = torch.randint(0, model.vocab_size, (tokens,))
    positions = torch.arange(tokens)
    with torch.no_grad(), LiveTensorPeak() as probe:
        probe.ignore(*model.parameters(), *model.buffers())
        model(ids, positions, OutputOnlyAttention())
    return probe.peak


def _model_phases(spec, tokens: int, seqs: int) -> int:
    reserve = activation_reserve(spec, tokens, seqs, platform="cpu")
    return max(b for name, b in reserve.phases if name not in HEAD_PHASES)


@pytest.mark.parametrize("cls,config,peak_phase", [
    (LlamaForCausalLM, LLAMA, "MLP"), (LlamaForCausalLM, QWEN3, "full attention"),
    (DeepseekV3ForCausalLM, DEEPSEEK, "routed experts"), (DeepseekV3ForCausalLM, DEEPSEEK_MLA, "mla attention"),
    (GptOssForCausalLM, GPT_OSS, "routed experts"), (Qwen3NextForCausalLM, QWEN3_NEXT, "linear attention"),
    (Qwen3NextForCausalLM, QWEN3_NEXT_MOE, "routed experts"), (Qwen3NextForCausalLM, QWEN3_NEXT_FULL, "full attention"),
    (Gemma3ForCausalLM, GEMMA3, "MLP"),
], ids=["llama", "qwen3", "deepseek-moe", "deepseek-mla", "gpt-oss", "qwen3-next", "qwen3-next-moe",
        "qwen3-next-full", "gemma3"])
@pytest.mark.parametrize("tokens,dtype", [(16, "float32"), (128, "float32"), (512, "float32"), (256, "bfloat16")])
def test_reserve_bounds_the_measured_forward_peak(cls, config, peak_phase, tokens, dtype):
    """float32 and bfloat16 models: the float32 copies some code makes of bfloat16 tensors count double."""
    config = {**config, "torch_dtype": dtype}
    spec = spec_from_hf_config(config, name="tiny", source="test")
    model = _model(cls, config, getattr(torch, dtype))
    measured = _forward_peak(model, tokens)
    planned = _model_phases(spec, tokens, 8)
    phases = [(b, name) for name, b in activation_reserve(spec, tokens, 8, platform="cpu").phases
              if name not in HEAD_PHASES]
    assert max(phases)[1] == peak_phase  # the case tests the phase it is meant to
    print(f"{config['architectures'][0]} T={tokens}: measured {measured}, planned {planned}, {planned / measured:.3f}x")
    assert measured <= planned <= 1.5 * measured, (measured, planned, activation_reserve(spec, tokens, 8,
                                                                                         platform="cpu").phases)


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_reserve_bounds_the_head_and_sampler_peak(rows):
    """The head's logits of ``rows`` rows and a top-k/top-p sample over them, with the step's hidden alive."""
    spec = spec_from_hf_config(LLAMA, name="tiny", source="test")
    model = _model(LlamaForCausalLM, LLAMA)
    tokens = 64
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05)] * rows
    with torch.no_grad(), LiveTensorPeak() as probe:
        probe.ignore(*model.parameters(), *model.buffers())
        hidden = torch.randn(tokens, LLAMA["hidden_size"])
        normed = model.model.norm(hidden)
        logits = model.compute_logits(normed[:rows])
        Sampler()(logits, params)
    planned = dict(activation_reserve(spec, tokens, rows, platform="cpu").phases)["sampler"]
    print(f"sampler rows={rows}: measured {probe.peak}, planned {planned}, {planned / probe.peak:.3f}x")
    assert probe.peak <= planned <= 1.5 * probe.peak, (probe.peak, planned)


@pytest.mark.parametrize("cls,config", [(LlamaForCausalLM, LLAMA),
                                        (Gemma3ForCausalLM, {**GEMMA3, "final_logit_softcapping": 30.0})],
                         ids=["llama", "gemma3-soft-capped"])
@pytest.mark.parametrize("tokens,rows", [(600, 8), (600, 1), (100, 8)])
def test_reserve_bounds_the_prompt_logprobs_peak(cls, config, tokens, rows):
    """A step's sampled rows' logits beside its prompt rows scored slice by slice (the engine's head path:
    ``ModelRunner.head``), with the step's hidden alive. 600 rows are three slices; Gemma-3 soft-caps."""
    from kvforge.engine.model_runner import HostStep, ModelRunner
    from kvforge.engine.prompt_scoring import PromptScoring, set_scored_rows

    spec = spec_from_hf_config(config, name="tiny", source="test")
    model = _model(cls, config)
    scored = tokens - rows
    targets = torch.randint(0, config["vocab_size"], (scored,))
    runner = ModelRunner.__new__(ModelRunner)  # the head alone: no pool, no plan
    runner.model = model
    with torch.no_grad(), LiveTensorPeak() as probe:
        probe.ignore(*model.parameters(), *model.buffers(), targets)
        hidden = torch.randn(tokens, config["hidden_size"])
        normed = model.model.norm(hidden)
        scoring = PromptScoring(targets, 5, [])
        host = HostStep(*[None] * 9)
        set_scored_rows(host, scoring)
        logits = runner.head(normed, host, scoring)
    assert logits.shape == (rows, config["vocab_size"]) and scoring.result.token_logprobs.shape == (scored,)
    planned = dict(activation_reserve(spec, tokens, rows, platform="cpu").phases)["prompt logprobs"]
    print(f"prompt logprobs T={tokens} rows={rows}: measured {probe.peak}, planned {planned}, "
          f"{planned / probe.peak:.3f}x")
    assert probe.peak <= planned <= 1.5 * probe.peak, (probe.peak, planned)


def _plan(**kwargs):
    from kvforge.planner.api import plan

    return plan("llama-3.1-8b", device="cuda", gpu_memory=140 * 2**30, max_model_len=32768, **kwargs)


def test_a_larger_step_lowers_the_kv_memory_by_exactly_its_reserve():
    small, large = _plan(max_num_batched_tokens=8192), _plan(max_num_batched_tokens=262144)
    assert large.activations.tokens == 262144 and small.activations.tokens == 8192
    assert large.activations.bytes > small.activations.bytes
    lost = small.capacity.kv_cache_memory - large.capacity.kv_cache_memory
    assert lost == large.activations.bytes - small.activations.bytes  # integer bytes: exact
    usable = int(140 * 2**30 * 0.9)
    assert large.capacity.kv_cache_memory == usable - large.weights_bytes_per_rank - large.activations.bytes
    assert large.capacity.num_blocks < small.capacity.num_blocks
    assert large.to_dict()["activations"]["bytes"] == large.activations.bytes
    assert f"activations: {large.activations.bytes / 2**30:.2f} GiB for a step of 262,144 tokens" in large.summary()


def test_a_step_whose_activations_do_not_fit_names_the_flag():
    from kvforge.errors import PlanError

    with pytest.raises(PlanError, match="lower --max-num-batched-tokens"):
        _plan(max_num_batched_tokens=2_000_000)


def test_explicit_kv_memory_is_kept_and_warns_when_the_step_does_not_fit():
    from kvforge.planner.api import plan

    kv = 120 * 2**30
    p = plan("llama-3.1-8b", device="cuda", gpu_memory=140 * 2**30, kv_cache_memory=kv, max_model_len=32768,
             max_num_batched_tokens=262144)
    assert p.capacity.kv_cache_memory == kv
    assert any("--max-num-batched-tokens" in w and "exceed" in w for w in p.warnings)
    fits = plan("llama-3.1-8b", device="cuda", gpu_memory=140 * 2**30, kv_cache_memory=kv, max_model_len=32768,
                max_num_batched_tokens=2048, max_num_seqs=8)
    assert not any("exceed" in w for w in fits.warnings)


def test_the_gpu_step_counts_the_fused_path_and_the_reference_more():
    """The fused kernels drop the unfused temporaries (act(gate) beside the product, rope's copies)."""
    spec = spec_from_hf_config(LLAMA, name="tiny", source="test")
    cuda = dict(activation_reserve(spec, 4096, 8, platform="cuda").phases)
    cpu = dict(activation_reserve(spec, 4096, 8, platform="cpu").phases)
    assert cuda["MLP"] < cpu["MLP"]
    # Gemma's GELU MLP has no fused kernel on CUDA either: only the CPU rope's sign-folded sin table differs.
    gemma = spec_from_hf_config(GEMMA3, name="tiny", source="test")
    gemma_cuda = dict(activation_reserve(gemma, 4096, 8, platform="cuda").phases)["MLP"]
    gemma_cpu = dict(activation_reserve(gemma, 4096, 8, platform="cpu").phases)["MLP"]
    assert gemma_cpu - gemma_cuda == 4096 * GEMMA3["head_dim"] * 4


def test_the_chunked_delta_rule_s_buffers_join_the_linear_attention_phase_on_cuda(monkeypatch):
    """Where the route takes the chunked delta rule, Qwen3-Next's linear-attention phase on CUDA holds its float32
    buffers too, exactly; where the route names no chunk (every call token by token) and on CPU it holds none."""
    from kvforge.attention.routing import delta_rule

    spec = spec_from_hf_config(QWEN3_NEXT, name="tiny", source="test")
    tokens, hv = 512, QWEN3_NEXT["linear_num_value_heads"]
    monkeypatch.setattr(delta_rule, "PREFILL_CHUNK_SIZE", None)
    before = {p: dict(activation_reserve(spec, tokens, 8, platform=p).phases) for p in ("cuda", "cpu")}
    monkeypatch.setattr(delta_rule, "PREFILL_CHUNK_SIZE", 32)
    after = {p: dict(activation_reserve(spec, tokens, 8, platform=p).phases) for p in ("cuda", "cpu")}
    grown = after["cuda"]["linear attention"] - before["cuda"]["linear attention"]
    assert grown == tokens * hv * (QWEN3_NEXT["linear_key_head_dim"] + QWEN3_NEXT["linear_value_head_dim"] + 32) * 4
    assert after["cpu"] == before["cpu"]


def test_kda_layers_count_the_chunked_buffers_where_the_route_may_take_that_form(monkeypatch):
    """Kimi-Linear's KDA layers (per-channel gates) hold no chunked delta-rule buffers while the route keeps
    per-channel gates token by token (``PER_CHANNEL_CHUNKED`` off); where it may chunk them, exactly the buffers of the layer's heads on CUDA
    (none on CPU)."""
    from tiny_checkpoints import KIMI_LINEAR

    from kvforge.attention.routing import delta_rule

    spec = spec_from_hf_config(dict(KIMI_LINEAR, architectures=["KimiLinearForCausalLM"]), name="tiny", source="test")
    tokens, heads, dim = 512, KIMI_LINEAR["linear_num_heads"], KIMI_LINEAR["linear_head_dim"]
    monkeypatch.setattr(delta_rule, "PER_CHANNEL_CHUNKED", False)
    before = {p: dict(activation_reserve(spec, tokens, 8, platform=p).phases) for p in ("cuda", "cpu")}
    monkeypatch.setattr(delta_rule, "PER_CHANNEL_CHUNKED", True)
    after = {p: dict(activation_reserve(spec, tokens, 8, platform=p).phases) for p in ("cuda", "cpu")}
    grown = after["cuda"]["linear attention"] - before["cuda"]["linear attention"]
    assert grown == tokens * heads * (2 * dim + delta_rule.PREFILL_CHUNK_SIZE) * 4 > 0
    assert after["cpu"] == before["cpu"]
    assert {k: v for k, v in after["cuda"].items() if k != "linear attention"} == {
        k: v for k, v in before["cuda"].items() if k != "linear attention"}


def test_the_expanded_mla_bound_is_the_prefill_module_s():
    from kvforge.attention import mla_prefill_sdpa
    from kvforge.attention.routing import paged
    from kvforge.planner import activations

    assert activations.SDPA_KV_BYTES == mla_prefill_sdpa.SDPA_KV_BYTES == paged.SDPA_PREFILL_KV_BYTES


def test_the_gpu_step_counts_the_paged_sdpa_prefill():
    """Steps of at least the SDPA threshold count one SDPA call's gathered K/V (at the longest context, bounded
    by SDPA_KV_BYTES) beside the output; shorter steps, float32 models and layers with sinks do not."""
    from kvforge.attention.routing import paged
    from kvforge.planner.activations import _paged_sdpa_prefill
    from kvforge.spec.layers import AttentionLayerSpec

    layer = AttentionLayerSpec(index=0, kind="full", num_heads=32, num_kv_heads=8, head_dim_k=128, head_dim_v=128)
    long = 262144
    bf16 = _paged_sdpa_prefill(layer, 8192, 1, 2, long, "bfloat16")
    assert bf16 == 8 * 2 * 128 * long * 2 + 8192 * 32 * (128 * 2 + 4)  # all 8 heads: exactly SDPA_KV_BYTES
    fp8_head = paged.sdpa_prefill_kv_bytes_per_head(long, 128, "bfloat16", "fp8_e4m3")
    assert _paged_sdpa_prefill(layer, 8192, 1, 2, long, "fp8_e4m3") == 2 * fp8_head + 8192 * 32 * (128 * 2 + 4)
    assert _paged_sdpa_prefill(layer, 8192, 1, 2, 4096, None) == 2 * 8192 * 32 * 128 * 2  # the rest's half
    assert _paged_sdpa_prefill(layer, paged.SDPA_PREFILL.min_query_len - 1, 1, 2, long, "bfloat16") == 0
    assert _paged_sdpa_prefill(layer, 8192, 1, 4, long, "float32") == 0
    sinks = AttentionLayerSpec(index=0, kind="full", num_heads=32, num_kv_heads=8, head_dim_k=128, head_dim_v=128,
                               sinks=True)
    assert _paged_sdpa_prefill(sinks, 8192, 1, 2, long, "bfloat16") == 0



def test_the_engine_plans_the_reserve_of_its_step_budget():
    """The engine's plan reserves its own step: the budget given, or without chunked prefill the longest
    prompt when that is larger."""
    from kvforge import LLM

    with LLM(device="cpu", max_model_len=512, max_num_batched_tokens=384, max_num_seqs=8, progress=False) as llm:
        assert (llm.plan.activations.tokens, llm.plan.activations.sampled_rows) == (384, 8)
    with LLM(device="cpu", max_model_len=4096, max_num_seqs=8, enable_chunked_prefill=False, progress=False) as llm:
        assert llm.plan.activations.tokens == 4096  # above the CPU's default budget of 2048


@pytest.mark.parametrize("num_sms", [1, 78, 132, 160])
def test_the_split_bound_covers_every_paged_row(num_sms):
    """The partials' bound (``SPLIT_WAVES x MAX_SMS / Hkv + max_num_seqs`` rows per query row, the CUDA
    reserve's ``_split_partials``) holds for the split count every paged row picks: decode batches of 1-256
    sequences over 1-32 KV heads per rank at contexts up to 128k, fp8 (the Gluon rows) and bf16 (tl.dot)."""
    from kvforge.attention.routing import paged
    from kvforge.attention.routing.platform import Device
    from kvforge.planner.activations import MAX_SMS, SPLIT_WAVES

    device = Device(num_sms, True)
    for kv in ("fp8_e4m3", "bfloat16"):
        for hkv in (1, 2, 4, 8, 32):
            for seqs in (1, 3, 12, 13, 16, 64, 96, 256):
                for ctx in (300, 4096, 131072):
                    shape = paged.PagedShape(seqs, 4 * hkv, hkv, 128, 1, ctx, "bfloat16", kv)
                    rows = seqs * paged.route(shape, device).splits
                    assert rows <= -(-SPLIT_WAVES * MAX_SMS // hkv) + seqs, (kv, hkv, seqs, ctx)

"""The linear-layer route (kvforge/models/linear_route.py): its rule, its switch, and a Llama-family model
with the small-M kernel forced on against transformers.

The model cases build tiny random checkpoints in transformers (float32, random norms and biases, saved with
safetensors), load them into our model in a 16-bit dtype on the kernel device (Triton's CPU interpreter
without CUDA) and decode a flat batch of three sequences, teacher-forced, with the route on: every
projection (fused q/k/v with bias for Qwen2, o, gate/up, down) and the LM head of a decode step then run
the kernel (counted). Its logits are compared with transformers' float32 logits and with the same model
with the route off (``F.linear``): both 16-bit runs differ from float32 by the dtype's roundings through two
layers (relative L2 error about 1.2e-3 for fp16, 1e-2 for bf16 here); the kernel adds one rounding per
product and a summation order, so on-vs-off must stay within the same order (bounds 5e-3 fp16, 3e-2 bf16,
relative L2) while a wrong product moves the logits far more (a dropped q/k/v bias: 9e-2 in fp16; a
missed row, column or K chunk: order 1).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from tiny_checkpoints import randomize_dense_parameters
from triton_kernel_device import (
    DEVICE,
    INTERPRETED,
    gpu_only,
    requires_kernels,
    skip_unless_loaded_loop_bounds_work,
)

from kvforge.env import read_env
from kvforge.kernels import triton_small_m_linear
from kvforge.models import linear_route
from kvforge.models.dense_attention import DenseKVAttention
from kvforge.models.layers import store_input_major
from kvforge.models.linear_route import SMALL_M_MAX_ROWS, Linear, use_small_m_linear
from kvforge.models.registry import build_model
from kvforge.weights import load_config, load_weights

transformers = pytest.importorskip("transformers")

CUDA = torch.device("cuda")


@pytest.fixture
def route_on(monkeypatch):
    monkeypatch.setattr(linear_route, "SMALL_M_LINEAR", True)


def test_rule(route_on):
    bf16, fp16 = torch.bfloat16, torch.float16
    for m in range(1, SMALL_M_MAX_ROWS + 1):
        assert use_small_m_linear(m, 4096, 4096, bf16, CUDA)
    assert use_small_m_linear(1, 6144, 4096, fp16, CUDA)
    assert not use_small_m_linear(0, 4096, 4096, bf16, CUDA)  # nothing to multiply
    assert not use_small_m_linear(SMALL_M_MAX_ROWS + 1, 4096, 4096, bf16, CUDA)  # a GEMM: cuBLAS
    assert not use_small_m_linear(1, 4096, 4096, torch.float32, CUDA)
    assert not use_small_m_linear(1, 4096, 4100, bf16, CUDA)  # rows not 16-byte aligned
    assert not use_small_m_linear(1, 4096, 4096, bf16, torch.device("cpu"))


def test_rule_weight_size_limit(route_on, monkeypatch):
    monkeypatch.setattr(linear_route, "SMALL_M_MAX_WEIGHT_BYTES", 6144 * 4096 * 2)
    assert use_small_m_linear(1, 6144, 4096, torch.bfloat16, CUDA)  # the qkv projection: at the limit
    assert not use_small_m_linear(1, 6145, 4096, torch.bfloat16, CUDA)
    assert not use_small_m_linear(1, 28672, 4096, torch.bfloat16, CUDA)  # gate_up: cuBLAS


def test_switch(monkeypatch):
    monkeypatch.setattr(linear_route, "SMALL_M_LINEAR", False)
    assert not use_small_m_linear(1, 4096, 4096, torch.bfloat16, CUDA)
    assert read_env({}).small_m_linear is None  # unset: the route's default
    assert read_env({"KVFORGE_SMALL_M_LINEAR": ""}).small_m_linear is None
    assert read_env({"KVFORGE_SMALL_M_LINEAR": "1"}).small_m_linear is True
    assert read_env({"KVFORGE_SMALL_M_LINEAR": "no"}).small_m_linear is False


def test_linear_is_a_drop_in_nn_linear():
    """The routed layer keeps nn.Linear's parameters and state-dict names, and stays input-major-able on CPU."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(24, 8)
    lin = Linear(24, 8)
    assert lin.load_state_dict(ref.state_dict()) is not None
    x = torch.randn(3, 24)
    assert torch.equal(lin(x), ref(x))  # CPU: F.linear, the same call
    store_input_major([lin])
    assert lin.weight.stride() == (1, 8)  # [in, out] storage


BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
}
PROMPT_LENS = (9, 5, 12)
DECODE_STEPS = 2


def _hf_checkpoint(case, path):
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(4321)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**BASE, **extra)).float().eval()
    randomize_dense_parameters(model)  # norms and biases away from 1 and 0, so they are tested
    model.save_pretrained(path, safe_serialization=True)
    return model


def _decode_logits(model, seqs, prompt_lens=PROMPT_LENS):
    """Prefill the prompts (one flat batch), then DECODE_STEPS teacher-forced steps of one token each."""
    attn = DenseKVAttention.for_model(model)
    ids = torch.cat([s[:n] for s, n in zip(seqs, prompt_lens)]).to(DEVICE)
    pos = torch.cat([torch.arange(n) for n in prompt_lens]).to(DEVICE)
    attn.set_batch(range(len(seqs)), list(prompt_lens))
    model(ids, pos, attn)
    out = []
    for step in range(DECODE_STEPS):
        p = [n + step for n in prompt_lens]
        ids = torch.stack([s[i] for s, i in zip(seqs, p)]).to(DEVICE)
        attn.set_batch(range(len(seqs)), [1] * len(seqs))
        out.append(model.compute_logits(model(ids, torch.tensor(p, device=DEVICE), attn)).double().cpu())
    return torch.cat(out)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@requires_kernels
@pytest.mark.parametrize("case,dtype", [("llama", torch.bfloat16), ("qwen2-bias", torch.float16)])
def test_model_decode_with_kernel_matches_transformers(case, dtype, tmp_path, route_on, monkeypatch):
    skip_unless_loaded_loop_bounds_work()
    monkeypatch.setattr(linear_route, "SMALL_M_LINEAR_DEVICES", (DEVICE,))
    monkeypatch.setattr(linear_route, "SMALL_M_MAX_ROWS", 8)  # the kernel takes the 3-row decode steps
    if dtype == torch.bfloat16 and INTERPRETED:  # BF16_DOT: the 3 rows by broadcast, which the interpreter runs
        monkeypatch.setattr(triton_small_m_linear, "BROADCAST_MAX_ROWS", 4)
        monkeypatch.setattr(triton_small_m_linear, "WIDE_DOT_FROM_ROWS", 5)
        fresh = functools.cache(triton_small_m_linear.small_m_linear_config.__wrapped__)  # no config cached across
        monkeypatch.setattr(triton_small_m_linear, "small_m_linear_config", fresh)
    calls = []
    kernel = triton_small_m_linear.small_m_linear

    def counted(x, weight, bias=None, num_sms=None):
        calls.append(x.shape[0])
        # Planned for a 4-SM device: the widest row blocks, the fewest programs for the interpreter to run.
        return kernel(x, weight, bias, num_sms=4)

    monkeypatch.setattr(triton_small_m_linear, "small_m_linear", counted)
    hf = _hf_checkpoint(case, tmp_path)
    config = load_config(tmp_path)
    ours = build_model(config, dtype, DEVICE)
    load_weights(ours, tmp_path, "auto", progress=False)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, BASE["vocab_size"], (n + DECODE_STEPS,), generator=g) for n in PROMPT_LENS]
    with torch.no_grad():
        want = torch.cat([torch.stack([hf(input_ids=s[None]).logits[0, n + step].double() for s, n in
                                       zip(seqs, PROMPT_LENS)]) for step in range(DECODE_STEPS)])
    with torch.inference_mode():
        on = _decode_logits(ours, seqs)
        kernel_calls = list(calls)
        monkeypatch.setattr(linear_route, "SMALL_M_LINEAR", False)
        off = _decode_logits(ours, seqs)
    # Decode steps (3 rows): 4 projections per layer and the LM head; the prefill (26 rows) took cuBLAS.
    assert kernel_calls == [len(PROMPT_LENS)] * (DECODE_STEPS * (4 * BASE["num_hidden_layers"] + 1))
    assert len(calls) == len(kernel_calls)  # route off: no kernel call
    bound = {torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    assert _rel(off, want) <= bound, "the 16-bit model without the kernel is off: not the kernel's fault"
    assert _rel(on, want) <= bound
    assert _rel(on, off) <= bound


@requires_kernels
@pytest.mark.parametrize("case,dtype", [("llama", torch.bfloat16), ("qwen2-bias", torch.float16)])
def test_one_row_decode_with_prologues_matches_transformers(case, dtype, tmp_path, route_on, monkeypatch):
    """One sequence: its decode steps compute both norms of every layer inside the next product and SiLU-and-mul
    inside the down projection (counted), and the logits stay within the bounds of the three-row case above
    against transformers and against the route off (no prologue, no kernel)."""
    skip_unless_loaded_loop_bounds_work()
    monkeypatch.setattr(linear_route, "SMALL_M_LINEAR_DEVICES", (DEVICE,))
    monkeypatch.setattr(linear_route, "SMALL_M_PROLOGUES", True)
    calls = []

    def counted(name):
        kernel = getattr(triton_small_m_linear, name)

        def run(*args, num_sms=None, **kw):
            calls.append(name)
            return kernel(*args, num_sms=4, **kw)  # a 4-SM plan: the fewest programs for the interpreter

        monkeypatch.setattr(triton_small_m_linear, name, run)

    for name in ("small_m_linear", "rms_norm_linear", "silu_mul_linear"):
        counted(name)
    hf = _hf_checkpoint(case, tmp_path)
    ours = build_model(load_config(tmp_path), dtype, DEVICE)
    load_weights(ours, tmp_path, "auto", progress=False)
    n = 11
    seq = torch.randint(0, BASE["vocab_size"], (n + DECODE_STEPS,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = torch.stack([hf(input_ids=seq[None]).logits[0, n + step].double() for step in range(DECODE_STEPS)])
    with torch.inference_mode():
        on = _decode_logits(ours, [seq], (n,))
        kernel_calls = list(calls)
        monkeypatch.setattr(linear_route, "SMALL_M_LINEAR", False)
        off = _decode_logits(ours, [seq], (n,))
    layers = BASE["num_hidden_layers"]
    per_step = ["rms_norm_linear", "small_m_linear", "rms_norm_linear", "silu_mul_linear"] * layers
    assert kernel_calls == (per_step + ["small_m_linear"]) * DECODE_STEPS  # qkv, o, gate_up, down; LM head
    assert len(calls) == len(kernel_calls)  # route off: no kernel call
    bound = {torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    assert _rel(off, want) <= bound, "the 16-bit model without the kernel is off: not the kernel's fault"
    assert _rel(on, want) <= bound
    assert _rel(on, off) <= bound


def test_prologues_switch():
    assert read_env({}).small_m_prologues is None  # unset: the route's default
    assert linear_route.SMALL_M_PROLOGUES_DEFAULT is True
    assert read_env({"KVFORGE_SMALL_M_PROLOGUES": "0"}).small_m_prologues is False


@gpu_only
@pytest.mark.parametrize("tokens", [1, 5])
def test_model_forward_in_cuda_graph_on_gpu(tokens, tmp_path, route_on, monkeypatch):
    """A forward of ``tokens`` rows captured in a CUDA graph with the route on (broadcast path at 1 row, tl.dot
    at 5) replays to the eager result bit for bit, and stays within the bf16 bound of the route-off forward."""
    monkeypatch.setattr(linear_route, "SMALL_M_MAX_ROWS", 8)  # 5 rows: the kernel's tl.dot path
    _hf_checkpoint("qwen2-bias", tmp_path)
    model = build_model(load_config(tmp_path), torch.bfloat16, "cuda")
    load_weights(model, tmp_path, "auto", progress=False)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, BASE["vocab_size"], (tokens,), generator=gen).cuda()
    pos = torch.arange(tokens, device="cuda") + 3

    def attend(layer_idx, q, k, v):  # the step's own tokens, causal: stateless, so capturable
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, scale=model.softmax_scale)
        return out.transpose(0, 1)

    def step():
        return model.compute_logits(model(ids, pos, attend))

    with torch.inference_mode():
        eager = step()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        linear_route.SMALL_M_LINEAR = False  # the fixture's monkeypatch restores it
        off = step()
    assert _rel(eager.double(), off.double()) <= 3e-2

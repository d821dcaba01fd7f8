"""Branches on a second CUDA stream (kvforge/models/side_stream.py): the join orders the side stream's
output before its readers, and a MoE layer whose shared experts run beside the routing gives the values it
gives without the side stream, eagerly and replayed from a CUDA graph.

Exact equality where both paths launch the same kernels on the same inputs (the side stream changes only
when they run). Without CUDA the function runs at once on the current stream (checked on CPU).
"""

from __future__ import annotations

import pytest
import torch

from kvforge.models import side_stream
from kvforge.models.deepseek import DeepseekArgs, MoE

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CFG = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=64,
           num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, moe_intermediate_size=32,
           n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1,
           kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, vocab_size=64,
           max_position_embeddings=64, rms_norm_eps=1e-5, n_group=1, topk_group=1, norm_topk_prob=False,
           routed_scaling_factor=1.0, q_lora_rank=None, topk_method="greedy")


def test_off_cuda_the_function_runs_at_once():
    x = torch.arange(6.0)
    joined = side_stream.beside(lambda t: t * 2, x)
    assert not side_stream.use_side_stream(x)
    assert torch.equal(joined.result(), x * 2)


@needs_cuda
@torch.no_grad()
def test_result_waits_for_the_side_stream(monkeypatch):
    """The side branch sleeps before writing its output; a reader queued after ``result()`` on the main
    stream must see the finished values (without the join it would read the output before it is written)."""
    monkeypatch.setattr(side_stream, "SIDE_STREAM", True)
    x = torch.randn(1 << 20, device="cuda")

    def slow_double(t):
        torch.cuda._sleep(20_000_000)  # ~10 ms of spinning on the side stream
        return t * 2

    for _ in range(3):
        joined = side_stream.beside(slow_double, x)
        got = joined.result() + 1  # queued on the main stream
        assert torch.equal(got, x * 2 + 1)


def _moe(dtype=torch.bfloat16):
    torch.manual_seed(0)
    moe = MoE(DeepseekArgs(CFG), dtype=dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32).mul_(0.2).to(p.dtype))
    return moe.cuda()


@needs_cuda
@torch.no_grad()
def test_moe_with_shared_experts_beside_equals_in_order(monkeypatch):
    moe = _moe()
    x = torch.randn(24, 64, device="cuda").to(torch.bfloat16)
    monkeypatch.setattr(side_stream, "SIDE_STREAM", False)
    want = moe(x)
    monkeypatch.setattr(side_stream, "SIDE_STREAM", True)
    assert side_stream.use_side_stream(x)
    assert want.abs().max() > 0
    assert torch.equal(moe(x), want)

    # Captured in a CUDA graph (the side stream forks from and joins the capturing stream), replayed on new
    # input: the values of the in-order eager forward.
    static_x = x.clone()
    moe(static_x)  # warm-up outside the capture (lazy kernel compiles, cuBLAS handles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = moe(static_x)
    new_x = torch.randn(24, 64, device="cuda").to(torch.bfloat16)
    static_x.copy_(new_x)
    graph.replay()
    monkeypatch.setattr(side_stream, "SIDE_STREAM", False)
    assert torch.equal(static_out, moe(new_x))

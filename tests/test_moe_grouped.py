"""The capture-safe MoE path (one torch._grouped_mm per projection, device-side expert offsets) equals
the per-expert loop (host-side counts), with and without a tensor-parallel expert mask.

On CUDA the engine takes the grouped path wherever ``torch._grouped_mm`` passes its probe for the
weights' dtype (kvforge/models/grouped_mm.py), which is what lets MoE models run decode as CUDA
graphs; on CPU the engine keeps the loop. Here both paths run on CPU on the same inputs.
"""

from __future__ import annotations

import pytest
import torch
from random_params import fill_normal

from kvforge.models.deepseek import DeepseekArgs, MoE
from kvforge.models.grouped_mm import grouped_mm_problem

pytestmark = pytest.mark.skipif(grouped_mm_problem("cpu", torch.float32) is not None,
                                reason="this torch build has no working torch._grouped_mm on CPU")

CFG = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=64,
           num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, moe_intermediate_size=32,
           n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, first_k_dense_replace=1,
           kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, vocab_size=64,
           max_position_embeddings=64, rms_norm_eps=1e-5, n_group=4, topk_group=2, norm_topk_prob=True,
           routed_scaling_factor=2.5, q_lora_rank=None)


def _moe(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return fill_normal(MoE(DeepseekArgs(CFG), dtype=dtype), 0.2)


@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_grouped_equals_loop_fp32(tokens):
    moe = _moe()
    x = torch.randn(tokens, 64)
    w, ids = moe.gate(x)
    loop, grouped = moe._routed_loop(x, w, ids), moe._routed_grouped(x, w, ids)
    assert loop.abs().max() > 0
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)


def test_grouped_equals_loop_bf16():
    moe = _moe(torch.bfloat16)
    x = torch.randn(29, 64).to(torch.bfloat16)
    w, ids = moe.gate(x)
    loop, grouped = moe._routed_loop(x, w, ids).float(), moe._routed_grouped(x, w, ids).float()
    assert (grouped - loop).abs().max() <= 2 ** -7 * loop.abs().max()


def test_grouped_equals_loop_with_expert_mask():
    """Tensor parallelism: a rank holds experts [start, start + n) and computes only those slots."""
    moe = _moe()
    x = torch.randn(23, 64)
    w, ids = moe.gate(x)
    valid = torch.rand(ids.shape) < 0.5
    local = torch.where(valid, ids, torch.zeros_like(ids))
    loop, grouped = moe._routed_loop(x, w, local, valid), moe._routed_grouped(x, w, local, valid)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)
    none = torch.zeros_like(valid)
    assert moe._routed_grouped(x, w, local, none).abs().max() == 0 == moe._routed_loop(x, w, local, none).abs().max()


def test_cpu_engine_keeps_the_loop(monkeypatch):
    moe = _moe()
    called = []
    monkeypatch.setattr(MoE, "_routed_grouped", lambda *a, **k: called.append(1))
    moe(torch.randn(4, 64))
    assert not called


@pytest.mark.parametrize("tokens", [21, 2])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("triton_rows,fuse_silu", [(False, False), (True, False), (True, True)])
def test_triton_expert_kernel_route_equals_loop(monkeypatch, masked, triton_rows, fuse_silu, tokens):
    """With the Triton expert kernel routed (CUDA, or Triton's CPU interpreter here), the grouped path still
    equals the loop: every expert's rows, and under an expert mask only the slots held here; also with the
    rows grouped and summed by their Triton kernels (kvforge/models/expert_rows.py), and with SiLU-and-mul
    inside the down product. Two tokens of top-3 over 8 experts launch a program per sorted position
    (fewer positions than experts), 21 a program per expert. float16: the interpreter's bfloat16 ``tl.dot``
    multiplies bit patterns."""
    from triton_kernel_device import DEVICE, KERNELS_RUN, skip_unless_loaded_loop_bounds_work

    if not KERNELS_RUN:
        pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
    skip_unless_loaded_loop_bounds_work()
    from kvforge.models import expert_gemm_route, expert_rows

    monkeypatch.setattr(expert_rows, "TRITON_ROWS", triton_rows)
    monkeypatch.setattr(expert_rows, "TRITON_ROWS_DEVICES", (DEVICE,))
    grouped_by = []
    real_group = expert_rows.group_by_expert
    monkeypatch.setattr("kvforge.models.deepseek.group_by_expert",
                        lambda *a: grouped_by.append(r := real_group(*a)) or r)
    monkeypatch.setattr(expert_gemm_route, "TRITON_EXPERT_GEMM", True)
    monkeypatch.setattr(expert_gemm_route, "TRITON_EXPERT_GEMM_DEVICES", (DEVICE,))
    monkeypatch.setattr(expert_gemm_route, "FUSE_SILU_MUL", fuse_silu)
    from kvforge.kernels import triton_expert_gemm
    fused = []
    real_gemm = triton_expert_gemm.expert_gemm
    monkeypatch.setattr(triton_expert_gemm, "expert_gemm",
                        lambda *a, **k: fused.append(k.get("silu_mul", False)) or real_gemm(*a, **k))
    called = []
    real = expert_gemm_route.use_triton_expert_gemm
    monkeypatch.setattr(expert_gemm_route, "use_triton_expert_gemm", lambda *a: called.append(real(*a)) or real(*a))
    moe = _moe(torch.float16).to(DEVICE)
    x = torch.randn(tokens, 64).to(torch.float16).to(DEVICE)
    w, ids = moe.gate(x)
    valid = None
    if masked:
        valid = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE) < 0.5
        ids = torch.where(valid, ids, torch.zeros_like(ids))
    with torch.no_grad():
        shared = moe.shared_experts(x)  # rides in the weighted sum
        grouped = moe._routed_grouped(x, w, ids, valid, shared).float().cpu()
        loop = moe.cpu().float()._routed_loop(x.cpu().float(), w.cpu().float(), ids.cpu(),
                                              None if valid is None else valid.cpu()).float()
        loop = loop + shared.float().cpu()
    assert called == [True, True]  # both products ran the kernel
    assert fused == [False, fuse_silu]  # the down product took the activation when asked
    assert [r.inverse is not None for r in grouped_by] == [triton_rows]
    assert loop.abs().max() > 0
    assert (grouped - loop).abs().max() <= 2 ** -8 * loop.abs().max()


GPT_OSS_CFG = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48, vocab_size=64,
                   max_position_embeddings=512, rms_norm_eps=1e-5, sliding_window=8, num_local_experts=6,
                   num_experts_per_tok=2)


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("first,num_local", [(0, None), (2, 3)])
def test_gpt_oss_grouped_equals_loop(monkeypatch, kernel, first, num_local):
    """gpt-oss's experts (biases, interleaved gate/up, weights stored out-major behind HF's [E, in, out]
    shapes): the grouped path, through ``torch._grouped_mm`` or the Triton expert kernel with its bias
    (CUDA, or Triton's CPU interpreter here), equals the loop; with ``first``/``num_local``, a rank holding
    experts 2..4 computes only their slots. float16: the interpreter's bfloat16 ``tl.dot`` multiplies bit
    patterns."""
    from kvforge.models import expert_gemm_route
    from kvforge.models.gpt_oss import GptOssArgs, GptOssExperts, GptOssRouter

    if kernel:
        from triton_kernel_device import DEVICE, KERNELS_RUN, skip_unless_loaded_loop_bounds_work

        if not KERNELS_RUN:
            pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
        skip_unless_loaded_loop_bounds_work()
        monkeypatch.setattr(expert_gemm_route, "TRITON_EXPERT_GEMM_DEVICES", (DEVICE,))
    else:
        DEVICE = "cpu"
    monkeypatch.setattr(expert_gemm_route, "TRITON_EXPERT_GEMM", kernel)
    called = []
    real = expert_gemm_route.use_triton_expert_gemm
    monkeypatch.setattr(expert_gemm_route, "use_triton_expert_gemm", lambda *a: called.append(real(*a)) or real(*a))
    a = GptOssArgs(GPT_OSS_CFG)
    torch.manual_seed(3)
    experts, router = GptOssExperts(a, num_local=num_local, first=first), GptOssRouter(a)
    with torch.no_grad():
        for p in list(experts.parameters()) + list(router.parameters()):
            p.copy_(torch.randn_like(p).mul_(0.3))
    assert experts.gate_up_proj.shape == (experts.num_local, 64, 96)  # HF's shape, stored out-major
    assert experts.gate_up_proj.transpose(1, 2).is_contiguous()
    x = torch.randn(13, 64)
    weights, ids = router(x)
    dtype = torch.float16
    with torch.no_grad():
        loop = experts.loop(x, weights, ids)
        half = experts.to(dtype).to(DEVICE)
        grouped = half.grouped(x.to(dtype).to(DEVICE), weights.to(dtype).to(DEVICE), ids.to(DEVICE)).float().cpu()
    assert called == [kernel, kernel]
    assert loop.abs().max() > 0
    assert (grouped - loop).abs().max() <= 2 ** -7 * loop.abs().max()

"""The softmax router's top-k (kvforge/models/router_topk.py): the Triton kernel (compiled on a GPU, else in
Triton's interpreter) and the PyTorch path, against a float64 softmax and a sort written here."""

from __future__ import annotations

import pytest
import torch
from triton_kernel_device import DEVICE, KERNELS_RUN, route_fixture

from kvforge.models import router_topk


def _expected(logits: torch.Tensor, k: int, renormalize: bool, scale: float):
    """float64 softmax; the k largest by a stable sort of (-p, index): ties to the lower expert index."""
    p = torch.softmax(logits.double(), dim=-1)
    ids = torch.stack([torch.tensor(sorted(range(p.shape[1]), key=lambda e: (-p[t, e].item(), e))[:k])
                       for t in range(p.shape[0])])
    w = p.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * scale, ids


device = route_fixture(router_topk, "TRITON_ROUTER", "TRITON_ROUTER_DEVICES")


@pytest.mark.parametrize("tokens,experts,k,renormalize,scale", [
    (1, 4, 1, False, 1.0), (9, 64, 6, False, 1.0), (5, 64, 6, True, 1.0), (3, 60, 8, False, 2.5),
    (17, 512, 10, True, 1.0), (2, 8, 8, True, 1.0),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_topk_matches_float64(device, tokens, experts, k, renormalize, scale, dtype):
    g = torch.Generator().manual_seed(tokens * experts + k)
    if dtype == torch.float32:
        logits = torch.randn(tokens, experts, generator=g) * 3
    else:  # distinct multiples of 1/16 in [-16, 16): exact in bfloat16, so no two experts tie
        logits = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)]).sub(experts // 2).div(16)
        logits = logits.to(dtype)
    w, ids = router_topk.softmax_topk(logits.to(device), k, renormalize, scale)
    assert (router_topk.use_triton_router(logits.to(device))) == router_topk.TRITON_ROUTER
    want_w, want_ids = _expected(logits, k, renormalize, scale)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (tokens, k)
    assert torch.equal(ids.cpu(), want_ids)  # no ties among the logits
    # float32 softmax: exp within a few ulps, a sum over E terms, one division (and one for renormalize)
    tol = (experts + 8) * 2.0**-24
    assert (w.cpu().double() - want_w).abs().max() <= tol * want_w.abs().max()


def test_ties_go_to_the_lower_expert_index(monkeypatch):
    if not KERNELS_RUN:
        pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
    from kvforge.kernels.triton_router_topk import softmax_topk

    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0]]).to(DEVICE)
    w, ids = softmax_topk(logits, 4, renormalize=False)
    assert ids.tolist() == [[1, 3, 5, 2]]
    assert w[0, 0] == w[0, 1] == w[0, 2]  # one probability computed once, stored thrice


def test_the_rule(monkeypatch):
    monkeypatch.setattr(router_topk, "TRITON_ROUTER", True)
    monkeypatch.setattr(router_topk, "TRITON_ROUTER_DEVICES", ("meta",))
    x = torch.empty(4, 64, device="meta")
    with torch.no_grad():
        assert router_topk.use_triton_router(x)
        assert not router_topk.use_triton_router(torch.empty(4, 64))  # cpu: not listed
        assert not router_topk.use_triton_router(torch.empty(64, 4, device="meta").t())  # E not contiguous
        assert not router_topk.use_triton_router(torch.empty(4, 8192, device="meta"))  # too many experts
    assert not router_topk.use_triton_router(x)  # autograd on: inference-only kernel
    monkeypatch.setattr(router_topk, "TRITON_ROUTER", False)
    with torch.no_grad():
        assert not router_topk.use_triton_router(x)


def test_kernel_refuses_bad_shapes():
    from kvforge.kernels.triton_router_topk import softmax_topk

    with pytest.raises(ValueError, match="top-9 of 8"):
        softmax_topk(torch.zeros(2, 8), 9, renormalize=False)
    with pytest.raises(ValueError, match="contiguous along E"):
        softmax_topk(torch.zeros(8, 2).t(), 1, renormalize=False)


@pytest.mark.parametrize("tokens,experts,hidden,k,renormalize,scale", [
    (1, 4, 16, 1, False, 1.0), (9, 64, 300, 6, False, 1.0), (5, 64, 2048, 6, True, 1.0), (3, 160, 64, 8, False, 16.0),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_softmax_topk_matches_float64(device, tokens, experts, hidden, k, renormalize, scale, dtype):
    """The router with its float32 product (DeepSeek's gate): inputs whose products and sums are exact in
    float32 (small integers times 2^-12, below 2^24 units), and a first feature that orders every token's
    experts by a distinct offset larger than the rest of the sum can move it: the logits are exact and
    untied, so the ids equal the float64 sort's and the weights the float64 softmax's to float32 rounding."""
    g = torch.Generator().manual_seed(tokens * hidden + k)
    x = torch.randint(-1, 2, (tokens, hidden), generator=g).to(torch.float64)
    x[:, 0] = 1
    w = torch.randint(-1, 2, (experts, hidden), generator=g).to(torch.float64)
    w[:, 0] = torch.randperm(experts, generator=g).to(torch.float64) * (2 * hidden + 1)
    w = w * 2.0**-12
    logits = x @ w.T
    got_w, ids = router_topk.linear_softmax_topk(x.to(dtype).to(device), w.float().to(device), k, renormalize, scale)
    want_w, want_ids = _expected(logits, k, renormalize, scale)
    assert got_w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (tokens, k)
    assert torch.equal(ids.cpu(), want_ids)
    tol = (experts + 8) * 2.0**-24
    assert (got_w.cpu().double() - want_w).abs().max() <= tol * want_w.abs().max()


def test_router_product_takes_the_kernel_where_it_serves(monkeypatch):
    """DeepSeek's gate on the kernel path: one launch of the product kernel, none of the logits kernel."""
    if not KERNELS_RUN:
        pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
    from kvforge.kernels import triton_router_topk
    from kvforge.models.deepseek import DeepseekArgs, Gate

    monkeypatch.setattr(router_topk, "TRITON_ROUTER", True)
    monkeypatch.setattr(router_topk, "TRITON_ROUTER_DEVICES", (DEVICE,))
    calls = []
    product, two_step = triton_router_topk.linear_softmax_topk, triton_router_topk.softmax_topk
    monkeypatch.setattr(triton_router_topk, "linear_softmax_topk", lambda *a: calls.append(a[0].shape) or product(*a))
    monkeypatch.setattr(triton_router_topk, "softmax_topk", lambda *a: pytest.fail("a second launch"))
    cfg = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=64,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, moe_intermediate_size=32,
               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
               kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, vocab_size=64,
               max_position_embeddings=64, rms_norm_eps=1e-5, q_lora_rank=None, topk_method="greedy")
    gate = Gate(DeepseekArgs(cfg)).to(DEVICE)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
        x = torch.randn(3, 64, generator=g).to(DEVICE, torch.bfloat16)
        w, ids = gate(x)
        assert calls == [(3, 64)]
        # Against the two launches (float32 product by F.linear): the same experts, weights to float32 sums.
        monkeypatch.setattr(router_topk, "FUSE_ROUTER_PRODUCT", False)
        monkeypatch.setattr(triton_router_topk, "softmax_topk", two_step)
        w2, ids2 = gate(x)
    assert calls == [(3, 64)] and torch.equal(ids, ids2)
    assert (w - w2).abs().max() <= 1e-5

"""The one-launch router (kvforge/kernels/triton_router_logits_topk.py, routed by
``kvforge.models.router_topk.router_softmax_topk``): float32 logits of ``x @ weight.T`` and the softmax top-k,
against float64 logits and a sort written here; the ticket counter back at zero after every launch; the
route's rule; DeepSeek's gate through the kernel against the gate through PyTorch."""

from __future__ import annotations

import types

import pytest
import torch
from triton_kernel_device import DEVICE, KERNELS_RUN, requires_kernels, route_fixture

from kvforge.models import router_topk


def _expected(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool, scale: float, shared: int):
    """float64 logits and softmax; the k largest by a sort of (-p, index); ``shared`` slots of weight 1."""
    logits = x.double() @ weight.double().T
    p = torch.softmax(logits, dim=-1)
    order = [sorted(range(p.shape[1]), key=lambda e: (-p[t, e].item(), e)) for t in range(p.shape[0])]
    ids = torch.tensor([o[:k] for o in order])
    w = p.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    w = w * scale
    e = weight.shape[0]
    if shared:
        ids = torch.cat([ids, torch.arange(e, e + shared).expand(ids.shape[0], shared)], 1)
        w = torch.cat([w, torch.ones(ids.shape[0], shared, dtype=w.dtype)], 1)
    return logits, w, ids


def _inputs(tokens: int, experts: int, hidden: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=g)).to(dtype)
    weight = torch.randn(experts, hidden, generator=g) * hidden ** -0.5
    return x, weight


device = route_fixture(router_topk, "TRITON_ROUTER", "TRITON_ROUTER_DEVICES")

CASES = [  # tokens, experts, hidden, k, renormalize, scale, shared
    (1, 64, 2048, 6, False, 1.0, 0), (1, 64, 2048, 6, False, 1.0, 2), (2, 64, 2048, 6, True, 1.0, 0),
    (3, 160, 640, 6, False, 16.0, 1), (4, 8, 100, 2, True, 2.5, 0), (4, 64, 5120, 8, False, 1.0, 0),
    (1, 4, 16, 4, False, 1.0, 0), (6, 64, 2048, 6, False, 1.0, 2), (8, 256, 1024, 8, True, 2.5, 1),
]


@pytest.mark.parametrize("tokens,experts,hidden,k,renormalize,scale,shared", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_matches_float64(device, tokens, experts, hidden, k, renormalize, scale, shared, dtype):
    for seed in range(100):  # a draw whose k-th and (k+1)-th logits lie far apart against float32's error
        x, weight = _inputs(tokens, experts, hidden, dtype, seed=tokens * experts + hidden + k + 1000 * seed)
        logits, want_w, want_ids = _expected(x, weight, k, renormalize, scale, shared)
        # float32 logits: a sum of H products, each summation order within H ulps of sum|x w|
        logit_err = hidden * 2.0**-24 * (x.double().abs() @ weight.double().abs().T).max().item()
        top = logits.sort(dim=-1, descending=True).values
        if k == experts or (top[:, k - 1] - top[:, k]).min() > 100 * logit_err:
            break
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    fused = router_topk.use_fused_router_logits(x.to(device), weight.to(device))
    assert fused == router_topk.TRITON_ROUTER
    for _ in range(2):  # a second launch finds the counter at zero again
        w, ids = router_topk.router_softmax_topk(x.to(device), weight.to(device), k, renormalize, scale, shared,
                                                 counter)
        assert counter.item() == 0
        assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape
        assert torch.equal(ids.cpu(), want_ids)
        # a weight's relative error: at most twice the logits' (a difference of two in the softmax) plus the
        # softmax's own float32 roundings
        tol = 2 * logit_err + (experts + 8) * 2.0**-24
        assert ((w.cpu().double() - want_w).abs() / want_w.abs()).max() <= tol


def test_the_rule(monkeypatch):
    monkeypatch.setattr(router_topk, "TRITON_ROUTER", True)
    monkeypatch.setattr(router_topk, "TRITON_ROUTER_DEVICES", ("meta",))
    w = torch.empty(64, 2048, device="meta")
    with torch.no_grad():
        assert router_topk.use_fused_router_logits(torch.empty(8, 2048, device="meta"), w)
        assert not router_topk.use_fused_router_logits(torch.empty(9, 2048, device="meta"), w)  # > MAX_ROWS
        assert not router_topk.use_fused_router_logits(torch.empty(0, 2048, device="meta"), w)
        assert not router_topk.use_fused_router_logits(torch.empty(1, 2048), torch.empty(64, 2048))  # cpu
        assert not router_topk.use_fused_router_logits(torch.empty(2048, 2, device="meta").t(), w)
        assert not router_topk.use_fused_router_logits(torch.empty(1, 64, device="meta"),
                                                       torch.empty(2048, 64, device="meta"))  # > MAX_EXPERTS
        monkeypatch.setattr(router_topk, "FUSED_ROUTER_LOGITS", False)
        assert not router_topk.use_fused_router_logits(torch.empty(1, 2048, device="meta"), w)
    monkeypatch.setattr(router_topk, "FUSED_ROUTER_LOGITS", True)
    assert not router_topk.use_fused_router_logits(torch.empty(1, 2048, device="meta"), w)  # autograd on


@requires_kernels
def test_kernel_refuses_bad_inputs():
    from kvforge.kernels.triton_router_logits_topk import router_logits_topk

    x, w = torch.zeros(1, 32, device=DEVICE), torch.zeros(8, 32, device=DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        router_logits_topk(torch.zeros(9, 32, device=DEVICE), w, 2, False, 1.0, 0, counter)
    with pytest.raises(ValueError, match="share a contiguous hidden size"):
        router_logits_topk(x, torch.zeros(8, 16, device=DEVICE), 2, False, 1.0, 0, counter)
    with pytest.raises(ValueError, match="top-9 of 8"):
        router_logits_topk(x, w, 9, False, 1.0, 0, counter)
    with pytest.raises(ValueError, match="one int32"):
        router_logits_topk(x, w, 2, False, 1.0, 0, torch.zeros(1, device=DEVICE))


@pytest.mark.skipif(not KERNELS_RUN, reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("tokens", [1, 3, 7])
def test_deepseek_gate_through_the_kernel_equals_the_pytorch_gate(monkeypatch, tokens):
    """DeepSeek-V2-Lite's router shape (64 experts, top 6, two shared slots) at a small hidden size: the gate
    with the kernel allowed against the gate with it off; 7 tokens take the two-step path either way."""
    from kvforge.models.deepseek import Gate

    args = types.SimpleNamespace(n_routed_experts=64, hidden_size=256, top_k=6, norm_topk_prob=False, v3=False,
                                 topk_method="greedy", routed_scaling_factor=1.0)  # the fields Gate reads
    gate = Gate(args).to(DEVICE)
    g = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(64, 256, generator=g) / 16)
        x = torch.randn(tokens, 256, generator=g).to(torch.bfloat16).to(DEVICE)
        monkeypatch.setattr(router_topk, "TRITON_ROUTER_DEVICES", (DEVICE,))
        monkeypatch.setattr(router_topk, "FUSED_ROUTER_LOGITS", False)
        want_w, want_ids = gate(x, shared=2)
        monkeypatch.setattr(router_topk, "FUSED_ROUTER_LOGITS", True)
        got_w, got_ids = gate(x, shared=2)
    assert torch.equal(got_ids, want_ids)
    assert (got_w - want_w).abs().max().item() <= 1e-5 * want_w.abs().max().item()
    assert gate.launch_counter.item() == 0  # left at zero for the next launch

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

"""The L2 prefetch kernel (kvforge/kernels/triton_l2_prefetch.py): it runs on an sm_90 GPU at any size and
changes nothing a later kernel reads; it refuses what it cannot cover."""

from __future__ import annotations

import pytest
import torch
from triton_kernel_device import gpu_only

from kvforge.kernels.triton_l2_prefetch import CHUNK_BYTES, l2_prefetch, prefetch_supported
from kvforge.kernels.triton_small_m_linear import small_m_linear


def test_refuses_a_strided_tensor():
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(torch.zeros(8, 8).t())


def test_cpu_is_not_supported():
    assert not prefetch_supported(torch.device("cpu"))


@gpu_only
@pytest.mark.parametrize("nbytes", [0, 10, 16, 4096 + 6, CHUNK_BYTES * 128 + 48, 33 << 20])
def test_prefetch_changes_nothing(nbytes):
    if not prefetch_supported(torch.device("cuda")):
        pytest.skip("cp.async.bulk.prefetch needs compute capability 9")
    t = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    before = t.clone()
    l2_prefetch(t)
    torch.cuda.synchronize()
    assert torch.equal(t, before)


@gpu_only
def test_product_after_prefetch_is_the_same():
    """The small-M kernel's result does not depend on whether its weight was prefetched (a deterministic kernel:
    bitwise equal), inside a CUDA graph too."""
    if not prefetch_supported(torch.device("cuda")):
        pytest.skip("cp.async.bulk.prefetch needs compute capability 9")
    torch.manual_seed(0)
    w = torch.randn(4096, 4096, device="cuda").to(torch.bfloat16)
    x = torch.randn(1, 4096, device="cuda").to(torch.bfloat16)
    plain = small_m_linear(x, w)
    graph = torch.cuda.CUDAGraph()
    l2_prefetch(w)
    small_m_linear(x, w)
    with torch.cuda.graph(graph):
        l2_prefetch(w)
        out = small_m_linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)


@gpu_only
@pytest.mark.parametrize("entry", ["plain", "rms_norm", "silu_mul"])
def test_products_that_prefetch_the_next_weight(entry):
    """Each small-M entry with ``prefetch``: bitwise the result without it (the hint writes nothing); the next
    weight is left as it was."""
    from kvforge.kernels.triton_small_m_linear import rms_norm_linear, silu_mul_linear

    if not prefetch_supported(torch.device("cuda")):
        pytest.skip("cp.async.bulk.prefetch needs compute capability 9")
    torch.manual_seed(1)
    w = torch.randn(1024, 512, device="cuda").to(torch.bfloat16)
    nxt = torch.randn(3000, 7, device="cuda").to(torch.bfloat16)  # 42,000 bytes: not a multiple of 16
    before = nxt.clone()
    if entry == "plain":
        x = torch.randn(1, 512, device="cuda").to(torch.bfloat16)
        outs = [small_m_linear(x, w, prefetch=p) for p in (None, nxt)]
    elif entry == "rms_norm":
        x, r = (torch.randn(1, 512, device="cuda").to(torch.bfloat16) for _ in range(2))
        nw = torch.rand(512, device="cuda").to(torch.bfloat16)
        outs = [rms_norm_linear(x, r, nw, 1e-5, w, prefetch=p)[0] for p in (None, nxt)]
    else:
        gu = torch.randn(1, 1024, device="cuda").to(torch.bfloat16)
        outs = [silu_mul_linear(gu, w, prefetch=p) for p in (None, nxt)]
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(nxt, before)

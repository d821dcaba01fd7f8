"""The sliced argmax kernels (kvforge/kernels/triton_argmax.py) against ``torch.argmax``: random rows, ties
inside and across slices (the first index wins), infinities, a row shorter than a slice; the route's rule."""

from __future__ import annotations

import pytest
import torch
from triton_kernel_device import DEVICE, gpu_only, requires_kernels

from kvforge.engine.sampler import row_argmax as sampler_argmax
from kvforge.kernels import triton_argmax
from kvforge.kernels.triton_argmax import row_argmax, use_sliced_argmax

pytestmark = requires_kernels


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(triton_argmax, "SLICE", 64)  # many slices at shapes the interpreter runs quickly


@pytest.mark.parametrize("n,v", [(1, 1000), (3, 257), (2, 64), (1, 65), (5, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch(small_slices, n, v, dtype):
    gen = torch.Generator().manual_seed(n * 1000 + v)
    x = torch.randn(n, v, generator=gen).to(dtype)
    x[0, v // 3] = x[0, v - 1] = 50.0  # a tie across slices: the first index
    if n > 1:
        x[1, 1] = x[1, 2] = 50.0  # a tie inside one slice
    x = x.to(DEVICE)
    assert torch.equal(row_argmax(x).cpu(), x.cpu().float().argmax(dim=-1))


def test_infinities(small_slices):
    x = torch.randn(3, 300)
    x[0] = float("-inf")  # all -inf: index 0, as torch
    x[1, 7] = x[1, 200] = float("inf")
    x[2, 250] = float("inf")
    x = x.to(DEVICE)
    assert torch.equal(row_argmax(x).cpu(), x.cpu().argmax(dim=-1))


def test_strided_rows(small_slices):
    wide = torch.randn(4, 500).to(DEVICE)
    x = wide[:, 100:400]
    assert x.stride(1) == 1 and not x.is_contiguous()
    assert torch.equal(row_argmax(x).cpu(), x.cpu().argmax(dim=-1))


def test_rule_off_the_gpu():
    assert not use_sliced_argmax(torch.empty(1, 128256))
    assert not use_sliced_argmax(torch.empty(1, 128256, device="meta"))
    x = torch.randn(1, 128256)
    assert torch.equal(sampler_argmax(x), x.argmax(dim=-1))  # the sampler's route off the GPU


@gpu_only
@pytest.mark.parametrize("n", [1, 2, 16])
def test_vocabulary_sizes_on_gpu(n):
    assert not use_sliced_argmax(torch.empty(17, 128256, device="cuda"))  # many rows: torch's grid is full
    assert not use_sliced_argmax(torch.empty(1, 1000, device="cuda"))  # a short row: one program is enough
    for v in (32000, 128256, 151936, 262144):
        x = torch.randn(n, v, device="cuda")
        x[0, v - 5] = x[0, 17] = x.max() + 1  # a tie across slices
        assert use_sliced_argmax(x)
        assert torch.equal(row_argmax(x), x.argmax(dim=-1))
        assert torch.equal(sampler_argmax(x), x.argmax(dim=-1))


@gpu_only
def test_in_a_cuda_graph():
    x = torch.randn(1, 128256, device="cuda")
    row_argmax(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = row_argmax(x)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x.argmax(dim=-1))

"""Timing helpers the GPU benchmark scripts share: a CUDA-graph replay timed with L2 cleared, and the
device-to-device copy bandwidth their fractions are taken of."""

from __future__ import annotations

import functools

import torch
from triton.testing import do_bench


def graph_bench(fn, rep: int = 50) -> tuple[float, float, float]:
    """Median, min, max in us of a CUDA-graph replay of ``fn`` (compiled first, outside the capture;
    ``do_bench`` clears L2 before each timed call)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    med, lo, hi = do_bench(graph.replay, warmup=10, rep=rep, quantiles=[0.5, 0.0, 1.0])
    del graph
    return med * 1e3, lo * 1e3, hi * 1e3


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy of ``nbytes``, counting what it reads and writes."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    y = torch.empty_like(x)
    med = do_bench(functools.partial(y.copy_, x), warmup=10, rep=100, quantiles=[0.5])
    del x, y
    return 2 * nbytes / (med * 1e-3)


def cuda_setup(seed: int = 0) -> tuple[torch.device, int, float]:
    """Seed torch, then (the CUDA device, its SM count, its copy bandwidth in bytes per second)."""
    torch.manual_seed(seed)
    return torch.device("cuda"), torch.cuda.get_device_properties(0).multi_processor_count, copy_bandwidth()

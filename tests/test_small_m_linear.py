"""The small-M linear kernel (kvforge/kernels/triton_small_m_linear.py) against a float64 product.

Inputs are fresh normals rounded to the dtype (never zeros), and the output is a new ``torch.empty``
tensor, so a skipped row or column, a dropped bias or a wrong split sum shows as garbage.

Tolerance, per output element: the reference is ``ref = x @ w.T + b`` in float64 on the same 16-bit
values. The kernel's products are exact in float32 (two 8- or 11-bit significands need at most 22 bits),
so the only float32 error is the summation of ``K`` products and the bias, in whatever order the kernel
adds (chunks, splits, tensor-core MMA): at most ``g * S`` with ``S = |x| @ |w|.T + |b|`` and
``g = 4 * (K + 1) * 2^-24`` (the classic ``(n - 1) u`` bound of any summation order, with a factor 4 for
MMA units that align products before adding them). The result is then rounded once to the dtype: at most
``eps * |value|`` with ``eps = torch.finfo(dtype).eps`` (one unit in the last place relative to the
value: round-to-nearest on the GPU moves it by half of that; Triton's CPU interpreter truncates
float32 -> bfloat16, which moves it by less than one). Together: ``|y - ref| <= eps * (|ref| + g S) + g S``.

Runs compiled on CUDA, or in Triton's CPU interpreter elsewhere (tests/triton_kernel_device.py) at small
shapes. There ``tl.dot`` over bfloat16 multiplies bit patterns, so bf16 tl.dot cases skip (fp16 covers that
path's logic); the Llama-3.1-8B shapes and the CUDA-graph replay run on a GPU only.
"""

from __future__ import annotations

import pytest
import torch
from triton_kernel_device import (
    BF16_DOT,
    DEVICE,
    INTERPRETED,
    gpu_only,
    requires_kernels,
    skip_unless_loaded_loop_bounds_work,
)

from kvforge.kernels.triton_small_m_linear import (
    MAX_ROWS,
    PROLOGUE_NONE,
    PROLOGUE_RMS_NORM,
    PROLOGUE_SILU_MUL,
    SmallMLinearConfig,
    small_m_linear,
    small_m_linear_config,
)

pytestmark = requires_kernels


@pytest.fixture(autouse=True)
def _loop_bounds():
    skip_unless_loaded_loop_bounds_work()  # the K loop runs over a kernel argument


def _inputs(m, n, k, dtype, bias, seed=0):
    gen = torch.Generator(DEVICE).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
    w = torch.randn(n, k, generator=gen, device=DEVICE).to(dtype)
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if bias else None
    return x, w, b


def _check_close(y, x, w, b):
    """``y`` against the float64 product (on the tensors' device) within the bound of the module docstring."""
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype
    xd, wd = x.double(), w.double()
    ref = xd @ wd.T
    scale = xd.abs() @ wd.abs().T
    if b is not None:
        ref = ref + b.double()
        scale = scale + b.double().abs()
    g = 4 * (x.shape[1] + 1) * 2.0**-24
    eps = torch.finfo(x.dtype).eps
    bound = eps * (ref.abs() + g * scale) + g * scale
    err = (y.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3g}, {worst:.2f} x the bound"


def _dtypes(use_dot):
    bf16 = torch.bfloat16
    if use_dot and INTERPRETED:
        bf16 = pytest.param(torch.bfloat16, marks=pytest.mark.skip(reason=BF16_DOT))
    return [torch.float16, bf16]


# (N, K): N a multiple of no block, K a multiple of 8 but of no chunk; even blocks; K not a multiple of 8.
SHAPES = [(40, 72), (96, 256), (24, 100)]
ROWS = [1, 2, 3, 5, 8, 16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_default_config_matches_float64(m, n, k, dtype):
    if dtype == torch.bfloat16 and INTERPRETED and small_m_linear_config(m, n, k).use_dot:
        pytest.skip(BF16_DOT)
    x, w, b = _inputs(m, n, k, dtype, bias=(m + n) % 2 == 1, seed=m * 1000 + n)
    _check_close(small_m_linear(x, w, b), x, w, b)


# Each path forced at every row count; split into uneven (3) and even (2) K slices; the bias added by the main
# kernel and by the split reduction.
def _forced(use_dot, split_k):
    return SmallMLinearConfig(block_n=16, block_k=32, split_k=split_k, num_warps=4, num_stages=2, use_dot=use_dot)


@pytest.mark.parametrize("config,bias", [(_forced(False, 1), True), (_forced(False, 3), False)],
                         ids=["split1-bias", "split3"])
@pytest.mark.parametrize("dtype", _dtypes(use_dot=False))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])  # beyond 8 rows the broadcast path is never chosen
def test_broadcast_path(m, dtype, config, bias):
    x, w, b = _inputs(m, 40, 200, dtype, bias, seed=m)
    _check_close(small_m_linear(x, w, b, config=config), x, w, b)


@pytest.mark.parametrize("config,bias", [(_forced(True, 1), False), (_forced(True, 2), True)],
                         ids=["split1", "split2-bias"])
@pytest.mark.parametrize("dtype", _dtypes(use_dot=True))
@pytest.mark.parametrize("m", ROWS)
def test_dot_path(m, dtype, config, bias):
    x, w, b = _inputs(m, 40, 200, dtype, bias, seed=m)
    _check_close(small_m_linear(x, w, b, config=config), x, w, b)


def test_strided_rows_of_x():
    """Rows of ``x`` a wider tensor's views (a fused projection's columns): the row stride is honoured."""
    x_wide, w, b = _inputs(3, 24, 160, torch.float16, bias=True)
    x = x_wide[:, 32:]
    assert not x.is_contiguous()
    _check_close(small_m_linear(x, w[:, 32:].contiguous(), b), x, w[:, 32:], b)


def test_refuses_bad_input():
    x, w, _ = _inputs(2, 8, 16, torch.float16, bias=False)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        small_m_linear(x.float(), w.float())
    with pytest.raises(ValueError, match="features"):
        small_m_linear(x[:, :8], w)
    with pytest.raises(ValueError, match="contiguous along K"):
        small_m_linear(x, w.t().contiguous().t())
    big = torch.zeros(MAX_ROWS + 1, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        small_m_linear(big, w)


LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
            "lm_head": (128256, 4096)}


@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 16])
def test_config_for_llama_shapes(m):
    """Every Llama-3.1-8B projection gets a launch the kernel accepts, filling 132 SMs at least once (with
    the split; half of them on the tl.dot path, whose partial wave beats a split) and never splitting K into
    slices shorter than a chunk; tl.dot above two rows, and at two rows for the products of at least 66
    blocks of 64 weight rows (q/k/v, gate/up, the LM head)."""
    for n, k in LLAMA_8B.values():
        for prologue in (PROLOGUE_NONE, PROLOGUE_RMS_NORM, PROLOGUE_SILU_MUL) if m == 1 else (PROLOGUE_NONE,):
            cfg = small_m_linear_config(m, n, k, num_sms=132, prologue=prologue)
            cfg.check(m)
            programs = -(-n // cfg.block_n) * cfg.split_k
            assert programs >= (66 if cfg.use_dot else 132), (m, n, k, cfg)
            assert cfg.k_per_split(k) >= cfg.block_k
            assert cfg.use_dot == (m > 2 or (m == 2 and -(-n // 64) >= 66))  # wide products from 2 rows
            if prologue == PROLOGUE_RMS_NORM:
                assert cfg.split_k == 1  # 1 / rms scales whole sums over K


@gpu_only
@pytest.mark.parametrize("name", sorted(LLAMA_8B))
def test_llama_8b_shapes_on_gpu(name):
    """The default launch at every row count (broadcast, tl.dot, split where the rule splits) on the 8B shapes."""
    n, k = LLAMA_8B[name]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    _, w, b = _inputs(1, n, k, torch.bfloat16, bias=name == "qkv")
    for m in (1, 2, 3, 4, 5, 8, 16):
        x, _, _ = _inputs(m, 1, k, torch.bfloat16, bias=False, seed=m)
        _check_close(small_m_linear(x, w, b, num_sms=num_sms), x, w, b)


GRAPH_CONFIGS = [None, SmallMLinearConfig(block_n=16, block_k=256, split_k=4, num_warps=4, num_stages=3,
                                            use_dot=True)]


@gpu_only
@pytest.mark.parametrize("config", GRAPH_CONFIGS, ids=["default", "split4"])
@pytest.mark.parametrize("m", [1, 8])
def test_cuda_graph_replay_on_gpu(m, config):
    """A captured launch (split-K with its second kernel included) replays to the eager result bit for bit:
    the same kernels, the same summation order."""
    x, w, b = _inputs(m, 4096, 4096, torch.bfloat16, bias=True)
    eager = small_m_linear(x, w, b, config=config)
    static_x = torch.zeros_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        small_m_linear(static_x, w, b, config=config)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = small_m_linear(static_x, w, b, config=config)
    static_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, eager)

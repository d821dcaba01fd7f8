"""The routed experts' kernel (kvforge/kernels/triton_expert_gemm.py) against a float64 loop over rows.

Tolerance per output element, as for the small-M linear kernel (tests/test_small_m_linear.py): products
of two 16-bit values are exact in float32, the sum of ``K`` of them in any order is within ``g * S``
(``S = |a| @ |w|.T``, ``g = 4 * (K + 1) * 2^-24``), and the one rounding to the dtype moves the value by
at most ``eps * |value|``: ``|y - ref| <= eps * (|ref| + g S) + g S``.

Runs compiled on CUDA, or in Triton's CPU interpreter elsewhere at small shapes, in float16 there
(the interpreter's bfloat16 ``tl.dot`` multiplies bit patterns).
"""

from __future__ import annotations

import pytest
import torch
from triton_kernel_device import DEVICE, INTERPRETED, requires_kernels, skip_unless_loaded_loop_bounds_work

from kvforge.kernels.triton_expert_gemm import expert_gemm, programs_by_position

pytestmark = requires_kernels

DTYPES = [torch.float16] if INTERPRETED else [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _loop_bounds():
    skip_unless_loaded_loop_bounds_work()  # the row loop runs between loaded offsets


def _case(counts, n, k, dtype, tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = len(counts)
    weight = torch.randn(e, n, k, generator=g).to(dtype)
    a = torch.randn(tokens, k, generator=g).to(dtype)
    rows = sum(counts)
    src = torch.randint(0, tokens, (rows,), generator=g)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    experts = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    return a, weight, offs, src, experts


def _check(got, a_rows, weight, experts, dtype, bias=None, input_ulps=0):
    """With ``bias``, its value joins the float32 sum exactly once: one more addition in the error bound.
    ``input_ulps``: each input value may sit that many roundings of the dtype away from ``a_rows`` (the
    kernel computes it), which moves the sum by up to ``input_ulps * eps * S``."""
    k = weight.shape[2]
    w = weight[experts].double()  # [rows, N, K]
    ref = torch.einsum("rk,rnk->rn", a_rows.double(), w)
    s = torch.einsum("rk,rnk->rn", a_rows.double().abs(), w.abs())
    if bias is not None:
        ref = ref + bias[experts].double()
        s = s + bias[experts].double().abs()
    gamma = 4 * (k + 1) * 2.0 ** -24
    eps = torch.finfo(dtype).eps
    bound = eps * (ref.abs() + gamma * s) + gamma * s + input_ulps * eps * s
    err = (got.double() - ref).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts,n,k", [
    ([3, 0, 5, 1], 48, 64),  # an expert without rows; N a multiple of the 16-row blocks, K of the chunk
    ([20, 2, 0, 7], 40, 40),  # 20 rows: two blocks of 16; N and K with ragged ends
    ([1], 16, 16),
])
def test_gathered_rows_match_a_float64_loop(dtype, counts, n, k):
    a, weight, offs, src, experts = _case(counts, n, k, dtype, tokens=9)
    got = expert_gemm(a.to(DEVICE), weight.to(DEVICE), offs.to(DEVICE), src.to(DEVICE)).cpu()
    assert got.shape == (sum(counts), n) and got.dtype == dtype
    _check(got, a[src], weight, experts, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_in_sorted_order_without_gather(dtype):
    counts = [2, 17, 0, 4]
    a, weight, offs, _, experts = _case(counts, 32, 48, dtype, tokens=sum(counts), seed=1)
    got = expert_gemm(a.to(DEVICE), weight.to(DEVICE), offs.to(DEVICE)).cpu()
    _check(got, a, weight, experts, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_expert_bias_is_added_before_the_rounding(dtype):
    counts = [4, 0, 18, 3]
    a, weight, offs, src, experts = _case(counts, 40, 48, dtype, tokens=7, seed=3)
    bias = torch.randn(len(counts), 40, generator=torch.Generator().manual_seed(4)).mul(4).to(dtype)
    got = expert_gemm(a.to(DEVICE), weight.to(DEVICE), offs.to(DEVICE), src.to(DEVICE), bias=bias.to(DEVICE)).cpu()
    _check(got, a[src], weight, experts, dtype, bias)
    with pytest.raises(ValueError, match="bias must be"):
        expert_gemm(a.to(DEVICE), weight.to(DEVICE), offs.to(DEVICE), src.to(DEVICE), bias=bias[:, :8].to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gather", [False, True])
def test_silu_and_mul_prologue_matches_pytorchs_activation(dtype, gather):
    """The rows are ``[gate | up]``; the reference multiplies PyTorch's ``F.silu(gate) * up`` in the dtype
    (each value rounded twice, as the kernel rounds it), so the kernel's values may differ from it only where
    its hardware ``exp`` moves a rounding: at most one ulp of the dtype per input value."""
    counts = [5, 0, 17, 2]
    k = 40  # ragged against the K chunk: the up half starts mid-chunk
    a, weight, offs, src, experts = _case(counts, 24, k, dtype, tokens=sum(counts), seed=5)
    gate_up = torch.randn(sum(counts), 2 * k, generator=torch.Generator().manual_seed(6)).mul(3).to(dtype)
    rows = gate_up[src] if gather else gate_up
    h = torch.nn.functional.silu(rows[:, :k]) * rows[:, k:]
    got = expert_gemm(gate_up.to(DEVICE), weight.to(DEVICE), offs.to(DEVICE), src.to(DEVICE) if gather else None,
                      silu_mul=True).cpu()
    assert got.shape == (sum(counts), 24)
    _check(got, h, weight, experts, dtype, input_ulps=1)
    with pytest.raises(ValueError, match=r"\[gate \| up\]"):
        expert_gemm(gate_up[:, :k].to(DEVICE), weight.to(DEVICE), offs.to(DEVICE), silu_mul=True)


def test_positions_past_the_last_offset_are_left_alone():
    """Slots held by another rank sort past ``offs[-1]``: their rows are neither read nor written."""
    dtype = torch.float16
    counts = [2, 3]
    a, weight, offs, src, experts = _case(counts, 16, 32, dtype, tokens=6, seed=2)
    src = torch.cat([src, torch.tensor([10**6, 10**6])])  # out-of-range sources: a read would fault
    got = expert_gemm(a.to(DEVICE), weight.to(DEVICE), offs.to(DEVICE), src.to(DEVICE)).cpu()
    assert got.shape == (7, 16)
    _check(got[:5], a[src[:5]], weight, experts, dtype)


@pytest.mark.parametrize("gather", [False, True])
def test_a_program_per_position_where_positions_are_fewer_than_experts(gather):
    """40 experts, 7 positions in 4 of them (one of two blocks' worth): each expert's rows computed once
    from the program at its first position; the other programs find no rows."""
    dtype = torch.float16
    counts = [0] * 40
    counts[3], counts[17], counts[18], counts[39] = 2, 1, 3, 1
    a, weight, offs, src, experts = _case(counts, 24, 40, dtype, tokens=sum(counts), seed=7)
    assert programs_by_position(sum(counts), 40)
    got = expert_gemm(a.to(DEVICE), weight.to(DEVICE), offs.to(DEVICE), src.to(DEVICE) if gather else None,
                      num_rows=sum(counts), expert=experts.to(DEVICE)).cpu()
    _check(got, a[src] if gather else a, weight, experts, dtype)


def test_positions_with_shared_experts_and_rows_held_elsewhere():
    """24 routed experts and 2 folded shared ones, 3 tokens of top-2: 6 routed positions, 6 shared ones,
    then 2 held by another rank (id 26, past ``offs[-1]``, never read or written): 14 positions, fewer
    than the routed experts, so a program per position; the shared experts keep their row-block programs."""
    dtype = torch.float16
    g = torch.Generator().manual_seed(8)
    weight = torch.randn(26, 32, 48, generator=g).to(dtype)
    a = torch.randn(3, 48, generator=g).to(dtype)
    routed = torch.tensor([2, 2, 9, 15, 15, 23])
    experts = torch.cat([routed, torch.full((3,), 24), torch.full((3,), 25), torch.full((2,), 26)])
    src = torch.cat([torch.tensor([0, 2, 1, 0, 1, 2]), torch.arange(3), torch.arange(3), torch.tensor([10**6] * 2)])
    counts = torch.bincount(experts[:12], minlength=26)
    offs = counts.cumsum(0).to(torch.int32)
    got = expert_gemm(a.to(DEVICE), weight.to(DEVICE), offs.to(DEVICE), src.to(DEVICE), expert=experts.to(DEVICE),
                      shared_experts=2, shared_rows=3).cpu()
    assert got.shape == (14, 32)
    _check(got[:12], a[src[:12]], weight, experts[:12], dtype)
    with pytest.raises(ValueError, match="one id per position"):
        expert_gemm(a.to(DEVICE), weight.to(DEVICE), offs.to(DEVICE), src.to(DEVICE), expert=experts[:5].to(DEVICE))


def test_bad_inputs_are_refused():
    a = torch.zeros(4, 8, dtype=torch.float16)
    w = torch.zeros(2, 16, 8, dtype=torch.float16)
    offs = torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="one dtype"):
        expert_gemm(a.float(), w.float(), offs)
    with pytest.raises(ValueError, match=r"weight \[E, N, K\]"):
        expert_gemm(a, w[:, :, :4], offs)
    with pytest.raises(ValueError, match="offs must be"):
        expert_gemm(a, w, offs[:1])

"""The split-K merge kernel (``triton_paged_attention.merge_split_partials``) against a float64 merge: up
to 256 splits x 512 columns (the MLA decode's batch-1 case, columns spread over several programs), and
splits with no token (max -inf, sum 0) whose accumulator rows hold NaN, as when a split-K kernel leaves
them unwritten: they must not reach the output. Compiled on a GPU, interpreted on CPU elsewhere
(tests/triton_kernel_device.py). Bound: 1e-5 of max|out|, float32 sums of at most 256 terms."""

from __future__ import annotations

import pytest
import torch
from triton_kernel_device import DEVICE, requires_kernels

from kvforge.kernels.triton_paged_attention import merge_split_partials

pytestmark = requires_kernels


@pytest.mark.parametrize(
    "t,h,s,d,d_pad,empty_every,seed",
    [
        (3, 2, 128, 512, 512, 3, 0),  # 128 splits: 64 columns per program, 8 programs per (token, head)
        (2, 2, 256, 512, 512, 3, 0),  # 256 (the wgmma MLA cap): 32 columns per program, 16 programs
        (2, 1, 256, 512, 512, 1, 4),  # 256 splits, all but one empty (a short sequence under a pinned graph)
        (2, 1, 64, 512, 512, 5, 2),
        (3, 4, 5, 96, 128, 2, 1),  # GQA-like: D 96 padded to 128, one program per (token, head)
    ],
)
def test_merge_many_splits_and_empty_splits(t, h, s, d, d_pad, empty_every, seed):
    g = torch.Generator().manual_seed(seed)
    acc = torch.randn(t, h, s, d_pad, generator=g)
    ml = torch.stack([torch.randn(t, h, s, generator=g) * 4, torch.rand(t, h, s, generator=g) + 0.5], -1)
    empty = torch.zeros(t, h, s, dtype=torch.bool)
    empty[..., ::empty_every] = True
    empty[..., 1] = False
    ml[..., 0][empty] = float("-inf")
    ml[..., 1][empty] = 0.0
    acc[empty] = float("nan")
    qsl = torch.tensor([0, t - 1], dtype=torch.int32)  # one sequence of t - 1 tokens; the last is padding
    out = torch.full((t, h, d), 7.0, device=DEVICE)
    merge_split_partials(acc.to(DEVICE), ml.to(DEVICE), out, qsl.to(DEVICE), 1)
    out = out.cpu()
    m = ml[..., 0].double()
    w = torch.where(empty, 0.0, torch.exp2(m - m.amax(-1, keepdim=True)))
    a = torch.where(empty[..., None], 0.0, acc.double())
    want = (a[..., :d] * w[..., None]).sum(2) / (ml[..., 1].double() * w).sum(2)[..., None]
    err = (out[: t - 1].double() - want[: t - 1]).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err
    assert torch.all(out[t - 1] == 7.0), "the padding token's row was written"


def test_partials_in_register_order_land_in_their_columns():
    """``out_columns``: partial column d is output column out_columns[d] (the warp-specialized MLA kernel stores
    its accumulators in register order); the merged values equal the float64 merge, permuted."""
    t, h, s, d = 2, 3, 8, 512
    g = torch.Generator().manual_seed(7)
    acc = torch.randn(t, h, s, d, generator=g)
    ml = torch.stack([torch.randn(t, h, s, generator=g) * 4, torch.rand(t, h, s, generator=g) + 0.5], -1)
    cols = torch.randperm(d, generator=g).to(torch.int32)
    qsl = torch.tensor([0, t], dtype=torch.int32)
    out = torch.zeros((t, h, d), device=DEVICE)
    merge_split_partials(acc.to(DEVICE), ml.to(DEVICE), out, qsl.to(DEVICE), 1, out_columns=cols.to(DEVICE))
    w = torch.exp2(ml[..., 0].double() - ml[..., 0].double().amax(-1, keepdim=True))
    merged = (acc.double() * w[..., None]).sum(2) / (ml[..., 1].double() * w).sum(2)[..., None]
    want = torch.empty_like(merged)
    want[..., cols.long()] = merged
    assert (out.cpu().double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()

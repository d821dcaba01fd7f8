"""Triton kernels: a MoE router's softmax over the experts, its top-k, the optional renormalisation and scale,
in one launch per step (PyTorch takes three to five: softmax, topk, sum, divide or multiply); and the same
with the router's float32 product in that launch (:func:`linear_softmax_topk`).

One program per token loads the ``E`` logits, takes ``p = exp(x - max) / sum`` in float32, then picks the
largest ``k`` probabilities one at a time (a maximum, then the lowest expert index holding it: ties go to
the lower index), so ``ids[t]`` is in descending order of probability as ``torch.topk`` returns it. With
``renormalize`` the ``k`` chosen are divided by their sum; then they are multiplied by ``scale``.
Numerics: float32 throughout; ``exp`` may differ from PyTorch's in the last bit, so weights agree with
the PyTorch reference (kvforge/models/router_topk.py) to a few float32 ulps, not bit for bit.
"""

from __future__ import annotations

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

#: The most experts one program holds in registers.
MAX_EXPERTS = 4096

if HAS_TRITON:

    @triton.jit
    def _store_topk(x, e, t, weights_ptr, ids_ptr, E, scale,
                    K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
        """Softmax of token ``t``'s float32 logits ``x`` (``[E_PAD]``, lanes ``e >= E`` ignored), its top-``K``
        in descending order (ties to the lower index), renormalised and scaled, stored at row ``t``."""
        x = tl.where(e < E, x, float("-inf"))
        p = tl.exp(x - tl.max(x, 0))  # padding lanes: exp(-inf) = 0
        p = p / tl.sum(p, 0)
        p = tl.where(e < E, p, -1.0)  # never chosen
        slot = tl.arange(0, K_PAD)
        chosen = tl.zeros([K_PAD], dtype=tl.float32)
        chosen_ids = tl.zeros([K_PAD], dtype=tl.int64)
        for j in tl.static_range(K):
            best = tl.max(p, 0)
            idx = tl.min(tl.where(p == best, e, E_PAD), 0)
            chosen = tl.where(slot == j, best, chosen)
            chosen_ids = tl.where(slot == j, idx.to(tl.int64), chosen_ids)
            p = tl.where(e == idx, -1.0, p)
        if RENORMALIZE:
            chosen = chosen / tl.sum(tl.where(slot < K, chosen, 0.0), 0)
        tl.store(weights_ptr + t * K + slot, chosen * scale, mask=slot < K)
        tl.store(ids_ptr + t * K + slot, chosen_ids, mask=slot < K)

    @triton.jit
    def _softmax_topk_kernel(
        logits_ptr, weights_ptr, ids_ptr, E, stride_t, scale,
        K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, E_PAD)
        x = tl.load(logits_ptr + t * stride_t + e, mask=e < E, other=float("-inf")).to(tl.float32)
        _store_topk(x, e, t, weights_ptr, ids_ptr, E, scale, K, K_PAD, E_PAD, RENORMALIZE)

    @triton.jit
    def _linear_softmax_topk_kernel(
        x_ptr, w_ptr, weights_ptr, ids_ptr, E, stride_xt, stride_we, scale,
        H: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
        RENORMALIZE: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, E_PAD)
        e_ok = e < E
        acc = tl.zeros([E_PAD], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            h_ok = h < H
            xv = tl.load(x_ptr + t * stride_xt + h, mask=h_ok, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + e[:, None].to(tl.int64) * stride_we + h[None, :],
                         mask=e_ok[:, None] & h_ok[None, :], other=0.0)
            acc += tl.sum(wv * xv[None, :], axis=1)
        _store_topk(acc, e, t, weights_ptr, ids_ptr, E, scale, K, K_PAD, E_PAD, RENORMALIZE)


def _outputs(t: int, e: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    if not HAS_TRITON:
        raise RuntimeError("the router kernels need triton")
    if not 0 < k <= e or e > MAX_EXPERTS:
        raise ValueError(f"top-{k} of {e} experts: need 0 < k <= E <= {MAX_EXPERTS}")
    return (torch.empty((t, k), dtype=torch.float32, device=device),
            torch.empty((t, k), dtype=torch.int64, device=device))


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool, scale: float = 1.0):
    """``(weights float32 [T, k], ids int64 [T, k])`` of ``logits [T, E]`` (see the module docstring)."""
    if logits.dim() != 2 or not logits.is_floating_point() or logits.stride(1) != 1:
        raise ValueError(f"logits must be a float [T, E] tensor contiguous along E, got {tuple(logits.shape)}")
    t, e = logits.shape
    weights, ids = _outputs(t, e, k, logits.device)
    if t:
        e_pad = triton.next_power_of_2(e)
        _softmax_topk_kernel[(t,)](
            logits, weights, ids, e, logits.stride(0), float(scale),
            K=k, K_PAD=triton.next_power_of_2(k), E_PAD=e_pad, RENORMALIZE=renormalize,
            num_warps=4 if e_pad <= 1024 else 8,
        )  # fmt: skip
    return weights, ids


#: Hidden features one program multiplies at a time in :func:`linear_softmax_topk` (with up to 64 experts,
#: a 64 x 128 float32 weight tile: 64 registers a thread at 4 warps; more experts, fewer features).
ROUTER_BLOCK_H = 128
#: The most experts :func:`linear_softmax_topk` takes (a 512 x 16 weight tile at most).
PRODUCT_MAX_EXPERTS = 512


def linear_softmax_topk(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool, scale: float = 1.0):
    """:func:`softmax_topk` of the float32 logits ``x @ weight.T`` (``x [T, H]`` in any float dtype, read as
    float32; ``weight [E, H]`` float32), the product in the same launch: one program a token sums
    ``x[h] * weight[e, h]`` in float32 over ``ROUTER_BLOCK_H``-wide chunks of ``h``, so its logits differ
    from another float32 product's only by the order of the sum (a few ulps of ``sum |x w|``)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [T, H] and [E, H]")
    if weight.dtype != torch.float32 or not x.is_floating_point():
        raise ValueError(f"weight must be float32 and x floating point, got {weight.dtype} and {x.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last (hidden) axis")
    (t, h), e = x.shape, weight.shape[0]
    if e > PRODUCT_MAX_EXPERTS:
        raise ValueError(f"{e} experts: the router product takes at most {PRODUCT_MAX_EXPERTS}")
    weights, ids = _outputs(t, e, k, x.device)
    if t:
        e_pad = triton.next_power_of_2(e)
        block_h = max(16, min(ROUTER_BLOCK_H, 8192 // e_pad, triton.next_power_of_2(h)))
        _linear_softmax_topk_kernel[(t,)](
            x, weight, weights, ids, e, x.stride(0), weight.stride(0), float(scale),
            H=h, K=k, K_PAD=triton.next_power_of_2(k), E_PAD=e_pad, BLOCK_H=block_h, RENORMALIZE=renormalize,
            num_warps=4,
        )  # fmt: skip
    return weights, ids

"""Triton kernel: a MoE router's softmax over the experts, its top-k, the optional renormalisation and scale,
in one launch per step (PyTorch takes three to five: softmax, topk, sum, divide or multiply).

One program per token loads the ``E`` logits, takes ``p = exp(x - max) / sum`` in float32, then picks the
largest ``k`` probabilities one at a time (a maximum, then the lowest expert index holding it: ties go to
the lower index), so ``ids[t]`` is in descending order of probability as ``torch.topk`` returns it. With
``renormalize`` the ``k`` chosen are divided by their sum; then they are multiplied by ``scale``. With
``shared = S`` the rows are ``k + S`` wide: slots ``k .. k + S - 1`` hold the ids ``E .. E + S - 1`` with
weight exactly 1 (shared experts folded behind the routed ones, kvforge/models/shared_expert_fold.py).
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
    def _softmax_topk_kernel(
        logits_ptr, weights_ptr, ids_ptr, E, stride_t, scale,
        K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
        SHARED: tl.constexpr, SHARED_PAD: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, E_PAD)
        x = tl.load(logits_ptr + t * stride_t + e, mask=e < E, other=float("-inf")).to(tl.float32)
        store_softmax_topk(x, e, t, weights_ptr, ids_ptr, E, scale, K, K_PAD, E_PAD, RENORMALIZE, SHARED,
                            SHARED_PAD)

    @triton.jit
    def store_softmax_topk(
        x, e, t, weights_ptr, ids_ptr, E, scale,
        K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
        SHARED: tl.constexpr, SHARED_PAD: tl.constexpr,
    ):  # fmt: skip
        """Row ``t``'s choice from its float32 logits ``x [E_PAD]`` (lanes ``e >= E`` hold -inf): the weights
        and ids of the module docstring, stored at ``weights_ptr`` / ``ids_ptr`` (rows ``K + SHARED`` wide)."""
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
        width = K + SHARED
        tl.store(weights_ptr + t * width + slot, chosen * scale, mask=slot < K)
        tl.store(ids_ptr + t * width + slot, chosen_ids, mask=slot < K)
        if SHARED > 0:
            extra = tl.arange(0, SHARED_PAD)
            tl.store(weights_ptr + t * width + K + extra, tl.full(extra.shape, 1.0, tl.float32), mask=extra < SHARED)
            tl.store(ids_ptr + t * width + K + extra, (E + extra).to(tl.int64), mask=extra < SHARED)


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool, scale: float = 1.0, shared: int = 0):
    """``(weights float32 [T, k + shared], ids int64 [T, k + shared])`` of ``logits [T, E]`` (see the module
    docstring)."""
    if not HAS_TRITON:
        raise RuntimeError("softmax_topk needs triton")
    if logits.dim() != 2 or not logits.is_floating_point() or logits.stride(1) != 1:
        raise ValueError(f"logits must be a float [T, E] tensor contiguous along E, got {tuple(logits.shape)}")
    t, e = logits.shape
    if not 0 < k <= e or e > MAX_EXPERTS:
        raise ValueError(f"top-{k} of {e} experts: need 0 < k <= E <= {MAX_EXPERTS}")
    if shared < 0:
        raise ValueError(f"shared slots must be >= 0, got {shared}")
    weights = torch.empty((t, k + shared), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, k + shared), dtype=torch.int64, device=logits.device)
    if t:
        e_pad = triton.next_power_of_2(e)
        _softmax_topk_kernel[(t,)](
            logits, weights, ids, e, logits.stride(0), float(scale),
            K=k, K_PAD=triton.next_power_of_2(k), E_PAD=e_pad, RENORMALIZE=renormalize, SHARED=shared,
            SHARED_PAD=triton.next_power_of_2(max(shared, 1)),
            num_warps=4 if e_pad <= 1024 else 8,
        )  # fmt: skip
    return weights, ids

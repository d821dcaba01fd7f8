"""Triton kernel: a MoE router's float32 logits and its softmax top-k in one launch, for a few tokens.

A decode step of one to ``MAX_ROWS`` tokens routes each MoE layer through four launches in PyTorch: the
cast of ``x`` to float32, a float32 product that cuBLAS splits over the hidden size (a product and a
reduction) and the choice kernel (kvforge/kernels/triton_router_topk.py). Here one launch does it all:

- grid ``E``: each program computes ``logits[t, e] = sum_h x[t, h] * weight[e, h]`` for every token and
  its expert (one weight row, read once), ``x`` converted to float32 in registers (exact for 16-bit inputs),
  products and sums in float32 (no tensor cores: the router's float32 semantics), and stores them in a
  float32 scratch ``[T, E]``;
- each program then takes a ticket from ``counter`` (an atomic add after a barrier, so the program's stores
  come first); the program holding the last ticket reads every logit back past L1 and runs the router's
  choice (:func:`kvforge.kernels.triton_router_topk.store_router_choice`: softmax or sigmoid scores, the
  bias, the expert groups, the top-k) for all tokens at once (each reduction over a ``[tokens, E]``
  tile), then resets ``counter`` to 0 for the next launch.

Numerics: the logits are float32 sums as in ``F.linear(x.float(), weight.float())``, in another order (they
agree to a few float32 ulps of the sum of |products|); the choice is then the choice kernel's. The counter is
one int32 per call site (a router layer owns its own), zero between launches; launches sharing a counter
must not overlap (one stream). No host synchronization: safe inside CUDA-graph capture.
"""

from __future__ import annotations

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

#: The most tokens one launch routes (the last program holds their logits in one tile).
MAX_ROWS = 8
#: The most experts (the last program holds a token's logits in registers).
MAX_EXPERTS = 1024
#: Elements of the ``[rows, hidden chunk]`` tile a program multiplies at once (64 float32 a thread).
TILE_ELEMENTS = 8192

if HAS_TRITON:
    from kvforge.kernels.triton_router_topk import choice_constexprs, store_router_choice

    @triton.jit
    def _router_logits_topk_kernel(
        x_ptr, w_ptr, bias_ptr, logits_ptr, weights_ptr, ids_ptr, counter_ptr, T, E, stride_xt, stride_we, scale,
        H: tl.constexpr, T_PAD: tl.constexpr, BLOCK_H: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
        E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, SHARED: tl.constexpr, SHARED_PAD: tl.constexpr,
        SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr, N_GROUP_PAD: tl.constexpr,
        GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr, RENORM_EPS: tl.constexpr,
        GATED_SHARED: tl.constexpr,
    ):  # fmt: skip
        expert = tl.program_id(0)
        rows = tl.arange(0, T_PAD)
        cols = tl.arange(0, BLOCK_H)
        acc = tl.zeros([T_PAD], dtype=tl.float32)
        for h0 in tl.range(0, H, BLOCK_H):
            h = h0 + cols
            w = tl.load(w_ptr + expert.to(tl.int64) * stride_we + h, mask=h < H, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xt + h[None, :],
                        mask=(rows[:, None] < T) & (h[None, :] < H), other=0.0).to(tl.float32)
            acc += tl.sum(x * w[None, :], axis=1)
        tl.store(logits_ptr + rows * E + expert, acc, mask=rows < T)
        tl.debug_barrier()  # every thread's logits are stored before the ticket is taken
        ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) - 1:
            e = tl.arange(0, E_PAD)
            row_ok = rows < T
            source = tl.minimum(rows, T - 1)  # padding rows repeat the last token (finite; never stored)
            tile = tl.load(logits_ptr + source[:, None] * E + e[None, :], mask=(e < E)[None, :], other=float("-inf"),
                           cache_modifier=".cg")
            store_router_choice(tile, e, source.to(tl.int64), row_ok, logits_ptr, E, bias_ptr, weights_ptr, ids_ptr,
                                E, scale, K, K_PAD, E_PAD, RENORMALIZE, SHARED, SHARED_PAD, SIGMOID, HAS_BIAS,
                                N_GROUP, N_GROUP_PAD, GROUP_SIZE, TOPK_GROUP, GROUP_TOP2, RENORM_EPS, GATED_SHARED)
            tl.store(counter_ptr, 0)


def hidden_block(rows: int, hidden: int) -> int:
    """The hidden-size chunk: the whole hidden size where ``rows x hidden`` fits ``TILE_ELEMENTS`` (one pass
    over the weight row), else the largest power of two that does."""
    return min(triton.next_power_of_2(hidden), max(16, TILE_ELEMENTS // triton.next_power_of_2(rows)))


def router_logits_topk(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool, scale: float,
                       shared: int, counter: torch.Tensor, *, bias: torch.Tensor | None = None, sigmoid: bool = False,
                       n_group: int = 1, topk_group: int = 1, group_top2: bool = False,
                       renorm_eps: float = 0.0, gated_shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32 [T, k + shared], ids int64 [T, k + shared])`` of the router ``weight [E, H]`` over
    ``x [T, H]`` (``T <= MAX_ROWS``): the module docstring; the rule's arguments are
    :func:`kvforge.kernels.triton_router_topk.router_topk`'s. ``counter``: int32 [1], zero, on ``x``'s device."""
    if not HAS_TRITON:
        raise RuntimeError("router_logits_topk needs triton")
    if gated_shared:
        raise ValueError("router_logits_topk weighs shared slots 1; a shared gate takes the two-step route")
    t, h = x.shape
    e = weight.shape[0]
    if not 0 < t <= MAX_ROWS:
        raise ValueError(f"router_logits_topk routes 1 to {MAX_ROWS} tokens, got {t}")
    if weight.shape[1] != h or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must share a contiguous hidden size")
    if e > MAX_EXPERTS:
        raise ValueError(f"router_logits_topk holds at most {MAX_EXPERTS} experts, got {e}")
    consts = choice_constexprs(k, renormalize, shared, e, sigmoid=sigmoid, has_bias=bias is not None,
                               n_group=n_group, topk_group=topk_group, group_top2=group_top2, renorm_eps=renorm_eps)
    if bias is not None and (bias.shape != (e,) or bias.device != x.device or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [E] = [{e}] on x's device, got {tuple(bias.shape)}")
    if counter.dtype != torch.int32 or counter.numel() != 1 or counter.device != x.device:
        raise ValueError("counter must be one int32 on x's device")
    logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
    weights = torch.empty((t, k + shared), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, k + shared), dtype=torch.int64, device=x.device)
    _router_logits_topk_kernel[(e,)](
        x, weight, bias if bias is not None else weight, logits, weights, ids, counter, t, e, x.stride(0),
        weight.stride(0), float(scale), H=h, T_PAD=triton.next_power_of_2(t), BLOCK_H=hidden_block(t, h),
        num_warps=4 if triton.next_power_of_2(t) * consts["E_PAD"] <= 2048 else 8, **consts,
    )  # fmt: skip
    return weights, ids

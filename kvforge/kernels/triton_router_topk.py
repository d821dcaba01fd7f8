"""Triton kernel: a MoE router's choice from its float32 logits in one launch per step (PyTorch takes three
to fifteen: softmax or sigmoid, the group scores and mask, topk, gather, sum, divide, multiply).

One program per token loads the ``E`` logits and applies the rule of
:class:`kvforge.models.router_topk.RouterRule` (:func:`store_router_choice`, which also serves several
rows at once in the one-launch kernel of kvforge/kernels/triton_router_logits_topk.py):

- scores ``s``: ``p = exp(x - max) / sum`` (softmax) or ``1 / (1 + exp(-x))`` (``SIGMOID``), float32;
- choice values ``c = s + bias`` (``HAS_BIAS``), else ``c = s``;
- with ``N_GROUP > 1`` groups of ``GROUP_SIZE`` experts: each group's score is its largest ``c``, or the sum
  of its two largest (``GROUP_TOP2``); the ``TOPK_GROUP`` best groups stay (ties to the lower group) and
  the other experts' ``c`` become ``-inf``;
- the ``k`` largest ``c`` one at a time (a maximum, then the lowest expert index holding it: ties go to the
  lower index), so ``ids[t]`` is in descending order as ``torch.topk`` returns it; the weights are the
  chosen experts' scores ``s``; with ``RENORMALIZE`` they are divided by their sum plus ``RENORM_EPS``;
  then they are multiplied by ``scale``.

With ``shared = S`` the rows are ``k + S`` wide: slots ``k .. k + S - 1`` hold the ids ``E .. E + S - 1``
with weight exactly 1 (shared experts folded behind the routed ones, kvforge/models/shared_expert_fold.py),
or with ``GATED_SHARED`` the sigmoid of logit column ``E`` (a shared MLP's own gate, Qwen3-Next).
Numerics: float32 throughout; ``exp`` may differ from PyTorch's in the last bit, so weights agree with the
PyTorch reference (kvforge/models/router_topk.py) to a few float32 ulps, not bit for bit; the group score
is one float32 addition, as in PyTorch. Choices compare the float32 values exactly (-0.0 equal to +0.0); a
NaN logit's choice is unspecified.
"""

from __future__ import annotations

import torch

from kvforge.kernels.optional_triton import HAS_TRITON, tl, triton

#: The most experts one program holds in registers.
MAX_EXPERTS = 4096
#: The most expert groups (each is one pass over the row).
MAX_GROUPS = 64

if HAS_TRITON:

    @triton.jit
    def _router_topk_kernel(
        logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, stride_t, scale,
        K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
        SHARED: tl.constexpr, SHARED_PAD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
        N_GROUP: tl.constexpr, N_GROUP_PAD: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
        GROUP_TOP2: tl.constexpr, RENORM_EPS: tl.constexpr, GATED_SHARED: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0).to(tl.int64) + tl.zeros([1], tl.int64)
        e = tl.arange(0, E_PAD)
        x = tl.load(logits_ptr + rows[:, None] * stride_t + e[None, :], mask=(e < E)[None, :],
                    other=float("-inf")).to(tl.float32)
        store_router_choice(x, e, rows, rows >= 0, logits_ptr, stride_t, bias_ptr, weights_ptr, ids_ptr, E,
                            scale, K, K_PAD, E_PAD, RENORMALIZE, SHARED, SHARED_PAD, SIGMOID, HAS_BIAS, N_GROUP,
                            N_GROUP_PAD, GROUP_SIZE, TOPK_GROUP, GROUP_TOP2, RENORM_EPS, GATED_SHARED)

    @triton.jit
    def _ordered_key(c, e, E_PAD: tl.constexpr):
        """int64 keys ordered as ``(c, -e)``: the float's bits made monotonic as a signed integer above, the
        reversed lane below, so one maximum gives the largest value and the lowest lane holding it."""
        c = tl.where(c == 0.0, 0.0, c)  # -0.0 keys as +0.0 (they compare equal)
        bits = c.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return (ordered.to(tl.int64) << 32) | (E_PAD - 1 - e).to(tl.int64)

    @triton.jit
    def _key_value(key):
        """The float32 a key of :func:`_ordered_key` holds."""
        ordered = (key >> 32).to(tl.int32)
        return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def store_router_choice(
        x, e, rows, row_ok, logits_ptr, stride_t, bias_ptr, weights_ptr, ids_ptr, E, scale,
        K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
        SHARED: tl.constexpr, SHARED_PAD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
        N_GROUP: tl.constexpr, N_GROUP_PAD: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
        GROUP_TOP2: tl.constexpr, RENORM_EPS: tl.constexpr, GATED_SHARED: tl.constexpr,
    ):  # fmt: skip
        """The choice of rows ``rows [R]`` (stored where ``row_ok``) from their float32 logits ``x [R, E_PAD]``
        (lanes ``e >= E`` hold -inf), which also lie at ``logits_ptr + row * stride_t``: the weights and ids
        of the module docstring, stored at ``weights_ptr`` / ``ids_ptr`` (rows ``K + SHARED`` wide). Every
        reduction runs over all ``R`` rows at once, and a choice is one maximum of :func:`_ordered_key`
        (value and lowest index together); the chosen experts' scores are recomputed from their logits."""
        KEY_MIN: tl.constexpr = -0x7FFFFFFFFFFFFFFF  # below the key of any float but a negative NaN
        valid = (e < E)[None, :]
        if SIGMOID:
            s = 1.0 / (1.0 + tl.exp(-x))
        else:
            top = tl.max(x, 1)
            s = tl.exp(x - top[:, None])  # padding lanes: exp(-inf) = 0
            total = tl.sum(s, 1)
            s = s / total[:, None]
        c = tl.where(valid, s, 0.0)
        if HAS_BIAS:
            c = c + tl.load(bias_ptr + e, mask=e < E, other=0.0).to(tl.float32)[None, :]
        c = tl.where(valid, c, float("-inf"))  # never chosen
        key = _ordered_key(c, e[None, :], E_PAD)
        if N_GROUP > 1:
            group = (e // GROUP_SIZE)[None, :]  # padding lanes fall past the last group
            g = tl.arange(0, N_GROUP_PAD)[None, :]
            group_score = tl.full([x.shape[0], N_GROUP_PAD], float("-inf"), tl.float32)
            for j in tl.static_range(N_GROUP):
                in_j = group == j
                if GROUP_TOP2 and GROUP_SIZE > 1:
                    first = tl.max(tl.where(in_j, key, KEY_MIN), 1)
                    second = tl.max(tl.where(in_j & (key != first[:, None]), c, float("-inf")), 1)
                    top_j = _key_value(first) + second
                else:
                    top_j = tl.max(tl.where(in_j, c, float("-inf")), 1)
                group_score = tl.where(g == j, top_j[:, None], group_score)
            keep = key < KEY_MIN  # all false
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.max(group_score, 1)
                kept = tl.min(tl.where(group_score == best[:, None], g, N_GROUP), 1)  # ties: the lower group
                keep = keep | (group == kept[:, None])
                group_score = tl.where(g == kept[:, None], float("-inf"), group_score)
            key = tl.where(keep, key, KEY_MIN)
        slot = tl.arange(0, K_PAD)[None, :]
        chosen_ids = tl.zeros([x.shape[0], K_PAD], dtype=tl.int64)
        for j in tl.static_range(K):
            best = tl.max(key, 1)
            chosen_ids = tl.where(slot == j, (E_PAD - 1 - best.to(tl.int32)).to(tl.int64)[:, None], chosen_ids)
            key = tl.where(key == best[:, None], KEY_MIN, key)  # keys are distinct: one lane
        in_k = row_ok[:, None] & (slot < K)
        picked = tl.load(logits_ptr + rows[:, None] * stride_t + chosen_ids, mask=in_k, other=0.0,
                         cache_modifier=".cg").to(tl.float32)  # other programs' stores in the one-launch kernel
        if SIGMOID:  # the same operations as the scores above, so the same float32
            chosen = 1.0 / (1.0 + tl.exp(-picked))
        else:
            chosen = tl.exp(picked - top[:, None]) / total[:, None]
        chosen = tl.where(slot < K, chosen, 0.0)
        if RENORMALIZE:
            chosen = chosen / (tl.sum(chosen, 1)[:, None] + RENORM_EPS)
        width = K + SHARED
        tl.store(weights_ptr + rows[:, None] * width + slot, chosen * scale, mask=in_k)
        tl.store(ids_ptr + rows[:, None] * width + slot, chosen_ids, mask=in_k)
        if SHARED > 0:
            extra = tl.arange(0, SHARED_PAD)[None, :]
            in_s = row_ok[:, None] & (extra < SHARED)
            if GATED_SHARED:  # every shared slot weighs the sigmoid of the logit after the experts'
                gate = tl.load(logits_ptr + rows * stride_t + E, mask=row_ok, other=0.0).to(tl.float32)
                shared_weight = tl.zeros([x.shape[0], SHARED_PAD], tl.float32) + (1.0 / (1.0 + tl.exp(-gate)))[:, None]
            else:
                shared_weight = tl.full([x.shape[0], SHARED_PAD], 1.0, tl.float32)
            tl.store(weights_ptr + rows[:, None] * width + K + extra, shared_weight, mask=in_s)
            tl.store(ids_ptr + rows[:, None] * width + K + extra,
                     (E + extra).to(tl.int64) + tl.zeros([x.shape[0], SHARED_PAD], tl.int64), mask=in_s)


def choice_constexprs(k: int, renormalize: bool, shared: int, experts: int, *, sigmoid: bool = False,
                      has_bias: bool = False, n_group: int = 1, topk_group: int = 1, group_top2: bool = False,
                      renorm_eps: float = 0.0, gated_shared: bool = False) -> dict:
    """The compile-time arguments of :func:`store_router_choice` for a rule over ``experts`` experts, checked:
    ``ValueError`` names a rule the kernel cannot run."""
    if not 0 < k <= experts or experts > MAX_EXPERTS:
        raise ValueError(f"top-{k} of {experts} experts: need 0 < k <= E <= {MAX_EXPERTS}")
    if shared < 0 or (gated_shared and not shared):
        raise ValueError(f"shared slots must be >= 0 (>= 1 with a shared gate), got {shared}")
    if not 1 <= topk_group <= n_group <= MAX_GROUPS or experts % n_group:
        raise ValueError(f"{experts} experts in {n_group} groups keeping {topk_group}: need equal groups and "
                         f"1 <= topk_group <= n_group <= {MAX_GROUPS}")
    group_size = experts // n_group
    if n_group > 1 and topk_group * group_size < k:
        raise ValueError(f"top-{k} from {topk_group} kept groups of {group_size} experts: too few experts kept")
    return dict(K=k, K_PAD=triton.next_power_of_2(k), E_PAD=triton.next_power_of_2(experts),
                RENORMALIZE=renormalize, SHARED=shared, SHARED_PAD=triton.next_power_of_2(max(shared, 1)),
                SIGMOID=sigmoid, HAS_BIAS=has_bias, N_GROUP=n_group, N_GROUP_PAD=triton.next_power_of_2(n_group),
                GROUP_SIZE=group_size, TOPK_GROUP=topk_group, GROUP_TOP2=group_top2,
                RENORM_EPS=float(renorm_eps), GATED_SHARED=gated_shared)


def router_topk(logits: torch.Tensor, k: int, renormalize: bool, scale: float = 1.0, shared: int = 0, *,
                bias: torch.Tensor | None = None, sigmoid: bool = False, n_group: int = 1, topk_group: int = 1,
                group_top2: bool = False, renorm_eps: float = 0.0,
                gated_shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32 [T, k + shared], ids int64 [T, k + shared])`` of ``logits [T, E]`` (see the module
    docstring); ``bias``: ``[E]`` added to the scores for the choice only; ``gated_shared``: ``logits`` are
    ``[T, E + 1]`` and every shared slot weighs the sigmoid of the last column."""
    if not HAS_TRITON:
        raise RuntimeError("router_topk needs triton")
    if logits.dim() != 2 or not logits.is_floating_point() or logits.stride(1) != 1:
        raise ValueError(f"logits must be a float [T, E] tensor contiguous along E, got {tuple(logits.shape)}")
    t, e = logits.shape[0], logits.shape[1] - (1 if gated_shared else 0)
    consts = choice_constexprs(k, renormalize, shared, e, sigmoid=sigmoid, has_bias=bias is not None,
                               n_group=n_group, topk_group=topk_group, group_top2=group_top2, renorm_eps=renorm_eps,
                               gated_shared=gated_shared)
    if bias is not None and (bias.shape != (e,) or bias.device != logits.device or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [E] = [{e}] on the logits' device, got {tuple(bias.shape)}")
    weights = torch.empty((t, k + shared), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, k + shared), dtype=torch.int64, device=logits.device)
    if t:
        _router_topk_kernel[(t,)](
            logits, bias if bias is not None else logits, weights, ids, e, logits.stride(0), float(scale),
            num_warps=4 if consts["E_PAD"] <= 1024 else 8, **consts,
        )  # fmt: skip
    return weights, ids


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool, scale: float = 1.0, shared: int = 0):
    """:func:`router_topk` with softmax scores, no bias and no groups."""
    return router_topk(logits, k, renormalize, scale, shared)

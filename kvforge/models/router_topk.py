"""A MoE router's choice of experts: :class:`RouterRule` says how float32 logits become (weights, ids);
DeepSeek-V2's gates (greedy and group-limited), DeepSeek-V3's and Kimi's sigmoid gate with its correction
bias and expert groups, and Qwen3-Next's softmax router are all rules.

:func:`router_topk` is the one entry from logits: on CUDA (with autograd off) it runs one Triton kernel
(kvforge/kernels/triton_router_topk.py) unless ``KVFORGE_DISABLE_FUSED_KERNELS`` turns the fused kernels
off (kvforge/env.py); elsewhere it runs :func:`router_topk_reference`, the PyTorch formulas the kernel is
tested against. :func:`route` starts from the router's input and weight (float32 logits): for 1 to
``MAX_ROWS`` tokens on CUDA one Triton kernel computes the logits and the choice
(kvforge/kernels/triton_router_logits_topk.py, one launch where PyTorch takes a cast, a split product and
the choice); elsewhere the logits are ``F.linear(x.float(), weight.float())`` and :func:`router_topk`
chooses. Both return float32 weights in descending order of the choice and int64 expert ids; with
``shared = S`` each row carries ``S`` more slots, the ids ``E .. E + S - 1`` at weight 1 (shared experts
folded behind the routed ones, kvforge/models/shared_expert_fold.py; :func:`with_shared_slots`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.env import ENV

#: Whether the kernels may serve (module attribute; assign before a forward and before CUDA-graph capture).
TRITON_ROUTER = not ENV.disable_fused_kernels
#: Device types they serve on (tests add "cpu" to run them in Triton's interpreter).
TRITON_ROUTER_DEVICES: tuple[str, ...] = ("cuda",)
#: Whether :func:`route` may compute the logits inside the kernel (with ``TRITON_ROUTER``).
FUSED_ROUTER_LOGITS = True

GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True)
class RouterRule:
    """How a router turns float32 logits ``[T, E]`` into ``k`` experts per token.

    - scores: softmax over the experts, or the sigmoid of each logit (``sigmoid``);
    - choice values: the scores plus the per-expert bias where the router has one (DeepSeek-V3's
      ``e_score_correction_bias``), else the scores;
    - groups (``n_group > 1``): the experts form ``n_group`` equal groups, each scored by its largest
      choice value (``group_score="max"``, DeepSeek-V2) or the sum of its two largest (``"top2_sum"``,
      DeepSeek-V3); only the ``topk_group`` best groups' experts can be chosen;
    - the ``k`` largest choice values, in descending order; their weights are the scores (not the biased
      values), divided by their sum plus ``renorm_eps`` when ``renormalize``, then times ``scale``;
    - ``shared`` slots appended (:func:`with_shared_slots`) at weight 1, or, with ``gated_shared``, at the
      sigmoid of one more logit after the experts' (the logits are ``[T, E + 1]``: a shared MLP's own gate
      scaling all its slots, Qwen3-Next's ``shared_expert_gate``).
    """

    k: int
    renormalize: bool = False
    scale: float = 1.0
    shared: int = 0
    sigmoid: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    renorm_eps: float = 0.0
    gated_shared: bool = False

    def __post_init__(self):
        if self.k < 1 or self.shared < 0:
            raise ValueError(f"a router picks k >= 1 experts with shared >= 0 slots, got k={self.k} "
                             f"shared={self.shared}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        if self.gated_shared and not self.shared:
            raise ValueError("gated_shared weighs shared slots: give shared >= 1")

    def experts(self, logits_width: int) -> int:
        """The experts among ``logits_width`` logit columns (the last one is the shared gate's with
        ``gated_shared``)."""
        return logits_width - 1 if self.gated_shared else logits_width

    def kernel_arguments(self) -> dict:
        """The rule as the kernels' keyword arguments (kvforge/kernels/triton_router_topk.py)."""
        return dict(sigmoid=self.sigmoid, n_group=self.n_group, topk_group=self.topk_group,
                    group_top2=self.group_score == "top2_sum", renorm_eps=self.renorm_eps,
                    gated_shared=self.gated_shared)

    def fits(self, experts: int) -> bool:
        """Whether the rule can choose over ``experts``: equal groups holding at least ``k`` kept experts."""
        if self.k > experts or experts % self.n_group:
            return False
        return self.n_group == 1 or self.topk_group * (experts // self.n_group) >= self.k


def with_shared_slots(weights: torch.Tensor, ids: torch.Tensor, first: int, shared: int,
                      gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weights``/``ids [T, k]`` with ``shared`` slots appended: ids ``first .. first + shared - 1``, weight 1,
    or ``gate [T]`` (each token's weight for every shared slot) where given."""
    if not shared:
        return weights, ids
    t = ids.shape[0]
    extra = torch.arange(first, first + shared, dtype=ids.dtype, device=ids.device).expand(t, shared)
    extra_weights = weights.new_ones(t, shared) if gate is None else gate.to(weights.dtype)[:, None].expand(t, shared)
    return torch.cat([weights, extra_weights], 1), torch.cat([ids, extra], 1)


def router_topk_reference(logits: torch.Tensor, rule: RouterRule,
                          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch: the rule's choice (:class:`RouterRule`) with ``torch.topk``."""
    logits = logits.float()
    gate = None
    if rule.gated_shared:
        gate, logits = logits[:, -1].sigmoid(), logits[:, :-1]
    t, e = logits.shape
    scores = logits.sigmoid() if rule.sigmoid else logits.softmax(dim=-1)
    choice = scores + bias.float() if bias is not None else scores
    if rule.n_group > 1:
        per_group = choice.view(t, rule.n_group, e // rule.n_group)
        if rule.group_score == "top2_sum":
            group_scores = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
        else:
            group_scores = per_group.amax(dim=-1)
        kept = group_scores.topk(rule.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // rule.n_group, dim=1), float("-inf"))
    ids = choice.topk(rule.k, dim=-1).indices
    weights = scores.gather(1, ids)
    if rule.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + rule.renorm_eps)
    if rule.scale != 1.0:
        weights = weights * rule.scale
    return with_shared_slots(weights, ids, e, rule.shared, gate)


def softmax_topk_reference(logits: torch.Tensor, k: int, renormalize: bool, scale: float = 1.0,
                           shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`router_topk_reference` of a softmax rule without groups or bias."""
    return router_topk_reference(logits, RouterRule(k, renormalize, scale, shared))


def _kernels_may_serve(t: torch.Tensor) -> bool:
    return TRITON_ROUTER and t.device.type in TRITON_ROUTER_DEVICES and not torch.is_grad_enabled()


def use_triton_router(logits: torch.Tensor, rule: RouterRule | None = None) -> bool:
    """Whether :func:`router_topk` runs the kernel for these logits (and ``rule``, when given)."""
    if not _kernels_may_serve(logits):
        return False
    from kvforge.kernels import triton_router_topk

    experts = rule.experts(logits.shape[-1]) if rule is not None else logits.shape[-1]
    return (triton_router_topk.HAS_TRITON and logits.dim() == 2 and logits.stride(-1) == 1
            and experts <= triton_router_topk.MAX_EXPERTS
            and (rule is None or (rule.fits(experts) and rule.n_group <= triton_router_topk.MAX_GROUPS)))


def router_topk(logits: torch.Tensor, rule: RouterRule,
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32 [T, k + shared], ids int64 [T, k + shared])``: the rule's choice from ``logits``
    (``bias``: ``[E]``, the choice's correction; see the module docstring)."""
    if use_triton_router(logits, rule):
        from kvforge.kernels.triton_router_topk import router_topk as kernel

        return kernel(logits, rule.k, rule.renormalize, rule.scale, rule.shared,
                      bias=bias.contiguous() if bias is not None else None, **rule.kernel_arguments())
    return router_topk_reference(logits, rule, bias)


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool, scale: float = 1.0,
                 shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`router_topk` of a softmax rule without groups or bias."""
    return router_topk(logits, RouterRule(k, renormalize, scale, shared))


def use_fused_router_logits(x: torch.Tensor, weight: torch.Tensor, rule: RouterRule | None = None) -> bool:
    """Whether :func:`route` runs the logits-and-choice kernel for ``x [T, H]`` and ``weight [E, H]``: the
    router kernels' switches, 1 to ``MAX_ROWS`` tokens, at most ``MAX_EXPERTS`` experts, rows contiguous
    along the hidden size, a rule the choice kernel runs without a shared gate."""
    if not (FUSED_ROUTER_LOGITS and _kernels_may_serve(x)):
        return False
    from kvforge.kernels import triton_router_logits_topk as fused
    from kvforge.kernels import triton_router_topk

    return (fused.HAS_TRITON and x.dim() == 2 and weight.dim() == 2 and 0 < x.shape[0] <= fused.MAX_ROWS
            and weight.shape[0] <= fused.MAX_EXPERTS and x.stride(-1) == 1 and weight.stride(-1) == 1
            and weight.device == x.device
            and (rule is None or (rule.fits(weight.shape[0]) and rule.n_group <= triton_router_topk.MAX_GROUPS
                                  and not rule.gated_shared)))


def route(x: torch.Tensor, weight: torch.Tensor, rule: RouterRule, bias: torch.Tensor | None = None,
          counter: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`router_topk` of the float32 logits ``x @ weight.T`` (see the module docstring). ``counter``: the
    call site's int32 [1] zero on ``x``'s device, which the one-launch kernel needs (None: two steps)."""
    if counter is not None and use_fused_router_logits(x, weight, rule):
        from kvforge.kernels.triton_router_logits_topk import router_logits_topk

        return router_logits_topk(x, weight, rule.k, rule.renormalize, rule.scale, rule.shared, counter,
                                  bias=bias.contiguous() if bias is not None else None, **rule.kernel_arguments())
    logits = torch.nn.functional.linear(x.float(), weight.float())
    return router_topk(logits, rule, bias)


def router_softmax_topk(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool, scale: float = 1.0,
                        shared: int = 0, counter: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`route` with a softmax rule without groups or bias."""
    return route(x, weight, RouterRule(k, renormalize, scale, shared), None, counter)

"""Router rules with scores other than a plain softmax top-k (kvforge/models/router_topk.py ``RouterRule``):
DeepSeek-V3's and Kimi's sigmoid scores with a correction bias and expert groups scored by their top two,
DeepSeek-V2's group-limited softmax. The choice kernel (kvforge/kernels/triton_router_topk.py), the
one-launch logits-and-choice kernel and the PyTorch reference each against float64 scores and a selection by
sorting written here; DeepSeek's V3 gate through the kernels against the gate through PyTorch."""

from __future__ import annotations

import types

import pytest
import torch
from triton_kernel_device import DEVICE, KERNELS_RUN, requires_kernels, route_fixture

from kvforge.models import router_topk
from kvforge.models.router_topk import RouterRule


def _expected(logits: torch.Tensor, rule: RouterRule, bias: torch.Tensor | None):
    """float64: scores, biased choice values, groups kept by a sort of (-group score, group), experts by a sort
    of (-choice, expert); weights are the chosen experts' scores. Also the smallest gap at a decision edge
    (the kept groups' last against the first dropped, the k-th choice against the next)."""
    x = logits.double()
    s = torch.sigmoid(x) if rule.sigmoid else torch.softmax(x, dim=-1)
    c = s + bias.double() if bias is not None else s.clone()
    t, e = x.shape
    size = e // rule.n_group
    weights, ids, margin = [], [], float("inf")
    for row in range(t):
        cands = list(range(e))
        if rule.n_group > 1:
            def group_score(g, row=row):
                vals = sorted((c[row, g * size + i].item() for i in range(size)), reverse=True)
                return sum(vals[:2]) if rule.group_score == "top2_sum" else vals[0]
            scored = sorted(((group_score(g), g) for g in range(rule.n_group)), key=lambda p: (-p[0], p[1]))
            if rule.topk_group < rule.n_group:
                margin = min(margin, scored[rule.topk_group - 1][0] - scored[rule.topk_group][0])
            kept = {g for _, g in scored[:rule.topk_group]}
            cands = [i for i in cands if i // size in kept]
        order = sorted(cands, key=lambda i: (-c[row, i].item(), i))
        if len(order) > rule.k:
            margin = min(margin, c[row, order[rule.k - 1]].item() - c[row, order[rule.k]].item())
        chosen = order[:rule.k]
        w = s[row, chosen]
        if rule.renormalize:
            w = w / (w.sum() + rule.renorm_eps)
        weights.append(w * rule.scale)
        ids.append(torch.tensor(chosen))
    w, i = torch.stack(weights), torch.stack(ids)
    if rule.shared:
        i = torch.cat([i, torch.arange(e, e + rule.shared).expand(t, rule.shared)], 1)
        w = torch.cat([w, torch.ones(t, rule.shared, dtype=w.dtype)], 1)
    return w, i, margin


V3 = dict(sigmoid=True, group_score="top2_sum", renorm_eps=1e-20)
RULES = [  # experts, rule, with a bias
    (32, RouterRule(4, True, 2.5, 0, n_group=4, topk_group=2, **V3), True),  # DeepSeek-V3's shape, scaled down
    (256, RouterRule(8, True, 2.5, 1, n_group=8, topk_group=4, **V3), True),  # DeepSeek-V3's own
    (64, RouterRule(6, True, 2.446, 1, **V3), True),  # Kimi: one group
    (48, RouterRule(3, False, 1.5, 0, n_group=6, topk_group=1, **V3), True),  # top-k from a single group
    (16, RouterRule(2, True, 1.0, 0, n_group=16, topk_group=8, **V3), False),  # one expert a group
    (64, RouterRule(6, False, 16.0, 2, n_group=8, topk_group=3, group_score="max", renorm_eps=1e-20), False),
    (64, RouterRule(6, True, 1.0, 0, n_group=8, topk_group=3, group_score="max", renorm_eps=1e-20), False),
]


def _logits(tokens: int, experts: int, rule: RouterRule, with_bias: bool, seed: int, tol: float):
    """A draw whose decisions are clear of float32's error (margin above ``tol``)."""
    for attempt in range(200):
        g = torch.Generator().manual_seed(seed + 7919 * attempt)
        logits = torch.randn(tokens, experts, generator=g) * 2
        bias = torch.randn(experts, generator=g) * 0.1 if with_bias else None
        want_w, want_ids, margin = _expected(logits, rule, bias)
        if margin > tol:
            return logits, bias, want_w, want_ids
    raise AssertionError("no draw with clear decisions")


device = route_fixture(router_topk, "TRITON_ROUTER", "TRITON_ROUTER_DEVICES")


@pytest.mark.parametrize("experts,rule,with_bias", RULES)
def test_choice_matches_float64(device, experts, rule, with_bias):
    logits, bias, want_w, want_ids = _logits(5, experts, rule, with_bias, seed=experts + rule.k, tol=1e-5)
    assert router_topk.use_triton_router(logits.to(device), rule) == router_topk.TRITON_ROUTER
    w, ids = router_topk.router_topk(logits.to(device), rule, bias.to(device) if with_bias else None)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == want_ids.shape
    assert torch.equal(ids.cpu(), want_ids)
    # float32 scores (exp within a few ulps, a softmax sum over E terms), one division to renormalise
    tol = (experts + 8) * 2.0**-24
    assert ((w.cpu().double() - want_w).abs() / want_w.abs()).max() <= tol


@pytest.mark.parametrize("experts,rule,with_bias", [RULES[0], RULES[2], RULES[5]])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_one_launch_matches_float64(device, experts, rule, with_bias, tokens):
    """The logits-and-choice kernel: float32 logits of x @ weight.T, then the rule."""
    hidden = 96
    for attempt in range(200):
        g = torch.Generator().manual_seed(tokens * experts + attempt)
        x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
        weight = torch.randn(experts, hidden, generator=g) * hidden ** -0.5
        bias = torch.randn(experts, generator=g) * 0.1 if with_bias else None
        logits = x.double() @ weight.double().T
        want_w, want_ids, margin = _expected(logits, rule, bias)
        # float32 logits: within H ulps of sum|x w|; the sigmoid and softmax move a decision by less
        logit_err = hidden * 2.0**-24 * (x.double().abs() @ weight.double().abs().T).max().item()
        if margin > 100 * logit_err:
            break
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    assert router_topk.use_fused_router_logits(x.to(device), weight.to(device), rule) == router_topk.TRITON_ROUTER
    for _ in range(2):  # a second launch finds the counter at zero again
        w, ids = router_topk.route(x.to(device), weight.to(device), rule,
                                   bias.to(device) if with_bias else None, counter)
        assert counter.item() == 0
        assert torch.equal(ids.cpu(), want_ids)
        tol = 2 * logit_err + (experts + 8) * 2.0**-24
        assert ((w.cpu().double() - want_w).abs() / want_w.abs()).max() <= tol


@requires_kernels
def test_group_ties_go_to_the_lower_group():
    """Four groups of two; groups 1 and 3 tie on their top-two sums (and on their maxima): one group kept."""
    from kvforge.kernels.triton_router_topk import router_topk as kernel

    logits = torch.tensor([[0.0, -1.0, 2.0, 1.0, -3.0, -2.0, 1.0, 2.0]]).to(DEVICE)
    for top2 in (True, False):
        w, ids = kernel(logits, 2, renormalize=False, sigmoid=True, n_group=4, topk_group=1, group_top2=top2)
        assert ids.tolist() == [[2, 3]]


def test_rule_checks():
    assert RouterRule(8, n_group=8, topk_group=4).fits(256)
    assert not RouterRule(8, n_group=8, topk_group=4).fits(100)  # unequal groups
    assert not RouterRule(9, n_group=8, topk_group=1).fits(64)  # 8 experts kept, 9 wanted
    assert not RouterRule(65).fits(64)
    with pytest.raises(ValueError, match="topk_group"):
        RouterRule(2, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="group_score"):
        RouterRule(2, group_score="sum")
    with pytest.raises(ValueError, match="k >= 1"):
        RouterRule(0)


def test_a_rule_the_kernels_cannot_run_takes_pytorch(monkeypatch):
    monkeypatch.setattr(router_topk, "TRITON_ROUTER", True)
    monkeypatch.setattr(router_topk, "TRITON_ROUTER_DEVICES", ("meta",))
    tight = RouterRule(9, n_group=8, topk_group=1)
    with torch.no_grad():
        assert router_topk.use_triton_router(torch.empty(2, 64, device="meta"), RouterRule(8, n_group=8, topk_group=1))
        assert not router_topk.use_triton_router(torch.empty(2, 64, device="meta"), tight)
        w = torch.empty(64, 128, device="meta")
        assert not router_topk.use_fused_router_logits(torch.empty(1, 128, device="meta"), w, tight)
    if KERNELS_RUN:
        from kvforge.kernels.triton_router_topk import router_topk as kernel

        with pytest.raises(ValueError, match="too few experts kept"):
            kernel(torch.zeros(1, 64, device=DEVICE), 9, False, n_group=8, topk_group=1)
        with pytest.raises(ValueError, match="equal groups"):
            kernel(torch.zeros(1, 60, device=DEVICE), 2, False, n_group=8, topk_group=1)


@pytest.mark.skipif(not KERNELS_RUN, reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("tokens", [1, 6])
def test_deepseek_v3_gate_through_the_kernels_equals_the_pytorch_gate(monkeypatch, tokens):
    """DeepSeek-V3's router rule (32 experts in 4 groups here, top 4 of 2 groups, one shared slot): one token
    takes the one-launch kernel, six the logits product and the choice kernel; both against PyTorch."""
    from kvforge.models.deepseek import Gate

    args = types.SimpleNamespace(n_routed_experts=32, hidden_size=128, top_k=4, norm_topk_prob=True, v3=True,
                                 topk_method="noaux_tc", routed_scaling_factor=2.5, n_group=4, topk_group=2)
    gate = Gate(args).to(DEVICE)
    g = torch.Generator().manual_seed(100 + tokens)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(32, 128, generator=g) / 8)
        gate.e_score_correction_bias.copy_(torch.randn(32, generator=g) * 0.1)
        x = torch.randn(tokens, 128, generator=g).to(torch.bfloat16).to(DEVICE)
        monkeypatch.setattr(router_topk, "TRITON_ROUTER", False)
        want_w, want_ids = gate(x, shared=1)
        monkeypatch.setattr(router_topk, "TRITON_ROUTER", True)
        monkeypatch.setattr(router_topk, "TRITON_ROUTER_DEVICES", (DEVICE,))
        got_w, got_ids = gate(x, shared=1)
    assert torch.equal(got_ids, want_ids)
    assert (got_w - want_w).abs().max().item() <= 1e-5 * want_w.abs().max().item()
    assert gate.launch_counter.item() == 0


@pytest.mark.parametrize("shared", [1, 2])
def test_a_gated_shared_slot_weighs_the_sigmoid_of_the_last_logit(device, shared):
    """Qwen3-Next's shared expert under its own sigmoid gate: logits ``[T, E + 1]``, the choice over the first
    ``E`` columns (as without the gate), every shared slot weighing the sigmoid of the last column."""
    plain = RouterRule(4, True, 1.0, 0)
    logits, _, want_w, want_ids = _logits(5, 16, plain, False, seed=11, tol=1e-5)
    gate = torch.randn(5, generator=torch.Generator().manual_seed(12)) * 3
    rule = RouterRule(4, True, 1.0, shared, gated_shared=True)
    full = torch.cat([logits, gate[:, None]], 1)
    assert router_topk.use_triton_router(full.to(device), rule) == router_topk.TRITON_ROUTER
    w, ids = router_topk.router_topk(full.to(device), rule)
    w, ids = w.cpu().double(), ids.cpu()
    assert torch.equal(ids[:, :4], want_ids) and torch.equal(ids[:, 4:], torch.arange(16, 16 + shared).expand(5, -1))
    tol = 24 * 2.0**-24  # float32 softmax over 16 terms and one division, as test_choice_matches_float64
    assert ((w[:, :4] - want_w) / want_w).abs().max() <= tol
    want_gate = torch.sigmoid(gate.double())[:, None].expand(5, shared)
    assert ((w[:, 4:] - want_gate) / want_gate).abs().max() <= 4 * 2.0**-24  # exp within a few ulps
    with pytest.raises(ValueError, match="shared >= 1"):
        RouterRule(4, gated_shared=True)
    assert not router_topk.use_fused_router_logits(torch.empty(1, 8, device="meta"),
                                                   torch.empty(17, 8, device="meta"), rule)


def test_gpt_oss_router_is_the_softmax_over_its_top_k(device):
    """gpt-oss's router (HF: ``torch.topk`` of ``x @ W.T + b``, then a softmax over the k values) as the
    softmax rule renormalised over the chosen experts, through the choice kernel or the PyTorch reference;
    against float64."""
    from kvforge.models.gpt_oss import GptOssArgs, GptOssRouter

    config = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48, vocab_size=64,
                  max_position_embeddings=512, rms_norm_eps=1e-5, sliding_window=8, num_local_experts=32,
                  num_experts_per_tok=4)
    router = GptOssRouter(GptOssArgs(config), dtype=torch.float32)
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 64, generator=g) * 0.3)
        router.bias.copy_(torch.randn(32, generator=g))
    x = torch.randn(6, 64, generator=g)
    logits = x.double() @ router.weight.double().T + router.bias.double()
    top, want_ids = logits.topk(4, dim=-1)
    # float32 logits: within 65 ulps of the sum of |terms| (64 products and the bias)
    logit_err = 65 * 2.0**-24 * (x.double().abs() @ router.weight.double().abs().T + router.bias.double().abs()).max()
    assert (top[:, 3] - logits.topk(5, dim=-1).values[:, 4]).min() > 2 * logit_err  # a clear choice
    router.to(device)
    with torch.no_grad():
        w, ids = router(x.to(device))
    assert w.dtype == torch.float32 and torch.equal(ids.cpu(), want_ids)
    want_w = torch.softmax(top, dim=-1)
    # each weight exp(l_i - l_max) / sum: moved by the logits' errors (twice) and a few float32 roundings
    assert ((w.cpu().double() - want_w) / want_w).abs().max() <= 2 * logit_err + 8 * 2.0**-24

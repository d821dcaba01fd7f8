"""The memory/compute floor ``kvforge bench offline`` compares a run against (its module docstring says how).

Everything here is arithmetic on a model's parameters and a workload's lengths, so it is tested with
hand-computed numbers (tests/test_serve_bench.py); the measured rates (copy bandwidth, GEMM FLOP/s)
come in as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.models.routed_experts import modules_with_routed_experts


@dataclass(frozen=True)
class StepWeightBytes:
    """Weight bytes one decode step reads, as a function of the running batch.

    ``dense`` is read by every step. ``routed`` (a MoE model's routed experts held on this rank) is read
    only for the experts some running token picks. If each token picks ``top_k`` of ``n_experts`` uniformly,
    an expert stays idle with probability ``(1 - top_k / n_experts) ** batch``, so a step reads
    ``dense + routed x (1 - (1 - top_k / n_experts) ** batch)`` in expectation: ``top_k / n_experts`` of
    the routed bytes at batch 1, nearly all of them from a few dozen requests. Dummy weights route close
    to uniformly. A trained router favours some experts, touching fewer, so for real weights this is an
    estimate rather than a strict lower bound. The strict bound, ``top_k / n_experts`` at every batch, is
    loose beyond batch 1. At tensor parallelism ``routed`` is one rank's ``n_experts / tp`` experts and
    the same fraction applies.

    Invariants: ``routed == 0`` or ``1 <= top_k <= n_experts``; ``at_batch`` grows with the batch from
    ``dense + routed x top_k / n_experts`` toward ``total``.
    """

    dense: int
    routed: int = 0
    top_k: int = 0
    n_experts: int = 0

    def __post_init__(self) -> None:
        if self.routed and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} of {self.n_experts} experts: need 1 <= top_k <= n_experts")

    @property
    def total(self) -> int:
        """Every weight byte a step could read (all experts)."""
        return self.dense + self.routed

    def at_batch(self, batch: int) -> float:
        """Expected bytes a decode step of ``batch`` running requests reads (class docstring)."""
        if not self.routed:
            return float(self.dense)
        idle = (1.0 - self.top_k / self.n_experts) ** max(1, batch)
        return self.dense + self.routed * (1.0 - idle)


@dataclass(frozen=True)
class StepKVBytes:
    """KV-cache and state bytes one running sequence moves in one decode step, by layer kind.

    ``per_token``: bytes per context token of the layers that read every token (full attention, MLA).
    ``windowed``: ``(window, bytes per token)`` of sliding-window layers, which read at most ``window``
    tokens whatever the context. ``state``: bytes of fixed per-sequence state (linear-attention layers),
    read and written once per step, so a step moves it twice.

    Invariant: ``at_context`` grows with the context and, beyond the largest window, exactly by
    ``per_token`` per token.
    """

    per_token: int
    windowed: tuple[tuple[int, int], ...] = ()
    state: int = 0

    def at_context(self, context: int) -> int:
        """Bytes one sequence with ``context`` tokens moves in one decode step."""
        return (self.per_token * context + sum(b * min(context, w) for w, b in self.windowed)
                + 2 * self.state)

    @staticmethod
    def from_plan(plan) -> StepKVBytes:
        """From a :class:`kvforge.planner.kv_plan.KVPlan` (bytes per rank): growing layers at the plan's
        bytes per token, each sliding group's layers at their unpadded page bytes per token, and the
        layers' fixed state."""
        windows: dict[int, int] = {}
        for g in plan.groups:
            if g.kind == "sliding":
                per_layer = g.page_bytes_unpadded // g.block_size
                windows[g.sliding_window] = windows.get(g.sliding_window, 0) + per_layer * len(g.layers)
        state = sum(layer.state_bytes for layer in plan.layers)
        return StepKVBytes(plan.bytes_per_token, tuple(sorted(windows.items())), state)


def causal_pairs(prompt_len: int, window: int = 0) -> int:
    """(query, key) pairs causal attention over a prompt of ``prompt_len`` tokens scores: token ``p``
    (1-based) sees ``min(p, window)`` keys (``window`` 0: all ``p``)."""
    n = prompt_len
    if not window or window >= n:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


@dataclass(frozen=True)
class PrefillAttentionFlops:
    """FLOPs of a prompt's attention scores and weighted values, which the weights' FLOPs leave out.

    ``per_pair``: ``(window, FLOPs per (query, key) pair summed over the layers with that window)``, window
    0 for full-context layers. A pair costs each query head ``2 x head_dim_k`` (the score) plus
    ``2 x head_dim_v`` (the weighted value) FLOPs; an MLA layer counts its expanded heads
    (``qk_nope + qk_rope`` and ``v_head_dim``), the fewest FLOPs any of its prefill forms computes.
    Linear-attention (state) layers have no pairs; their cost grows linearly and is not counted here.

    Invariant: :meth:`of_prompt` is ``sum(flops x causal_pairs(prompt, window))``, quadratic in the prompt
    below every window.
    """

    per_pair: tuple[tuple[int, int], ...] = ()

    def of_prompt(self, prompt_len: int) -> int:
        return sum(f * causal_pairs(prompt_len, w) for w, f in self.per_pair)

    @staticmethod
    def from_plan(spec, plan) -> PrefillAttentionFlops:
        """From a model spec's layer dimensions and a plan's heads per rank (so at tensor parallelism the
        figure is one rank's, like the weights' FLOPs)."""
        heads = {layer.index: layer.heads_per_rank for layer in plan.layers}
        per_window: dict[int, int] = {}
        for layer in spec.layers:
            if layer.kind == "mla":
                dims = layer.qk_nope_head_dim + layer.qk_rope_head_dim + layer.v_head_dim
            elif layer.kind in ("full", "sliding"):
                dims = layer.head_dim_k + layer.head_dim_v
            else:
                continue
            window = (layer.sliding_window or 0) if layer.kind == "sliding" else 0
            per_window[window] = per_window.get(window, 0) + 2 * heads[layer.index] * dims
        return PrefillAttentionFlops(tuple(sorted(per_window.items())))


def _weights_used(model, in_bytes: bool) -> int:
    """Elements (or bytes) of every parameter but a separate input embedding, which is gathered, not
    multiplied or streamed; a tied LM head multiplies it, so it counts then."""
    size = (lambda t: t.numel() * t.element_size()) if in_bytes else (lambda t: t.numel())
    total = sum(size(p) for p in model.parameters())
    if getattr(model, "lm_head", None) is not None:
        total -= size(model.model.embed_tokens.weight)
    return total


def step_weight_bytes(model) -> StepWeightBytes:
    """:class:`StepWeightBytes` of ``model``: every parameter but a separate input embedding (gathered, not
    read; a tied LM head reads it), with the routed experts' bytes kept apart. Every MoE layer must route
    the same top-k of the same number of experts (one expected fraction for all of them)."""
    total = _weights_used(model, in_bytes=True)
    moe = modules_with_routed_experts(model)
    if not moe:
        return StepWeightBytes(dense=total)
    routing = {(m.top_k, m.num_experts) for m in moe}
    if len(routing) != 1:
        raise ValueError(f"MoE layers route differently (top_k, experts): {sorted(routing)}; one step-weight "
                         "model covers one routing")
    routed = sum(m.nbytes for m in moe)
    return StepWeightBytes(dense=total - routed, routed=routed, top_k=moe[0].top_k, n_experts=moe[0].num_experts)


def matmul_params_per_token(model) -> float:
    """Parameters one token multiplies through (the prefill floor's FLOPs are twice this per prompt token):
    all of them but the input embedding when it is a separate table (gathered, not multiplied; a tied LM
    head multiplies it once), and of a MoE layer's routed experts the fraction ``top_k / n_routed_experts`` (at
    tensor parallelism ``model`` is rank 0's shard, holding ``n_routed_experts / tp`` experts: the same
    fraction of them)."""
    total = float(_weights_used(model, in_bytes=False))
    for m in modules_with_routed_experts(model):  # this rank's experts (all at TP=1); a token runs top_k of them
        total -= m.numel * (1.0 - m.fraction_per_token)
    return total


def dense_decode_flops_per_token(model) -> float | None:
    """2 x the elements a decode step reads as weights (one multiply-add each); None for MoE models."""
    if modules_with_routed_experts(model):
        return None
    return 2.0 * _weights_used(model, in_bytes=False)


def roofline(in_lens, out_lens, weights: StepWeightBytes | int, kv: StepKVBytes | int, copy_bw: float,
             params: float, gemm_rate: float, flops_per_decode_token: float | None = None,
             prefill_attention: PrefillAttentionFlops | None = None) -> dict:
    """Byte floor per decode step (and, given ``flops_per_decode_token``, the compute-aware one) summed over
    this workload's schedule, plus the prefill FLOP floor (kvforge/bench/offline.py's docstring): the
    weights' FLOPs of every prompt token and, given ``prefill_attention``, each prompt's causal attention
    FLOPs, at ``gemm_rate``. All requests are admitted together; request ``r`` decodes for ``out_r - 1``
    steps (its first token comes from the prefill). ``weights``: a step's weight bytes at its batch (an
    int: the same at every batch). ``kv``: a sequence's KV and state bytes per step (an int: bytes per
    context token of every layer)."""
    if not isinstance(weights, StepWeightBytes):
        weights = StepWeightBytes(dense=int(weights))
    if not isinstance(kv, StepKVBytes):
        kv = StepKVBytes(per_token=int(kv))
    steps = max(out_lens)
    decode_s = decode_ca_s = 0.0
    active = list(zip(out_lens, in_lens))
    for s in range(1, steps):  # output token 1 comes from the prefill; decode step s makes token s + 1
        running = [(o, i) for o, i in active if o > s]
        kv_bytes = sum(kv.at_context(i + s) for o, i in running)
        t_weights, t_kv = weights.at_batch(len(running)) / copy_bw, kv_bytes / copy_bw
        decode_s += t_weights + t_kv
        if flops_per_decode_token is not None:
            decode_ca_s += max(t_weights, flops_per_decode_token * len(running) / gemm_rate) + t_kv
    attention_flops = sum(prefill_attention.of_prompt(n) for n in in_lens) if prefill_attention else 0
    prefill_s = (2 * params * sum(in_lens) + attention_flops) / gemm_rate
    n_out, n_in = sum(out_lens), sum(in_lens)
    total = decode_s + prefill_s
    out = {
        "decode_floor_s": decode_s, "prefill_floor_s": prefill_s, "floor_s": total,
        "prefill_attention_floor_s": attention_flops / gemm_rate,
        "prefill_tokens_per_s_at_floor": n_in / prefill_s if prefill_s else None,
        "output_tokens_per_s_at_floor": n_out / total, "total_tokens_per_s_at_floor": (n_in + n_out) / total,
        # None when no decode step runs (every output is the prefill's one token)
        "decode_only_output_tokens_per_s_at_floor": n_out / decode_s if decode_s else None,
    }
    if flops_per_decode_token is not None:
        out.update({"decode_floor_compute_aware_s": decode_ca_s, "floor_compute_aware_s": decode_ca_s + prefill_s})
    return out

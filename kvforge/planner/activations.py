"""The activation reserve: the peak bytes one step's live tensors take, set aside before the KV cache is sized.

A step runs ``T = max_num_batched_tokens`` tokens through the layers one after the other, so only the
largest set of tensors alive at one moment counts (a layer's tensors die before the next layer's). The
rule names each phase of a step and the tensors alive in it, as the model code holds them
(kvforge/models/decoder.py, llama.py, layers.py, deepseek.py), per rank, in the model dtype unless
said otherwise:

* the step (every phase): the int64 token ids and positions and rope's cos and sin tables (the
  unfused rotation adds a sign-folded sin);
* the stream (every phase of a layer): the previous layer's output and residual (the caller's loop
  still holds them), this layer's residual and its normed input: ``4 x [T, hidden]``;
* the residual-add norm between the sublayers: two more ``[T, hidden]`` (its outputs) beside the
  attention output; without the fused kernels (CPU) the float32 square and product of the norm;
* attention: the fused QKV output, rotated q and k (new tensors: the rope kernel writes out of place;
  without it, the unfused rotate-half's three temporaries), the attention output ``[T, Hq, Dv]`` and
  ``o_proj``'s output; on CUDA the split-K partials of the decode kernels (float32
  ``[rows, Hq, splits, D_pad]`` and ``[rows, Hq, splits, 2]``; a split count fills at most
  ``SPLIT_WAVES x MAX_SMS`` programs, so the rows over all splits are at most
  ``SPLIT_WAVES x MAX_SMS / Hkv + max_num_seqs`` per query row of a sequence); and, for steps of at
  least the SDPA prefill threshold, the larger of the two halves of the routed paged attention
  (kvforge/attention/paged_prefill_sdpa.py): the rest of the step on the kernels (its gathered query and
  output, ``2 x [T, Hq, D]``) and one SDPA call (the gathered K and V of the KV heads of one call at the
  longest context, bounded by ``SDPA_KV_BYTES``, the call's output ``[T, Hq, D]`` and its float32
  log-sum-exp); flash is assumed to take the calls (K and V not expanded to the query heads), and the
  rows of a context's last partial block are left to the allocator slack;
* MLA: the query (and its LoRA input), the latent projection and its normed copy, the rotated rope
  parts, the output; on CUDA the larger of the absorbed prefill (``q_latent``, its contiguous copy and
  ``o_latent``, ``[T, H, R]`` each) and the expanded prefill (K and V of the heads of one call at the
  longest context, bounded by ``SDPA_KV_BYTES``, plus the concatenated query);
* a gated MLP: ``gate_up [T, 2I]``, the activation product ``[T, I]`` (without the fused SiLU-and-mul
  also ``act(gate)`` beside it) and ``down_proj``'s output;
* routed experts: the router's float32 input and scores, then per routed row (``T x top_k`` on CUDA,
  where every rank sorts all slots for ``torch._grouped_mm``; on CPU at most ``T`` rows run one expert
  at a time): the gathered input, ``gate_up``, ``act(gate)`` and the product, the expert output, its
  copy in token order and that copy in float32 for the weighted sum (kvforge/models/expert_rows.py; gpt-oss: its clamped SwiGLU's intermediates instead), the slots'
  bookkeeping and the layer's output ``[T, hidden]``; shared experts after them (on CUDA at TP 1, in steps
  the expert kernel takes, as routed rows of their own);
* the head: the hidden rows and the sampler over ``max_num_seqs x (1 + num_speculative_tokens)`` rows
  of the vocabulary at ``SAMPLER_BYTES_PER_LOGIT`` (float32 logits, the temperature-scaled copy, the
  top-k/top-p sort's values and int64 indices, its masks, softmax and cumulative sum: kvforge/engine/
  sampler.py);
* prompt logprobs (kvforge/engine/prompt_scoring.py): the hidden rows, the sampled rows' float32 logits,
  one slice of at most ``PROMPT_LOGPROBS_SLICE_ROWS`` prompt rows at ``PROMPT_SCORING_BYTES_PER_LOGIT``
  (more with a soft cap or at TP > 1) and every scored row's logprobs.

Qwen3-Next has phases of its own (:func:`_qwen3_next_phases`). Other linear-attention (state) layers
are bounded by their token inputs (``token_input_elements``): the projection output in the model dtype
and two float32 copies (conv and delta-rule inputs), plus the output, and on CUDA the chunked delta rule's
float32 buffers where the route may take that form for their gates. The peak is raised by
:data:`ALLOCATOR_SLACK` and :data:`ALLOCATOR_SLACK_BYTES` for the caching allocator's rounding and
fragmentation. tests/test_activation_reserve.py measures the live tensor bytes of the model code against
the rule. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvforge.attention.routing import delta_rule as delta_rule_routing
from kvforge.attention.routing import paged as paged_routing
from kvforge.engine.sampling_params import MAX_LOGPROBS
from kvforge.kv_dtypes import BYTES_PER_ELEMENT
from kvforge.models.expert_kernel_rows import kernel_takes_rows
from kvforge.spec.layers import AttentionLayerSpec, MLALayerSpec, StateLayerSpec
from kvforge.spec.model_spec import ModelSpec

#: The caching allocator rounds each block up to 512 bytes (small) or 2 MiB segments (large) and may not
#: reuse a freed block for a larger request of the next layer; 10% plus 64 MiB covers the rounding of the
#: few dozen tensors of a phase (at most 2 MiB each) and the fragmentation of two differently sized phases.
ALLOCATOR_SLACK = 0.10
ALLOCATOR_SLACK_BYTES = 64 << 20
#: Bytes per sampled row and vocabulary entry at the sampler's peak (top-p path, kvforge/engine/sampler.py):
#: float32 logits, the row selection, the temperature-scaled copy, sorted values (4) and int64 indices (8),
#: three bool masks, the masked copy, softmax, its cumulative sum and the strictly-better mass, the scattered
#: result and its softmax: 49 bytes, rounded up; plus the int64 ranks of one row.
SAMPLER_BYTES_PER_LOGIT = 52
#: Prompt logprobs are scored this many rows at a time (kvforge/engine/prompt_scoring.py): enough rows that a
#: slice's head product reads the head's weight at a GEMM's rate, few enough that its logits stay small.
PROMPT_LOGPROBS_SLICE_ROWS = 256
#: Bytes per scored row and vocabulary entry at the slice's peak: its float32 logits and their log-softmax;
#: a soft-capped head (its division, tanh and product) or TP > 1 (rank 0's gathered parts and their
#: concatenation) hold one more float32 copy while the logits are made.
PROMPT_SCORING_BYTES_PER_LOGIT = 8
PROMPT_SCORING_EXTRA_BYTES_PER_LOGIT = 4
#: Routed experts: the bookkeeping of one (token, expert) slot alive beside the experts' tensors: expert ids,
#: weights, masks, the sort's keys and order, gathered token indices (int64 mostly): 189 bytes in gpt-oss's
#: CPU expert loop, rounded up.
ROUTING_BYTES_PER_SLOT = 192
#: Split-K bound: the most programs per SM any paged row's split rule fills (kvforge/attention/routing/
#: split_k.py; the one-warp row aims at 8) and the largest SM count planned for.
SPLIT_WAVES = max(max(k.splits.waves, k.splits.small_grid_waves) for k in paged_routing.TABLE)
MAX_SMS = 160
#: Expanded MLA prefill and the paged SDPA prefill: bytes of K and V one call holds at most
#: (kvforge/attention/mla_prefill_sdpa.py, kvforge/attention/routing/paged.py).
SDPA_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class ActivationReserve:
    """The bytes one step's activations need on one rank: ``bytes`` = ``tensor_bytes`` (the peak phase's
    tensors) times ``1 + ALLOCATOR_SLACK`` plus ``ALLOCATOR_SLACK_BYTES``. ``phases``: each phase's tensor bytes."""

    bytes: int
    tensor_bytes: int
    tokens: int
    sampled_rows: int
    peak_phase: str
    phases: tuple[tuple[str, int], ...]

    def describe(self) -> str:
        return (f"{self.bytes / 2**30:.2f} GiB for a step of {self.tokens:,} tokens "
                f"(peak: {self.peak_phase}; {self.sampled_rows:,} sampled rows)")


def _cfg(config: dict, *keys, default=0):
    for key in keys:
        value = config.get(key)
        if value is not None:
            return value
    return default


def _split_partials(layer: AttentionLayerSpec, rows_per_seq: int, max_seqs: int, tp: int) -> int:
    """The paged decode kernels' float32 split-K partials at their largest (module docstring)."""
    hq, hkv = layer.num_heads // tp, max(1, layer.num_kv_heads // tp)
    d_pad = max(16, 1 << (layer.head_dim_k - 1).bit_length())
    split_rows = rows_per_seq * (math.ceil(SPLIT_WAVES * MAX_SMS / hkv) + max_seqs)
    return split_rows * hq * (d_pad + 2) * 4


def _paged_sdpa_prefill(layer: AttentionLayerSpec, tokens: int, tp: int, e: int, max_len: int,
                        kv_dtype: str | None) -> int:
    """The routed paged attention's own tensors at its peak (module docstring); 0 where the SDPA rule never
    takes a sequence of the step (too few tokens, a float32 model, too large a head, sinks, a window shorter
    than the threshold). A window caps the context an SDPA sequence can have. ``kv_dtype`` None: the
    largest case (an fp8 cache's float32 dequantization)."""
    rule = paged_routing.SDPA_PREFILL
    d, window = layer.head_dim_k, layer.sliding_window or 0
    if (tokens < rule.min_query_len or e != 2 or d > rule.max_head_size or layer.sinks
            or 0 < window < rule.min_query_len):
        return 0
    hq, hkv = layer.num_heads // tp, max(1, layer.num_kv_heads // tp)
    model = "bfloat16"  # the two 16-bit dtypes count the same
    context = min(max_len, window) if window else max_len
    cache = kv_dtype or "fp8_e4m3"
    per_head = paged_routing.sdpa_prefill_kv_bytes_per_head(context, d, model, "float16" if cache == model else cache)
    gathered = min(hkv, max(1, SDPA_KV_BYTES // per_head)) * per_head
    rest = 2 * tokens * hq * d * e
    return max(rest, gathered + tokens * hq * (d * e + 4))


def _attention_phase(layer, tokens: int, rows_per_seq: int, max_seqs: int, tp: int, e: int, fused: bool,
                     max_len: int, hidden: int, kv_dtype: str | None = None) -> int:
    """Bytes of an attention sublayer's own tensors (the stream excluded) at its peak."""
    t = tokens
    if isinstance(layer, AttentionLayerSpec):
        hq, hkv = layer.num_heads // tp, max(1, layer.num_kv_heads // tp)
        dk, dv = layer.head_dim_k, layer.head_dim_v
        qkv = t * (hq * dk + hkv * dk + hkv * dv) * e
        qk = t * (hq + hkv) * dk * e
        out = t * hq * dv * e
        if fused:
            return (qkv + qk + out + _split_partials(layer, rows_per_seq, max_seqs, tp) + t * hidden * e
                    + _paged_sdpa_prefill(layer, t, tp, e, max_len, kv_dtype))
        # Unfused rope: x*cos, rotate_half(x)*sin and their sum alive at once, and the per-head q/k norms'
        # copies where a family has them.
        return qkv + max(4 * qk, qk + out + t * hidden * e)
    if isinstance(layer, MLALayerSpec):
        h = layer.num_heads // tp
        r, p, dn, v = layer.kv_lora_rank, layer.qk_rope_head_dim, layer.qk_nope_head_dim, layer.v_head_dim
        q = t * h * (dn + p) * e
        latent = t * (r + p) * e + t * r * e * 2  # the projection, its contiguous copy and the normed latent
        rope = t * h * p * e + t * p * e
        out = t * h * v * e
        inner = out
        if fused:
            absorbed = 3 * t * h * r * e + (rows_per_seq * (SPLIT_WAVES * MAX_SMS + max_seqs)) * h * (r + 2) * 4
            qk_dim = dn + p
            heads_per_call = max(1, min(h, SDPA_KV_BYTES // max(1, 2 * max_len * qk_dim * e)))
            expanded = (heads_per_call * max_len * (2 * qk_dim + v) * e + t * h * qk_dim * e
                        + max_len * (r + p) * 4)
            inner = out + max(absorbed, expanded)
        return q + latent + rope + inner + t * hidden * e
    if isinstance(layer, StateLayerSpec):
        inputs = t * (layer.token_input_elements // tp)
        chunk = delta_rule_routing.largest_chunk(layer.per_channel_gates) if fused else None
        buffers = delta_rule_routing.chunked_buffer_bytes(t, layer.value_heads // tp, layer.key_dim,
                                                           layer.value_dim, chunk) if chunk else 0
        return inputs * (e + 2 * 4) + t * hidden * (e + 4) + buffers
    raise TypeError(f"unknown layer spec {type(layer).__name__}")


def _mlp_phase(tokens: int, hidden: int, inter: int, e: int, fused: bool) -> int:
    """A gated MLP's own tensors at their peak: gate_up, the product (and unfused act(gate)), the output."""
    act = 0 if fused else inter
    return tokens * (2 * inter + inter + max(act, hidden)) * e


def _moe_phase(config: dict, architecture: str, tokens: int, hidden: int, tp: int, e: int, fused: bool) -> int:
    """Routed (and shared) experts' tensors at their peak; 0 for a model without routed experts."""
    experts = int(_cfg(config, "n_routed_experts", "num_local_experts", "num_experts"))
    if experts <= 0:
        return 0
    top_k = int(_cfg(config, "num_experts_per_tok", "experts_per_token", default=1))
    inter = int(_cfg(config, "moe_intermediate_size", "intermediate_size"))
    t = tokens
    n_shared = int(_cfg(config, "n_shared_experts", "num_shared_experts", default=0))
    # On CUDA at TP 1 a step the expert kernel takes runs the shared experts as routed rows of their own
    # (kvforge/models/shared_expert_fold.py); larger steps run them apart, after the routed products.
    folded = fused and tp == 1 and n_shared > 0 and kernel_takes_rows(t * top_k, experts)
    slots = t * (top_k + (n_shared if folded else 0)) * ROUTING_BYTES_PER_SLOT
    router = t * hidden * 4 + 4 * t * experts * 4 + slots  # float32 input, logits/scores/choice
    routed_rows = t * (top_k + (n_shared if folded else 0)) if fused else t
    if architecture == "GptOssForCausalLM":
        # The clamped SwiGLU beside gate_up: clamped gate and up, up + 1, gate x alpha and its sigmoid (7I
        # with the gathered input); then gate_up, the product and the biased output's three [rows, H].
        per_row = max(7 * inter + hidden, 2 * inter + 4 * hidden) * e
    else:
        per_row = (2 * inter + 2 * inter) * e  # gate_up, act(gate), the product
        per_row += hidden * e * 2 + hidden * 4  # expert output, beside the gathered input or the output in token order; float32 copy
    routed = routed_rows * per_row + slots + t * hidden * e  # the slots' bookkeeping; the layer's output
    shared = 0 if folded else n_shared * inter or int(_cfg(config, "shared_expert_intermediate_size", default=0))
    shared_phase = t * hidden * e + _mlp_phase(t, hidden, shared // tp, e, fused) if shared else 0
    return max(router, routed, shared_phase + t * hidden * e)


def _qwen3_next_phases(config: dict, spec: ModelSpec, t: int, tp: int, e: int, fused: bool, step: int,
                       paged_kernels: int) -> dict[str, int]:
    """Qwen3-Next's phases (kvforge/models/qwen3_next.py): each residual add joins the norm after it, whose
    float32 copies are counted as on a device without the norm kernel; the gated attention's query projection carries the output
    gate; Gated DeltaNet's projections, conv input and output beside the delta rule's output, and on CUDA the
    chunked delta rule's float32 buffers where the route takes that form (kvforge/attention/routing/delta_rule.py).
    ``paged_kernels``: the paged backend's own tensors in the attention phase (split-K partials, SDPA prefill)."""
    f = 4
    h = spec.hidden_size
    hk, hv = config["linear_num_key_heads"] // tp, config["linear_num_value_heads"] // tp
    key, value = hk * config["linear_key_head_dim"], hv * config["linear_value_head_dim"]
    conv = 2 * key + value
    heads = config["num_attention_heads"] // tp
    q = heads * int(_cfg(config, "head_dim", default=256))
    kv = max(1, config.get("num_key_value_heads", heads * tp) // tp) * int(_cfg(config, "head_dim", default=256))
    norm = h * (2 * f)  # GemmaRMSNorm's float32 copy and square (or product)
    stream = step + 2 * t * h * e  # the layer's input and its normed copy (the mixer's output later)
    phases = {"residual norm": step + t * (3 * h * e + norm)}
    proj = (2 * key + 2 * value + 2 * hv) * e  # the stacked input product's output (q, k, v, z, b, a)
    chunk = delta_rule_routing.largest_chunk(per_channel=False) if fused else None  # the chunked form's (CUDA)
    buffers = delta_rule_routing.chunked_buffer_bytes(
        t, hv, config["linear_key_head_dim"], config["linear_value_head_dim"], chunk) if chunk else 0
    phases["linear attention"] = stream + t * (proj + 2 * conv * e + max(
        0, 2 * value * e + value * (4 * f + e) - conv * e + h * e)) + buffers
    rope = (q + kv) * e * (0 if fused else 3)
    phases["full attention"] = stream + t * (2 * q * e + max(rope + q * e + 2 * kv * e,
                                                             2 * q * e + 2 * kv * e + 3 * q * e + h * e)) + (
        paged_kernels)
    inner = int(_cfg(config, "intermediate_size"))
    mlp_stream = step + t * 4 * h * e
    phases["MLP"] = mlp_stream + _mlp_phase(t, h, inner // tp, e, fused)
    experts = int(_cfg(config, "num_experts"))
    if experts:
        top_k = int(_cfg(config, "num_experts_per_tok", default=1))
        moe = int(_cfg(config, "moe_intermediate_size", "intermediate_size"))
        shared = int(_cfg(config, "shared_expert_intermediate_size", default=0))
        # Folded into the stack where its rows are whole experts (as _moe_phase's DeepSeek blocks)
        n_shared = shared // moe if shared and shared % moe == 0 else 0
        folded = fused and tp == 1 and n_shared > 0 and kernel_takes_rows(t * top_k, experts)
        per_token = top_k + (n_shared if folded else 0)
        slots = t * per_token * ROUTING_BYTES_PER_SLOT
        router = t * (experts + 1) * (e + 2 * f) + slots
        rows = t * per_token if fused else t
        routed = rows * (4 * moe + 2 * h) * e + slots + t * h * e
        shared = 0 if folded else shared // tp
        shared_phase = 2 * t * h * e + _mlp_phase(t, h, shared, e, fused) if shared else 0
        phases["routed experts"] = mlp_stream + max(router, routed, shared_phase + t * h * e)
    return phases


def _decoder_phases(spec: ModelSpec, config: dict, t: int, per_seq: int, max_seqs: int, tp: int, e: int,
                    fused: bool, max_len: int, step: int, kv_dtype: str | None = None) -> dict[str, int]:
    """The phases of a pre-norm decoder (kvforge/models/decoder.py: Llama, DeepSeek, gpt-oss, ...)."""
    hidden = spec.hidden_size
    stream = step + 4 * t * hidden * e
    phases: dict[str, int] = {}
    for layer in spec.layers:
        name = f"{layer.kind} attention" if layer.kind != "state" else "linear attention"
        own = _attention_phase(layer, t, per_seq, max_seqs, tp, e, fused, max_len, hidden, kv_dtype)
        phases[name] = max(phases.get(name, 0), stream + own)
    phases["residual norm"] = stream + t * hidden * e + 2 * t * hidden * e + (0 if fused else t * hidden * 8)
    inter = int(_cfg(config, "intermediate_size"))
    if inter:  # the fused SiLU-and-mul serves SiLU MLPs only (Gemma's GELU keeps act(gate) on every device)
        default_act = "gelu_pytorch_tanh" if spec.architecture.startswith("Gemma") else "silu"
        silu = _cfg(config, "hidden_activation", "hidden_act", default=default_act) in ("silu", "swish")
        # Gemma's sandwich norm: the post-feedforward norm's float32 copy of the MLP output, beside the
        # residual stream the layer hands on apart (kvforge/models/gemma3.py)
        sandwich = t * hidden * 4 if spec.architecture.startswith("Gemma") else 0
        phases["MLP"] = stream + _mlp_phase(t, hidden, inter // tp, e, fused and silu) + sandwich
    moe = _moe_phase(config, spec.architecture, t, hidden, tp, e, fused)
    if moe:
        phases["routed experts"] = stream + moe
    return phases


def activation_reserve(spec: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int, *,
                       num_speculative_tokens: int = 0, tensor_parallel_size: int = 1,
                       model_dtype: str | None = None, platform: str = "cuda",
                       max_model_len: int | None = None, kv_dtype: str | None = None) -> ActivationReserve:
    """The activation reserve of ``spec`` for steps of ``max_num_batched_tokens`` tokens (module docstring).

    ``platform`` "cuda" counts the fused kernels' tensors and the split-K partials; "cpu" the unfused
    reference code's temporaries instead. ``kv_dtype``: the cache's (None: the largest case)."""
    e = BYTES_PER_ELEMENT[model_dtype or spec.model_dtype]
    tp = tensor_parallel_size
    fused = platform == "cuda"
    t = max_num_batched_tokens
    per_seq = 1 + num_speculative_tokens
    rows = min(t, max_num_seqs * per_seq)
    config = spec.hf_config or {}
    max_len = max_model_len or spec.max_position_embeddings or 4096
    # Step-wide: the int64 token ids and positions, rope's cos and sin (computed once for all layers; the
    # unfused rotation also keeps a sign-folded copy of sin for the step).
    rotary = max((getattr(x, "head_dim_k", 0) or getattr(x, "qk_rope_head_dim", 0) for x in spec.layers), default=0)
    step = t * 2 * 8 + (2 if fused else 3) * t * rotary * e
    if spec.architecture == "Qwen3NextForCausalLM":
        full = next((x for x in spec.layers if isinstance(x, AttentionLayerSpec)), None)
        kernels = 0  # the paged kernels' own tensors: split-K partials and the routed SDPA prefill
        if full is not None and fused:
            kernels = _split_partials(full, per_seq, max_num_seqs, tp) + _paged_sdpa_prefill(full, t, tp, e, max_len,
                                                                                              kv_dtype)
        phases = _qwen3_next_phases(config, spec, t, tp, e, fused, step, kernels)
    else:
        phases = _decoder_phases(spec, config, t, per_seq, max_num_seqs, tp, e, fused, max_len, step, kv_dtype)
    vocab = spec.vocab_size
    hidden_rows = 2 * t * spec.hidden_size * e
    phases["sampler"] = hidden_rows + rows * vocab * max(SAMPLER_BYTES_PER_LOGIT, e + 4) + vocab * 8
    scored = min(t, PROMPT_LOGPROBS_SLICE_ROWS)
    per_logit = PROMPT_SCORING_BYTES_PER_LOGIT
    if tp > 1 or config.get("final_logit_softcapping"):
        per_logit += PROMPT_SCORING_EXTRA_BYTES_PER_LOGIT
    # Every scored row's results, kept until the step's end: its target's float32 logprob and rank (int64)
    # and at most MAX_LOGPROBS float32 values and int64 ids.
    kept = t * (4 + 8 + MAX_LOGPROBS * (4 + 8))
    phases["prompt logprobs"] = hidden_rows + rows * vocab * 4 + scored * vocab * per_logit + kept
    peak_name, peak = max(phases.items(), key=lambda kv: kv[1])
    total = math.ceil(peak * (1 + ALLOCATOR_SLACK)) + ALLOCATOR_SLACK_BYTES
    return ActivationReserve(bytes=total, tensor_bytes=peak, tokens=t, sampled_rows=rows, peak_phase=peak_name,
                             phases=tuple(phases.items()))

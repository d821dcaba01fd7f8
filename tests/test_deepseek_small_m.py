"""DeepSeek's one-row decode steps through the small-M kernel (kvforge/models/linear_route.py): the stacked
input projections compute the layer's input RMSNorm in their prologue, ``o_proj`` and the LM head multiply
by the kernel, and the logits stay within bf16's roundings of transformers' float32 logits and of the same
engine with the route off.

A tiny random DeepSeek-V2 (three layers: one dense, two MoE; float32 in transformers, loaded in bfloat16)
runs through the engine on the kernel device (Triton's CPU interpreter without CUDA) with the route forced
on for that device. One sequence decodes five teacher-forced tokens; every kernel call is counted. Bounds:
the route-off engine differs from float32 by bf16's roundings through three layers (relative L2 ~1e-2
here); the kernel adds one rounding per product and a summation order, so the route-on logits must stay
within the same bound (3e-2, the Llama case's of tests/test_linear_route.py), while a missed norm
(the prologue skipped), a dropped residual or a wrong row moves them by order 1.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from triton_kernel_device import DEVICE, requires_kernels, skip_unless_loaded_loop_bounds_work

transformers = pytest.importorskip("transformers")

from kvforge import LLM  # noqa: E402
from kvforge.kernels import triton_small_m_linear  # noqa: E402
from kvforge.models import linear_route  # noqa: E402

CONFIG = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
              moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
              first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
              vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
              q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0)
PROMPT, STEPS = 11, 5


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _decode(llm, ids, table):
    """Prefill ``ids[:PROMPT]`` in one step, then decode the rest one token a step; the decode logits."""
    runner = llm.engine.runner
    runner.run([(ids[:PROMPT], 0, table)], [PROMPT - 1])
    rows = [runner.run([([ids[n]], n, table)], [0])[0] for n in range(PROMPT, PROMPT + STEPS)]
    return torch.stack(rows).double().cpu()


@requires_kernels
def test_one_row_decode_takes_the_prologue_and_matches_transformers(tmp_path, monkeypatch):
    skip_unless_loaded_loop_bounds_work()
    torch.manual_seed(0)
    hf = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**CONFIG)).eval().float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)  # norms away from 1, so the prologue's weight is tested
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ids = torch.randint(0, 256, (PROMPT + STEPS,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    want = torch.stack([logits[n - 1] for n in range(PROMPT + 1, PROMPT + STEPS + 1)]).double()

    monkeypatch.setattr(linear_route, "SMALL_M_LINEAR", True)
    monkeypatch.setattr(linear_route, "SMALL_M_PROLOGUES", True)
    monkeypatch.setattr(linear_route, "SMALL_M_LINEAR_DEVICES", (torch.device(DEVICE).type,))
    calls = Counter()
    for name in ("small_m_linear", "rms_norm_linear", "silu_mul_linear"):
        kernel = getattr(triton_small_m_linear, name)

        def run(*args, _kernel=kernel, _name=name, num_sms=None, **kw):
            calls[_name] += 1
            return _kernel(*args, num_sms=4, **kw)  # a 4-SM plan: the fewest programs for the interpreter

        monkeypatch.setattr(triton_small_m_linear, name, run)
    llm = LLM(str(tmp_path), dtype="bfloat16", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 20,
              progress=False, device=DEVICE, enforce_eager=True, warm_up=False)
    calls.clear()  # only the steps below count
    table = [5, 2, 7, 0, 3]
    with torch.inference_mode():
        on = _decode(llm, ids, table)
        on_calls = Counter(calls)
        monkeypatch.setattr(linear_route, "SMALL_M_LINEAR", False)
        off = _decode(llm, ids, table)
    # On CUDA the MoE layers' shared experts run inside the routed experts' kernel (shared_expert_fold.py).
    shared = 0 if any(getattr(m, "folded_shared", 0) for m in llm.engine.runner.model.modules()) else 2
    # Per decode step: each layer's input norm inside its stacked q/kv_a product (3), the dense MLP's
    # gate/up (1); SiLU-and-mul inside the down products of the dense MLP and the unfolded shared experts.
    assert on_calls["rms_norm_linear"] == 4 * STEPS, on_calls
    assert on_calls["silu_mul_linear"] == (1 + shared) * STEPS, on_calls
    # o_proj of each layer (3), the unfolded shared experts' gate/up and the LM head (1); plus the prefill's
    # LM head over its one sampled row.
    assert on_calls["small_m_linear"] == (4 + shared) * STEPS + 1, on_calls
    assert calls == on_calls  # route off: no kernel call
    assert _rel(off, want) <= 3e-2, "the bf16 engine without the kernel is off: not the kernel's fault"
    assert _rel(on, want) <= 3e-2
    assert _rel(on, off) <= 3e-2

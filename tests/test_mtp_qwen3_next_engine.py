"""Speculative method mtp on Qwen3-Next in the engine (a tiny random checkpoint with an MTP layer, CPU):
greedy output equal to speculation off at k = 1 and 3 (float32 with model-dtype and fp8 KV, bfloat16), with
chunked prefill and preemption; the rollback invariants after every step (tests/test_speculative_engine.py).

Verification keeps exactly the tokens of the target's argmax, but a verify step's batch shape changes the
summation order, which can flip a near-tie: tokens are compared by the near-tie rule of
tests/greedy_agreement.py (FP32_LOGIT_TOL in float32; 8 bf16 steps at the largest |logit| in bfloat16).
Random MTP weights guess the target's tokens rarely, so those cases mostly test rejection and the rollback
of the Gated DeltaNet state; ``test_mtp_that_computes_the_target_is_accepted`` builds a checkpoint whose MTP
layer computes the target's own next-token function, where every greedy proposal must be accepted.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from greedy_agreement import FP32_LOGIT_TOL, assert_outputs_agree  # noqa: E402
from linear_attention_setup import one_torch_thread  # noqa: E402, F401 (autouse fixture)
from qwen3_next_mtp_checkpoint import save_qwen3_next_with_mtp  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_mtp_engine import (  # noqa: E402
    PROMPTS,
    assert_mtp_agrees_with_speculation_off,
    assert_mtp_graph_passes_of_every_query_length,
    assert_mtp_graph_path_agrees,
)
from test_mtp_engine import _llm as mtp_llm  # noqa: E402
from test_speculative_engine import generate, token_ids  # noqa: E402
from tiny_checkpoints import QWEN3_NEXT  # noqa: E402

from kvforge import SamplingParams  # noqa: E402


def _llm(path, k=0, **kw):
    """The DeepSeek MTP tests' engine (speculation off at k = 0), float32 unless told otherwise."""
    return mtp_llm(path, k, **{"dtype": "float32", **kw})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_next_mtp")
    save_qwen3_next_with_mtp(path)
    return path


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("float32", "fp8"), ("bfloat16", "auto")])
def test_greedy_agrees_with_speculation_off(checkpoint, dtype, kv):
    assert_mtp_agrees_with_speculation_off(_llm, checkpoint, dtype, kv, mtp_layer=4)


def _target_function_checkpoint(path) -> None:
    """Every mixer output (attention ``o_proj``, Gated DeltaNet ``out_proj``) and MLP down projection of the
    target and of the MTP block is zero, so the target's next token is a function of the current token only:
    head(norm(embed(t))). The MTP layer is made to compute that same function of the token it reads: its
    output norm is the target's, ``pre_fc_norm_embedding`` is the identity norm (zero-centred weight 0) and
    ``fc`` keeps the embedding half ([I, 0]); its output at position i is norm(embed(t_{i+1}) / rms), whose
    logits equal the target's at position i + 1 up to the norm's epsilon (a relative 5e-7)."""
    tensors = {}
    for name in ("model.safetensors", "mtp.safetensors"):
        tensors.update(load_file(str(path / name)))
    for name, t in tensors.items():
        if "o_proj" in name or "down_proj" in name or "out_proj" in name:
            tensors[name] = torch.zeros_like(t)
    h = tensors["model.norm.weight"].shape[0]
    tensors["mtp.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(h)
    tensors["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    save_file({k: v.contiguous() for k, v in tensors.items() if not k.startswith("mtp.")},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    save_file({k: v.contiguous() for k, v in tensors.items() if k.startswith("mtp.")}, str(path / "mtp.safetensors"))


def test_mtp_that_computes_the_target_is_accepted(tmp_path):
    save_qwen3_next_with_mtp(tmp_path)
    _target_function_checkpoint(tmp_path)
    ref = token_ids(generate(_llm(tmp_path), PROMPTS))
    for k in (1, 3):
        llm = _llm(tmp_path, k)
        assert token_ids(generate(llm, PROMPTS)) == ref
        counters = llm.engine.stats()["spec_decode"]
        assert counters["num_draft_tokens"] >= 20, counters
        assert counters["num_accepted_tokens"] == counters["num_draft_tokens"], counters
        assert llm.engine.stats()["num_steps"] < 48 // k + 10  # 48 tokens in about 48 / (k + 1) decode steps



@pytest.mark.parametrize("target_function", [False, True])
def test_mtp_passes_on_the_graph_path(checkpoint, tmp_path, monkeypatch, target_function):
    """See :func:`test_mtp_engine.assert_mtp_graph_path_agrees`: the MTP layer's gated attention and MoE beside
    the target's verification graphs, whose Gated DeltaNet states are replayed over the accepted rows."""
    if target_function:
        save_qwen3_next_with_mtp(tmp_path)
        _target_function_checkpoint(tmp_path)
        checkpoint = tmp_path
    assert_mtp_graph_path_agrees(_llm, checkpoint, monkeypatch, 2, all_accepted=target_function)



def test_mtp_graph_passes_of_every_query_length(checkpoint, monkeypatch):
    """See :func:`test_mtp_engine.assert_mtp_graph_passes_of_every_query_length` (gated attention with partial
    rope and MoE in multi-row passes)."""
    assert_mtp_graph_passes_of_every_query_length(_llm, checkpoint, monkeypatch)


def test_dummy_weights_run_the_mtp_layer(tmp_path):
    """A config without weights (a preset's path): the MTP layer gets seeded random weights like the rest."""
    config = {**QWEN3_NEXT, "architectures": ["Qwen3NextForCausalLM"], "mtp_num_hidden_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = generate(_llm(tmp_path, load_format="dummy"), PROMPTS, params)
    llm = _llm(tmp_path, 2, load_format="dummy")
    assert_outputs_agree(generate(llm, PROMPTS, params), ref, FP32_LOGIT_TOL)
    assert llm.engine.stats()["spec_decode"]["num_draft_tokens"] > 0
    assert 0.01 < llm.engine.model.mtp.fc.weight.std().item() < 0.03  # drawn ~ normal(0, 0.02)


def test_preemption_recomputes_the_mtp_layer(checkpoint):
    """A sequence holding all but 22 blocks (88 tokens for prompts of 24 + 31 + 8 tokens, 48 new ones and
    the proposals' rows): requests are preempted and recomputed (the MTP layer's KV and the Gated DeltaNet
    state with them) while others hold proposals' blocks."""
    from kvforge.engine.sequence import Sequence

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    ref = generate(_llm(checkpoint), PROMPTS, params)
    engine = _llm(checkpoint, 3).engine
    bm = engine.block_manager
    hog = Sequence("hog", [1] * (4 * (bm.num_free_blocks - 22)), SamplingParams(max_tokens=1))
    assert bm.allocate(hog, cached_blocks=[]) and bm.num_free_blocks == 22
    outs = []
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        outs += [out for out in engine.step() if out.finished]
    assert engine.stats()["num_preemptions"] > 0
    assert_outputs_agree(sorted(outs, key=lambda o: int(o.request_id)), ref, FP32_LOGIT_TOL)

"""``--max-model-len auto`` (vLLM's ``auto`` / ``-1``): the longest length whose one sequence the plan holds,
planned before any weight loads. Checked against lengths computed by hand from the configs, against the
definition (the found length plans, one token more does not) on every family of layers, and end to end on
the embedded model (CPU)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvforge.cli import build_parser
from kvforge.config import EngineArgs
from kvforge.errors import InvalidRequestError, PlanError
from kvforge.planner.api import plan
from kvforge.spec.presets import PRESETS

GIB = 2**30
# The embedded SmolLM2-135M on CPU: 30 layers x (K + V) x 3 KV heads x 64 x float32 = 46,080 bytes a token,
# 16-token blocks (its config.json, independent of the planner).
SMOL_TOKEN_BYTES = 30 * 2 * 3 * 64 * 4
SMOL_CONTEXT = 8192


def _hand_fitted(memory: int, token_bytes: int, context: int, block: int = 16) -> int:
    """Full-attention layers only, KV memory given (no activation reserve): whole blocks of one sequence."""
    return min(context, memory // (block * token_bytes) * block)


@pytest.mark.parametrize("memory", [64 << 20, 100 << 20, 300 << 20, 1 << 30])
def test_fitted_length_matches_the_hand_count(memory):
    p = plan(max_model_len="auto", kv_cache_memory=memory)
    expected = _hand_fitted(memory, SMOL_TOKEN_BYTES, SMOL_CONTEXT)
    assert p.max_model_len == expected
    if expected < SMOL_CONTEXT:
        assert p.max_model_len_reason.startswith("auto: the longest that fits one sequence")
        assert any(w.startswith(f"--max-model-len auto planned {expected} tokens") for w in p.warnings)
    else:
        assert p.max_model_len_reason == f"auto: the model's context length ({SMOL_CONTEXT}) fits one sequence"
        assert not any("auto" in w for w in p.warnings)


@pytest.mark.parametrize("model,kw", [
    ("llama-3.1-8b", dict(gpu_memory=24 * GIB)),  # the activation reserve shrinks with the length
    ("llama-3.1-8b", dict(gpu_memory=24 * GIB, kv_cache_dtype="fp8")),
    # without chunked prefill a step holds a whole prompt: its activations grow with the length too
    ("llama-3.1-8b", dict(gpu_memory=40 * GIB, enable_chunked_prefill=False)),
    ("llama-3.1-8b", dict(gpu_memory=32 * GIB, tensor_parallel_size=2, gpu_memory_utilization=0.5)),
    ("gpt-oss-20b", dict(gpu_memory=48 * GIB)),  # sliding + full groups, sinks
    ("deepseek-v2-lite", dict(gpu_memory=36 * GIB)),  # MLA
    ("qwen3-next-80b-a3b", dict(gpu_memory=45 * GIB, tensor_parallel_size=4)),  # state slots + gated attention
    ("gemma-3-1b", dict(kv_cache_memory=40 << 20, device="cpu")),  # sliding 512 + full, CPU
    ("kimi-linear-48b-a3b", dict(gpu_memory=56 * GIB, tensor_parallel_size=2)),  # KDA state + MLA
])
def test_fitted_length_is_the_longest_that_plans(model, kw):
    kw = {"device": "cuda", **kw}
    fitted = plan(model, max_model_len="auto", **kw)
    context = PRESETS[model]["max_position_embeddings"]
    assert 2 <= fitted.max_model_len < context, "the case is meant to need a shorter length"
    again = plan(model, max_model_len=fitted.max_model_len, **kw)
    assert again.capacity == fitted.capacity and again.activations == fitted.activations
    with pytest.raises(PlanError):
        plan(model, max_model_len=fitted.max_model_len + 1, **kw)
    if kw.get("kv_cache_dtype") == "fp8":  # the baseline is planned at the fitted length too: at the length
        # fp8 fits, one bf16 sequence does not, which the plan says
        assert fitted.baseline is None and again.baseline is None
        assert any(w.startswith("no bfloat16 baseline plan") for w in fitted.warnings)


def test_without_chunked_prefill_the_step_is_sized_for_the_fitted_length():
    fitted = plan("llama-3.1-8b", device="cuda", gpu_memory=40 * GIB, max_model_len="auto",
                  enable_chunked_prefill=False)
    chunked = plan("llama-3.1-8b", device="cuda", gpu_memory=40 * GIB, max_model_len="auto")
    assert chunked.max_model_len == PRESETS["llama-3.1-8b"]["max_position_embeddings"]
    assert fitted.max_model_len < chunked.max_model_len  # a whole prompt's activations take memory
    assert f"for a step of {fitted.max_model_len:,} tokens" in fitted.activations.describe()


def test_a_length_that_fits_is_kept():
    p = plan("llama-3.1-8b", device="cuda", gpu_memory=80 * GIB, max_model_len="auto")
    assert p.max_model_len == PRESETS["llama-3.1-8b"]["max_position_embeddings"]
    assert "fits one sequence" in p.max_model_len_reason
    assert "fits one sequence" in p.summary()


def test_a_draft_model_with_a_shorter_context_caps_the_length(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**PRESETS["qwen3-8b"], "max_position_embeddings": 512}))
    p = plan("qwen3-8b", draft_model=str(tmp_path), kv_cache_memory=8 * GIB, max_model_len="auto")
    assert p.max_model_len == 512 and p.draft is not None
    assert p.max_model_len_reason.startswith("auto: the draft model") and "(512) fits one sequence" in \
        p.max_model_len_reason


def test_nothing_fits_names_the_flag_and_the_cause():
    with pytest.raises(PlanError, match=r"--max-model-len auto: no length plans, not even 2 tokens: .*holds less "
                                        r"than one sequence"):
        plan(max_model_len="auto", kv_cache_memory=100)
    with pytest.raises(PlanError, match=r"--max-model-len auto: no length plans.*weights need"):
        plan("llama-3.1-8b", device="cuda", gpu_memory=8 * GIB, max_model_len="auto")


def test_explicit_and_default_lengths_say_where_they_came_from():
    assert plan(max_model_len=1024).max_model_len_reason == "--max-model-len"
    assert plan().max_model_len_reason == "the model's context length (max_position_embeddings)"


@pytest.mark.parametrize("value", ["auto", "AUTO", "-1", " auto "])
def test_cli_spellings(value):
    parser: argparse.ArgumentParser = build_parser()
    for command in ("plan", "serve", "generate"):
        ns = parser.parse_args([command, "--max-model-len", value])
        assert ns.max_model_len == "auto"
    assert parser.parse_args(["serve", "--max-model-len", "128K"]).max_model_len == 131072


@pytest.mark.parametrize("value", ["auto", -1, "-1"])
def test_engine_args_spellings(value):
    assert EngineArgs(max_model_len=value).max_model_len == "auto"


def test_plan_cli_json(capsys):
    from kvforge.cli import main

    assert main(["plan", "--max-model-len", "auto", "--kv-cache-memory", "64MiB", "--json"]) in (0, None)
    data = json.loads(capsys.readouterr().out)
    assert data["max_model_len"] == _hand_fitted(64 << 20, SMOL_TOKEN_BYTES, SMOL_CONTEXT)
    assert data["max_model_len_reason"].startswith("auto:")


def test_engine_serves_at_the_fitted_length(smol_llm):
    from kvforge import SamplingParams

    memory = 64 << 20
    fitted = _hand_fitted(memory, SMOL_TOKEN_BYTES, SMOL_CONTEXT)
    llm = smol_llm(device="cpu", max_model_len="auto", kv_cache_memory=memory)
    engine = llm.engine
    assert engine.max_model_len == fitted and engine.plan.num_blocks * 16 == fitted
    greedy = SamplingParams(temperature=0, max_tokens=4)
    reference = smol_llm(device="cpu", max_model_len=fitted, kv_cache_memory=memory)
    prompt = "The capital of France is"
    assert llm.generate([prompt], greedy)[0].outputs[0].token_ids == \
        reference.generate([prompt], greedy)[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match=f"max-model-len is {fitted}"):
        llm.generate([{"prompt_token_ids": [1] * fitted}], greedy)
    # The longest prompt the length leaves room for runs: the whole pool is one sequence.
    out = llm.generate([{"prompt_token_ids": [1] * (fitted - 1)}], SamplingParams(temperature=0, max_tokens=1))
    assert len(out[0].outputs[0].token_ids) == 1

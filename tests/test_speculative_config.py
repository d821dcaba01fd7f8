"""--speculative-config / --num-speculative-tokens: parsing, and every refusal made before weights load."""

from __future__ import annotations

import json

import pytest

from kvforge.cli import main
from kvforge.config import EngineArgs
from kvforge.engine.llm_engine import LLMEngine
from kvforge.errors import ConfigError, PlanError
from kvforge.spec.presets import PRESETS
from kvforge.speculative.config import SpeculativeConfig, resolve_speculative
from kvforge.speculative.support import check_speculative


def test_json_in_vllm_shape_is_parsed():
    args = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
                                         '"prompt_lookup_max": 4}')
    assert args.speculative_config == SpeculativeConfig("ngram", 3, 2, 4)
    assert args.num_speculative_tokens == 3  # what the planner reads


def test_shorthand_means_ngram():
    args = EngineArgs(num_speculative_tokens=2)
    assert args.speculative_config.method == "ngram"
    assert args.speculative_config.num_speculative_tokens == 2
    assert EngineArgs().speculative_config is None


def test_dict_and_defaults():
    cfg = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 5}).speculative_config
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 5)
    # One bound given: the other equals it, as vLLM reads the same launch line.
    assert SpeculativeConfig("ngram", 1, prompt_lookup_max=3).prompt_lookup_min == 3
    assert SpeculativeConfig("ngram", 1, prompt_lookup_min=7).prompt_lookup_max == 7


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "unknown method 'eagle'"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": -2}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "unknown key(s) lookahead"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3}', "prompt_lookup_min (4) >"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 0}', "prompt_lookup_min must be"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "ngram takes no model"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
    ('{"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 3}', "applies to method ngram only"),
])
def test_bad_config_is_refused(value, message):
    with pytest.raises(ConfigError) as e:
        EngineArgs(speculative_config=value)
    assert message in str(e.value)


@pytest.mark.parametrize("config, method, model", [
    ({"model": "ngram"}, "ngram", None),
    ({"model": "[ngram]"}, "ngram", None),
    ({"method": "[ngram]"}, "ngram", None),
    ({"method": "[ngram]", "model": "[ngram]"}, "ngram", None),
    ({"method": None, "model": "ngram"}, "ngram", None),
    ({"method": None}, "ngram", None),
    ({"model": "/ckpt/draft"}, "draft_model", "/ckpt/draft"),  # vLLM's usual draft spelling: model, no method
    ({"method": None, "model": "llama-3.1-8b"}, "draft_model", "llama-3.1-8b"),
    ({"method": "ngram", "draft_tensor_parallel_size": 1, "disable_logprobs": True}, "ngram", None),
])
def test_the_method_is_inferred_as_vllm_does(config, method, model):
    cfg = SpeculativeConfig.parse({**config, "num_speculative_tokens": 3})
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == (method, model, 3)


@pytest.mark.parametrize("key, value, message", [
    ("disable_by_batch_size", 4, "disable_by_batch_size is not supported: kvforge speculates at every batch size"),
    ("speculative_token_tree", "[(0,)]", "speculative_token_tree is not supported: tree proposals"),
    ("max_model_len", 1024, "max_model_len is not supported: the draft shares the target's --max-model-len"),
    ("draft_tensor_parallel_size", 0, "draft_tensor_parallel_size must be an integer >= 1, got 0"),
    ("disable_logprobs", "yes", "disable_logprobs must be true or false, got 'yes'"),
])
def test_vllms_other_keys_are_refused_with_the_reason(key, value, message):
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, key: value})
    assert message in str(e.value)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, key: None}).method == "ngram"  # null: unset


def test_shorthand_disagreeing_with_config_is_refused():
    with pytest.raises(ConfigError, match="disagrees"):
        EngineArgs(num_speculative_tokens=3, speculative_config={"num_speculative_tokens": 2})
    assert EngineArgs(num_speculative_tokens=2, speculative_config={"num_speculative_tokens": 2}) \
        .num_speculative_tokens == 2


@pytest.fixture
def no_weights(monkeypatch):
    """Building a model fails the test: every refusal below must come before it."""
    def fail(*a, **k):
        raise AssertionError("the model was built before the speculative config was refused")
    monkeypatch.setattr("kvforge.models.registry.build_model", fail)


def _engine(model=None, **kw):
    base = dict(device="cpu", progress=False, kv_cache_memory=1 << 30, max_model_len=1024, load_format="auto" if model is None
                else "dummy", skip_tokenizer_init=True)
    return LLMEngine(EngineArgs(model=model, **{**base, **kw}))


def _config_dir(tmp_path, preset, **extra):
    (tmp_path / "config.json").write_text(json.dumps({**PRESETS[preset], **extra}))
    return str(tmp_path)


def test_mtp_without_mtp_layer_is_refused(no_weights, tmp_path):
    with pytest.raises(ConfigError, match="runs the MTP layers of .* not LlamaForCausalLM"):
        _engine(speculative_config={"method": "mtp", "num_speculative_tokens": 1})  # embedded SmolLM2
    model = _config_dir(tmp_path, "deepseek-v3", num_nextn_predict_layers=0)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers > 0"):
        _engine(model, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_mtp_on_an_architecture_without_mtp_support_is_refused(no_weights, tmp_path):
    model = _config_dir(tmp_path, "deepseek-v2-lite", num_nextn_predict_layers=1)
    with pytest.raises(ConfigError, match="runs the MTP layers of DeepseekV3ForCausalLM, Qwen3NextForCausalLM "
                                          "checkpoints, not DeepseekV2ForCausalLM"):
        _engine(model, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


@pytest.mark.parametrize("alias", ["deepseek_mtp", "qwen3_next_mtp"])
def test_vllm_names_of_the_mtp_method_mean_mtp(alias):
    assert SpeculativeConfig.parse({"method": alias, "num_speculative_tokens": 2}).method == "mtp"


def test_mtp_from_a_gguf_file_is_refused(no_weights, tmp_path):
    model = _config_dir(tmp_path, "deepseek-v3")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="loads the MTP layer from HF safetensors .* not from gguf"):
        _engine(model, load_format="auto", speculative_config={"method": "mtp", "num_speculative_tokens": 1})


@pytest.mark.parametrize("kw, message", [
    (dict(max_num_batched_tokens=4), r"num_speculative_tokens 4 \+ 1 exceeds --max-num-batched-tokens 4"),
    (dict(max_model_len=5), "num_speculative_tokens 4 leaves no room in max-model-len 5"),
])
def test_mtp_beyond_what_the_plan_allows_is_refused(no_weights, kw, message):
    with pytest.raises(ConfigError, match=message):
        _engine("deepseek-v3", speculative_config={"method": "mtp", "num_speculative_tokens": 4}, **kw)


def test_draft_with_another_vocabulary_is_refused(no_weights):
    with pytest.raises(ConfigError, match="vocabulary of 128256 tokens but the target SmolLM2"):
        _engine(speculative_config={"method": "draft_model", "model": "llama-3.1-8b", "num_speculative_tokens": 2})


def test_linear_attention_draft_is_refused(no_weights):
    with pytest.raises(ConfigError, match="keeps linear-attention state"):
        _engine("qwen3-8b", speculative_config={"method": "draft_model", "model": "qwen3-next-80b-a3b",
                                                "num_speculative_tokens": 2})


def test_draft_without_the_context_is_refused(no_weights, tmp_path):
    draft = _config_dir(tmp_path, "qwen3-8b", max_position_embeddings=512)
    with pytest.raises(ConfigError, match="max_position_embeddings 512, below --max-model-len 1024"):
        _engine("qwen3-8b", speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2})


# A 2-layer draft of Llama-3.1-8B's vocabulary and KV head size (128); the target has 8 KV heads.
TP_DRAFT = dict(PRESETS["llama-3.1-8b"], hidden_size=1024, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=8, intermediate_size=512, head_dim=128)


def _tp_plan(tp: int, **draft):
    from kvforge.planner.inputs import CacheConfig, ParallelConfig
    from kvforge.planner.resolver import resolve
    from kvforge.spec.architectures import spec_from_hf_config

    target = spec_from_hf_config(dict(PRESETS["llama-3.1-8b"]), name="llama-3.1-8b", source="test")
    small = spec_from_hf_config({**TP_DRAFT, **draft}, name="small", source="test")
    return target, resolve(target, CacheConfig(max_model_len=4096, kv_cache_memory=1 << 30, num_speculative_tokens=2),
                           ParallelConfig(tp), "cuda", draft_spec=small)


@pytest.mark.parametrize("kv_heads, per_rank, per_slot", [
    (8, 2, 1),  # split like the target's (8 / 4): the target's page per rank, the draft joins its group
    (2, 1, 2),  # fewer KV heads than ranks: replicated (1 per rank), half the page, 2 layers per page slot
])
def test_draft_at_tensor_parallelism_is_planned_per_rank(kv_heads, per_rank, per_slot):
    target, plan = _tp_plan(4, num_key_value_heads=kv_heads)
    # Accepted at TP > 1 (every rank runs its slice of the draft; tests/test_speculative_draft_tp.py).
    check_speculative(SpeculativeConfig("draft_model", 2, model="small"), target, plan, max_num_batched_tokens=64)
    assert [lp.kv_heads_per_rank for lp in plan.draft.layers] == [per_rank, per_rank]
    assert [lp.heads_per_rank for lp in plan.draft.layers] == [2, 2]
    assert plan.draft.bytes_per_token == 2 * per_rank * 2 * 128 * 2  # layers x KV heads x (K, V) x 128 x bf16
    assert [g.draft_layers_per_slot for g in plan.groups if g.draft_layers] == [per_slot]


def test_draft_whose_kv_heads_do_not_split_over_tp_is_refused():
    with pytest.raises(PlanError, match="draft model small: --tensor-parallel-size 2 and num_key_value_heads 3"):
        _tp_plan(2, num_attention_heads=6, num_key_value_heads=3)


def test_preset_draft_for_a_real_target_is_refused(no_weights, tmp_path):
    target = _config_dir(tmp_path, "qwen3-8b")
    with pytest.raises(ConfigError, match="is a preset without weights but the target"):
        _engine(target, load_format="auto", speculative_config={"method": "draft_model", "model": "qwen3-8b",
                                                                "num_speculative_tokens": 2})


def test_more_tokens_than_the_step_budget_is_refused(no_weights):
    with pytest.raises(ConfigError, match="exceeds --max-num-batched-tokens 4"):
        _engine(num_speculative_tokens=4, max_num_batched_tokens=4)


def test_more_tokens_than_max_model_len_is_refused(no_weights):
    with pytest.raises(ConfigError, match="leaves no room in max-model-len 8"):
        _engine(num_speculative_tokens=7, max_model_len=8, max_num_batched_tokens=64)


def test_backoff_must_be_a_bool():
    with pytest.raises(ConfigError, match="backoff must be true or false, got 'yes'"):
        resolve_speculative({"method": "ngram", "num_speculative_tokens": 2, "backoff": "yes"}, 0)
    assert resolve_speculative({"num_speculative_tokens": 2, "backoff": False}, 0).backoff is False
    assert resolve_speculative(None, 2).backoff is True


def test_cli_reports_a_bad_config_without_traceback(capsys):
    assert main(["generate", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}',
                 "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "num_speculative_tokens must be an integer >= 1, got 0" in err
    assert "set num_speculative_tokens to 1 or more, or omit --speculative-config" in err


def test_plan_cli_takes_the_config(capsys):
    assert main(["plan", "csa-ring-test", "--json", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 3}']) == 0
    assert json.loads(capsys.readouterr().out)["num_speculative_tokens"] == 3

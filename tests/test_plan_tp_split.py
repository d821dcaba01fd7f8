"""The plan refuses exactly the tensor-parallel sizes the TP model classes cannot cut a model into.

The plan decides from the config alone, without torch (heads, then kvforge/spec/tp_split_sizes.py's MLP
and expert sizes); each TP model class checks its own cut when it is built (``check_split``, reading the
config through the model's own argument parsing). For the presets and for tiny configs whose MLP and
expert sizes only some TP sizes divide, every TP size from 1 to 16 gets the same answer from both, and a
refused size's message lists the sizes that work.
"""

from __future__ import annotations

import json

import pytest

import kvforge
from kvforge.errors import ConfigError, PlanError
from kvforge.planner.resolver import tp_sizes_that_work
from kvforge.spec.architectures import text_model_config
from kvforge.spec.layers import MLALayerSpec, StateLayerSpec
from kvforge.spec.load import load_model_spec

transformers = pytest.importorskip("transformers")

from tiny_checkpoints import CASES as TINY  # noqa: E402

from kvforge.distributed.tp_models import TP_MODELS, check_tp_architecture  # noqa: E402

PRESETS = ["llama-3.1-8b", "qwen3-8b", "mistral-7b", "gemma-3-27b", "gpt-oss-20b", "deepseek-v2-lite",
           "deepseek-v3", "kimi-k2", "qwen3-next-80b-a3b", "kimi-linear-48b-a3b"]
#: Tiny configs (tests/tiny_checkpoints.py) with sizes that some TP sizes do not divide.
TINY_VARIANTS = [("gemma3", dict(intermediate_size=90)), ("gpt-oss", dict(num_local_experts=6)),
                 ("gpt-oss", dict(num_local_experts=12, num_attention_heads=8, num_key_value_heads=4)),
                 ("qwen3-next", dict(num_experts=6, shared_expert_intermediate_size=36)),
                 ("qwen3-next", dict(intermediate_size=100, linear_num_key_heads=4, linear_num_value_heads=8)),
                 ("kimi-linear", dict(num_local_experts=6, n_shared_experts=1, n_group=2, topk_group=1)),
                 ("kimi-linear", dict(intermediate_size=90))]


def _tiny_checkpoint(case, overrides, path) -> str:
    """A directory holding the tiny config (no weights: the plan reads none)."""
    config_cls, model_cls, base, _ = TINY[case]
    config = getattr(transformers, config_cls)(**{**base, **overrides}).to_dict()
    config["architectures"] = [model_cls]
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _class_accepts(spec, tp: int) -> bool:
    """The TP model class's own answer, given the heads per rank the plan's rule would give."""
    config = dict(text_model_config(spec.hf_config))
    arch = check_tp_architecture(config)
    config["architectures"] = [arch]
    layer = next(ls for ls in spec.layers if not isinstance(ls, StateLayerSpec))
    heads = layer.num_heads
    if isinstance(layer, MLALayerSpec):
        kv = 1
    else:
        kv = layer.num_kv_heads // tp if layer.num_kv_heads % tp == 0 else 1
    try:
        TP_MODELS[arch].check_split(config, tp, heads // tp, kv)
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("spec", [pytest.param(p, id=p) for p in PRESETS]
                         + [pytest.param(v, id=f"{v[0]}-{'-'.join(v[1])}") for v in TINY_VARIANTS])
def test_the_plan_and_the_tp_model_refuse_the_same_sizes(spec, tmp_path):
    model = spec if isinstance(spec, str) else _tiny_checkpoint(*spec, tmp_path)
    spec = load_model_spec(model)
    works = tp_sizes_that_work(spec)
    assert [tp for tp in works if tp <= 16] == [tp for tp in range(1, 17) if _class_accepts(spec, tp)]
    refused = next((tp for tp in range(2, 17) if tp not in works), None)
    if refused is not None:
        with pytest.raises(PlanError, match=f"TP sizes that split this whole model: {', '.join(map(str, works))}$"):
            kvforge.plan(model, tensor_parallel_size=refused, device="cuda", kv_cache_memory="8GiB",
                         max_model_len=256)


def test_sizes_only_the_mlp_or_experts_refuse_are_refused_by_the_plan(tmp_path):
    """Heads that split, an MLP or expert count that does not: the plan says so before anything loads."""
    with pytest.raises(PlanError, match="does not divide num_local_experts 32: .* 1, 2, 4, 8, 16, 32$"):
        kvforge.plan("gpt-oss-20b", tensor_parallel_size=64, device="cuda", kv_cache_memory="8GiB")
    with pytest.raises(PlanError, match="does not divide intermediate_size 90"):
        kvforge.plan(_tiny_checkpoint("gemma3", dict(intermediate_size=90), tmp_path), tensor_parallel_size=4,
                     device="cuda", kv_cache_memory="8GiB", max_model_len=256)

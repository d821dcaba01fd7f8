"""The plan's verify rows of linear-attention layers (speculative decoding), hand-computed from the presets.

With ``k`` speculative tokens each state layer keeps, per sequence, ``1 + k`` float32 rows of one token's
inputs to its state update (docs/LINEAR_ATTENTION.md, "Speculative decoding"). They are part of the state
bytes per sequence, so the concurrency and the state-slot count include them, and the models' layouts
(what the pool carves) must agree with the spec's count.
"""

from __future__ import annotations

import json

import pytest

from kvforge.planner.inputs import CacheConfig, ParallelConfig
from kvforge.planner.resolver import resolve
from kvforge.spec.architectures import spec_from_hf_config
from kvforge.spec.presets import PRESETS

MEMORY, LENGTH = 40 * 2**30, 4096
# One token's inputs, from the presets' configs:
#   Qwen3-Next-80B: conv input 2 x 16 x 128 + 32 x 128, k 16 x 128, v 32 x 128, gate and beta 32 each;
#   Kimi-Linear-48B: conv input 3 x 32 x 128, k and v 32 x 128, a gate per key channel 32 x 128, beta 32.
TOKEN_INPUTS = {"qwen3-next-80b-a3b": (2 * 2048 + 4096) + 2048 + 4096 + 2 * 32,
                "kimi-linear-48b-a3b": 3 * 4096 + 4096 + 4096 + 4096 + 32}
STATE_LAYERS = {"qwen3-next-80b-a3b": 36, "kimi-linear-48b-a3b": 20}


def _plan(name: str, k: int, tp: int = 1):
    spec = spec_from_hf_config(dict(PRESETS[name]), name=name, source="test")
    return resolve(spec, CacheConfig(kv_cache_dtype="auto", kv_cache_memory=MEMORY, max_model_len=LENGTH,
                                     num_speculative_tokens=k), ParallelConfig(tp))


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", TOKEN_INPUTS)
def test_verify_rows_are_counted_in_the_state_bytes(name, k):
    base, spec = _plan(name, 0), _plan(name, k)
    rows = (k + 1) * TOKEN_INPUTS[name] * 4
    state = [x for x in spec.layers if x.kind == "state"]
    assert len(state) == STATE_LAYERS[name] and all(x.verify_replay_bytes == rows for x in state)
    assert all(x.verify_replay_bytes == 0 for x in base.layers)
    assert all(x.verify_replay_bytes == 0 for x in spec.layers if x.kind != "state")
    extra = STATE_LAYERS[name] * rows
    assert spec.verify_replay_bytes_per_sequence() == extra
    assert spec.state_bytes_per_sequence - base.state_bytes_per_sequence == extra
    assert spec.capacity.bytes_per_sequence - base.capacity.bytes_per_sequence == extra
    assert spec.max_concurrency == pytest.approx(MEMORY / spec.capacity.bytes_per_sequence, abs=1e-4)  # 4 decimals
    assert spec.capacity.state_slots == int(spec.max_concurrency) < base.capacity.state_slots
    assert f"{extra} of the state bytes/sequence: verify rows" in spec.summary()


def test_verify_rows_split_with_the_heads():
    name = "qwen3-next-80b-a3b"
    one, two = _plan(name, 3), _plan(name, 3, tp=2)
    state = [x for x in two.layers if x.kind == "state"]
    assert all(x.verify_replay_bytes * 2 == one.layers[x.index].verify_replay_bytes for x in state)


@pytest.mark.parametrize("name", TOKEN_INPUTS)
def test_the_models_layouts_agree_with_the_spec(name):
    """The pool carves the rows from the model's layout; the plan counts them from the spec."""
    from kvforge.models.registry import get_model_class

    config = dict(PRESETS[name])
    spec = spec_from_hf_config(config, name=name, source="test")
    layout = get_model_class(config).ARGS(config).linear_state_layout()
    counts = {layer.token_input_elements for layer in spec.layers if layer.kind == "state"}
    assert counts == {layout.token_input_elements} == {TOKEN_INPUTS[name]}


def test_kvforge_plan_shows_the_verify_rows(capsys):
    from kvforge.cli import main

    argv = ["plan", "qwen3-next-80b-a3b", "--kv-cache-memory", "40GiB", "--max-model-len", str(LENGTH),
            "--num-speculative-tokens", "3"]
    assert main(argv) == 0
    rows = STATE_LAYERS["qwen3-next-80b-a3b"] * 4 * TOKEN_INPUTS["qwen3-next-80b-a3b"] * 4
    assert f"of which {rows:,} keep a verify step's 4 rows" in " ".join(capsys.readouterr().out.split())
    assert main([*argv, "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["layers"]
    assert {x["verify_replay_bytes"] for x in layers if x["kind"] == "state"} == {4 * 4 * TOKEN_INPUTS[
        "qwen3-next-80b-a3b"]}

"""Settings that change nothing for the engine they are given to are warned of at startup: CUDA-graph sizes on
CPU or under --enforce-eager, an MLA prefill mode on CPU or for a model without MLA layers."""

from __future__ import annotations

import logging

import pytest

from kvforge.config import EngineArgs


@pytest.mark.parametrize("kwargs,platform,has_mla,expected", [
    (dict(), "cpu", False, []),
    (dict(enforce_eager=True), "cpu", False, []),  # vLLM users pass it habitually; the CPU is eager anyway
    (dict(cuda_graph_sizes=[1, 2]), "cuda", False, []),
    (dict(cuda_graph_sizes=[1, 2]), "cpu", False, ["--cuda-graph-sizes has no effect: the CPU engine runs eagerly"]),
    (dict(cuda_graph_sizes=[1, 2], enforce_eager=True), "cuda", False,
     ["--cuda-graph-sizes has no effect: --enforce-eager captures no graphs"]),
    (dict(mla_prefill_mode="sdpa"), "cuda", True, []),
    (dict(mla_prefill_mode="sdpa"), "cuda", False, ["--mla-prefill-mode sdpa has no effect: the model has no MLA "
                                                    "layers"]),
    (dict(mla_prefill_mode="absorbed"), "cpu", True, ["--mla-prefill-mode absorbed has no effect: MLA layers on CPU "
                                                      "run the reference path, which has one way to prefill"]),
])
def test_settings_without_effect(kwargs, platform, has_mla, expected):
    assert EngineArgs(**kwargs).settings_without_effect(platform, has_mla) == expected


def test_the_cpu_engine_warns_of_them(smol_llm, caplog):
    caplog.set_level(logging.WARNING, logger="kvforge")
    smol_llm(device="cpu", cuda_graph_sizes=(1, 3), mla_prefill_mode="sdpa", max_model_len=640)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "--cuda-graph-sizes has no effect: the CPU engine runs eagerly" in warned
    assert "--mla-prefill-mode sdpa has no effect: the model has no MLA layers" in warned

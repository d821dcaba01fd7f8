"""A plan that resolves holds a request of max-model-len: with sliding-window groups the scheduler charges
such a request its windows plus the chunk of the step budget it computes (a window plus a chunk in every
sliding group), so the planner asks the memory for that too, and otherwise refuses before any weight is
read, naming the fix (kvforge/planner/resolver.py, ``_chunk_blocks``)."""

from __future__ import annotations

import re

import pytest

from kvforge.engine.block_manager import BlockManager
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.scheduler import Scheduler
from kvforge.engine.sequence import Sequence
from kvforge.errors import InvalidRequestError, PlanError
from kvforge.planner.inputs import CacheConfig
from kvforge.planner.resolver import resolve
from kvforge.spec.architectures import spec_from_hf_config
from kvforge.spec.presets import PRESETS


def _spec(name, layers):
    return spec_from_hf_config({**PRESETS[name], "num_hidden_layers": layers}, name=name, source="test")


def _admits_a_longest_request(plan, budget) -> bool:
    windows = tuple(g.sliding_window for g in plan.groups if g.kind in ("full", "sliding"))
    bm = BlockManager(plan.num_blocks, plan.block_size, False, group_windows=windows)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=plan.max_model_len)
    L = plan.max_model_len
    try:
        sched.add(Sequence("longest", [1] * (L - 1), SamplingParams(max_tokens=1, ignore_eos=True)))
    except InvalidRequestError:
        return False
    return True


@pytest.mark.parametrize("name,layers,max_len", [("gpt-oss-20b", 4, 512), ("gemma-3-27b", 12, 2048)])
@pytest.mark.parametrize("budget", [256, 2048, 8192])
def test_every_resolved_plan_admits_a_request_of_max_model_len(name, layers, max_len, budget):
    spec = _spec(name, layers)
    probe = resolve(spec, CacheConfig(max_model_len=max_len, kv_cache_memory=10**9, max_num_batched_tokens=budget))
    per_seq = probe.capacity.bytes_per_sequence
    resolved = refused = 0
    for frac in [x / 20 for x in range(18, 60)]:  # 0.9 to 3 sequences' bytes
        cache = CacheConfig(max_model_len=max_len, kv_cache_memory=int(frac * per_seq), max_num_batched_tokens=budget)
        try:
            plan = resolve(spec, cache)
        except PlanError as exc:
            refused += 1
            assert "--max-num-batched-tokens" in str(exc) or "--max-model-len" in str(exc)
            continue
        resolved += 1
        assert _admits_a_longest_request(plan, budget), f"{frac:.2f} sequences' bytes"
    assert resolved and refused


def test_the_refusal_names_the_memory_that_works():
    spec, budget, max_len = _spec("gemma-3-27b", 12), 8192, 2048
    per_seq = resolve(spec, CacheConfig(max_model_len=max_len, kv_cache_memory=10**9,
                                        max_num_batched_tokens=budget)).capacity.bytes_per_sequence
    with pytest.raises(PlanError, match="only while it decodes") as info:
        resolve(spec, CacheConfig(max_model_len=max_len, kv_cache_memory=per_seq, max_num_batched_tokens=budget))
    need = int(re.search(r"give at least (\d+) bytes", str(info.value)).group(1))
    plan = resolve(spec, CacheConfig(max_model_len=max_len, kv_cache_memory=need, max_num_batched_tokens=budget))
    assert _admits_a_longest_request(plan, budget)
    assert plan.capacity.chunk_bytes == need - per_seq > 0
    # A smaller chunk needs less: the same memory as one decoding sequence suffices for a one-block chunk.
    small = resolve(spec, CacheConfig(max_model_len=max_len, kv_cache_memory=need - 1,
                                      max_num_batched_tokens=16)) if need - 1 >= per_seq else None
    assert small is None or _admits_a_longest_request(small, 16)


def test_plan_json_reports_the_chunk_bytes(capsys):
    """``kvforge plan --json``: ``chunk_bytes`` grows with --max-num-batched-tokens (the chunk), the
    concurrency (a decode figure) does not; a model without sliding groups reports 0."""
    import json

    from kvforge.cli import main

    def plan(model, budget):
        assert main(["plan", model, "--device", "cuda", "--max-model-len", "8192", "--kv-cache-memory", str(20 * 10**9),
                     "--max-num-batched-tokens", str(budget), "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    small, large = plan("gemma-3-27b", 512), plan("gemma-3-27b", 8192)
    assert 0 < small["chunk_bytes"] < large["chunk_bytes"]
    assert small["max_concurrency"] == large["max_concurrency"]
    assert plan("llama-3.1-8b", 8192)["chunk_bytes"] == 0

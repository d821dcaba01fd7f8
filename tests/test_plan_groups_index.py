"""Groups for hybrid sliding/full models and index-width checks."""

import pytest

from kvforge.attention.reference_backend import REFERENCE
from kvforge.errors import PlanError
from kvforge.planner.declaration import INT32_MAX, BackendDeclaration, IndexLimit
from kvforge.planner.inputs import CacheConfig, ParallelConfig
from kvforge.planner.resolver import resolve
from kvforge.spec.architectures import spec_from_hf_config
from kvforge.spec.presets import PRESETS


def spec(name):
    return spec_from_hf_config(PRESETS[name], name=name, source="test")


def test_alternating_sliding_full_two_groups_no_padding():
    p = resolve(spec("gpt-oss-20b"), CacheConfig(kv_cache_dtype="fp8"))
    kinds = sorted(g.kind for g in p.groups)
    assert kinds == ["full", "sliding"]
    assert p.group_size == 12 and p.padding_layers == 0 and p.worst_case_waste_pct == 0
    full = next(g for g in p.groups if g.kind == "full")
    assert full.layers == tuple(range(1, 24, 2))
    # full layers grow with context: 12 x 8 KV heads x 128 x 1 byte
    assert p.bytes_per_token == 12 * 8 * 128
    # the sliding group holds the blocks a decode step's window touches: 127 earlier tokens + the new one
    # span at most 9 blocks of 16 when not aligned to a block edge; a block id spans 12 layers x 16 tokens x
    # 1024 bytes (8 KV heads x 128 x 1 byte)
    assert p.block_size == 16
    assert p.state_bytes_per_sequence == 9 * 12 * 16 * 8 * 128


def test_five_to_one_pattern_reports_padding_and_waste():
    # gemma-3-1b: 26 layers, every 6th global -> 4 full, 22 sliding.
    p = resolve(spec("gemma-3-1b"), CacheConfig())
    full = [g for g in p.groups if g.kind == "full"]
    sliding = [g for g in p.groups if g.kind == "sliding"]
    assert [g.layers for g in full] == [(5, 11, 17, 23)]
    # group size 4: 22 sliding layers -> 6 groups of 4 (24 slots), 2 padding layers
    assert p.group_size == 4 and len(sliding) == 6
    assert p.padding_layers == 2 and sum(g.padding_layers for g in sliding) == 2
    assert p.worst_case_waste_pct == pytest.approx(100 * 2 / 28, abs=0.01)
    assert any("worst-case waste 7.1%" in w for w in p.warnings)


def test_int32_row_offset_limit_fails_with_numbers():
    mla32 = BackendDeclaration(
        name="mla_int32", priority=5, layer_kinds=frozenset({"mla"}), platforms=frozenset({"cpu"}),
        kv_dtypes=REFERENCE.kv_dtypes, head_sizes=None, block_sizes=REFERENCE.block_sizes,
        quantized_query=REFERENCE.quantized_query,
        index_limit=IndexLimit("row_byte_offset", INT32_MAX, "int32 row-base arithmetic"),
    )
    max_slots = INT32_MAX // 576 + 1
    assert max_slots == 3728271 and abs(max_slots - 2**31 / 576) < 1  # ~3.73M
    # fp8 MLA row = 576 bytes; 61 layers x 576 bytes per token; 300 GB holds ~8.5M tokens
    s = spec("deepseek-v3")
    with pytest.raises(PlanError) as exc:
        resolve(s, CacheConfig(kv_cache_dtype="fp8", kv_cache_memory=300 * 10**9, max_model_len=163840),
                ParallelConfig(8), backends=(mla32, REFERENCE))
    msg = str(exc.value)
    assert "576-byte rows" in msg and "3728271 slots" in msg and "mla_int32" in msg
    # 100 GB -> 100e9 / (61 x 576 x 16) blocks x 16 < 3.73M slots: fine
    ok = resolve(s, CacheConfig(kv_cache_dtype="fp8", kv_cache_memory=100 * 10**9, max_model_len=163840),
                 ParallelConfig(8), backends=(mla32, REFERENCE))
    check = ok.index_checks[0]
    assert check.ok and check.row_bytes == 576 and check.planned_slots == ok.num_blocks * 16 < max_slots


@pytest.mark.parametrize("name,ok,words", [
    ("llama-3.1-8b", True, "every group"),
    ("gpt-oss-20b", True, "sliding-window groups from the blocks inside the window"),
    ("csa-ring-test", False, "ring"),
    ("qwen3-next-80b-a3b", True, "state layers from a snapshot"),
])
def test_plan_says_whether_prefix_caching_works_and_why(name, ok, words):
    p = resolve(spec(name), CacheConfig())
    assert p.prefix_caching is ok
    assert words in p.prefix_caching_reason and p.prefix_caching_reason.startswith("on:" if ok else "off:")
    d = p.to_dict()
    assert d["prefix_caching"] is ok and d["prefix_caching_reason"] == p.prefix_caching_reason


def test_plan_says_how_many_state_slots_running_requests_leave_for_snapshots():
    """A state layer's snapshot lives in a state slot no running request holds: the plan counts what
    --max-num-seqs leaves of the capacity's slots, and says when a full engine holds them all."""
    s = spec("qwen3-next-80b-a3b")
    per_seq = resolve(s, CacheConfig(max_model_len=4096, kv_cache_memory=10**12)).capacity
    bytes_per_seq = per_seq.kv_cache_memory / per_seq.max_concurrency  # one sequence's state and blocks
    memory = int(bytes_per_seq * 10.5)  # ten sequences of --max-model-len
    roomy = resolve(s, CacheConfig(max_model_len=4096, kv_cache_memory=memory, max_num_seqs=4))
    assert roomy.capacity.state_slots == 10
    assert ("; at most 4 running requests (--max-num-seqs) leave 6 of the 10 state slots for snapshots"
            in roomy.prefix_caching_reason)
    full = resolve(s, CacheConfig(max_model_len=4096, kv_cache_memory=memory, max_num_seqs=10))
    assert ("the 10 state slots are no more than --max-num-seqs 10, so a full engine keeps no snapshot"
            in full.prefix_caching_reason)  # equal: nothing capped
    assert "set --max-num-seqs below 10, or give the KV cache more memory" in full.prefix_caching_reason
    over = resolve(s, CacheConfig(max_model_len=4096, kv_cache_memory=memory, max_num_seqs=12))
    assert "--max-num-seqs 12 (running requests capped at 10), so" in over.prefix_caching_reason
    unsized = resolve(s, CacheConfig(max_model_len=4096))  # no memory given: no slot count to speak of
    assert unsized.capacity.state_slots is None and "--max-num-seqs" not in unsized.prefix_caching_reason

"""Block-size negotiation for the CsaRingTest model (docs/PLANNER.md, "A ring that must fit in one page").

4 KV heads, head_dim 192 (K and V): one KV head costs 2 x 192 = 384 elements
per token. The ring needs (7 + spec tokens) rows of 1024 bytes in one page.
"""

import logging

import pytest

from kvforge.attention.reference_backend import REFERENCE
from kvforge.attention.ring_backend import RING
from kvforge.errors import PlanError
from kvforge.planner.declaration import BackendDeclaration
from kvforge.planner.inputs import CacheConfig, ParallelConfig
from kvforge.planner.resolver import resolve
from kvforge.spec.architectures import spec_from_hf_config
from kvforge.spec.presets import PRESETS


def ring_spec(**over):
    cfg = dict(PRESETS["csa-ring-test"], **over)
    return spec_from_hf_config(cfg, name="ring", source="test")


def plan(tp, kv, **cache):
    return resolve(ring_spec(), CacheConfig(kv_cache_dtype=kv, **cache), ParallelConfig(tp))


@pytest.mark.parametrize("tp,expected", [(1, 16), (2, 16), (8, 32)])
def test_fp8_picks(tp, expected):
    p = plan(tp, "fp8")
    assert p.block_size == expected
    # page at the pick: tokens x KV heads per rank x 384 bytes (fp8: 1 byte/elem)
    kv_heads = max(4 // tp, 1)
    full = next(g for g in p.groups if g.kind == "full")
    assert full.page_bytes_unpadded == expected * kv_heads * 384


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_bf16_stays_16(tp):
    assert plan(tp, "bf16").block_size == 16


def test_log_line_names_the_forcing_backend(caplog):
    with caplog.at_level(logging.INFO, logger="kvforge.plan"):
        p = plan(8, "fp8")
    assert "Setting kv cache block size to 32 for csa_ring backend(s)." in caplog.text
    assert p.block_size_reason.startswith("Setting kv cache block size to 32 for csa_ring backend(s).")


def test_no_log_line_when_16_works(caplog):
    with caplog.at_level(logging.INFO, logger="kvforge.plan"):
        plan(2, "fp8")
    assert "Setting kv cache block size" not in caplog.text


def test_speculative_tokens_grow_the_ring():
    # 7 + 6 = 13 rows x 1024 = 13312 bytes; 32 x 384 = 12288 < 13312 <= 64 x 384 = 24576
    assert plan(8, "fp8", num_speculative_tokens=6).block_size == 64
    # 7 + 5 = 12 rows = 12288 bytes: exactly fits at 32
    assert plan(8, "fp8", num_speculative_tokens=5).block_size == 32


def test_padding_is_not_room_for_the_ring():
    padded = BackendDeclaration(
        name="padded_attn", priority=5, layer_kinds=frozenset({"full"}), platforms=frozenset({"cpu"}),
        kv_dtypes=REFERENCE.kv_dtypes, head_sizes=None, block_sizes=REFERENCE.block_sizes,
        quantized_query=REFERENCE.quantized_query, index_limit=REFERENCE.index_limit,
        page_padding_bytes=8192,  # a 6144-byte page would pad to 8192 >= 7168 ring bytes
    )
    p = resolve(ring_spec(), CacheConfig(kv_cache_dtype="fp8"), ParallelConfig(8), backends=(padded, REFERENCE, RING))
    assert p.block_size == 32
    full = next(g for g in p.groups if g.kind == "full")
    assert full.backend == "padded_attn"
    assert full.page_bytes_unpadded == 12288 and full.page_bytes == 16384


def test_forced_block_16_fails_with_numbers_and_fix():
    with pytest.raises(PlanError) as exc:
        plan(8, "fp8", block_size=16)
    msg = str(exc.value)
    assert "7 rows" in msg and "1024 bytes" in msg and "6144 bytes" in msg
    assert "--block-size 32" in msg


def test_forced_block_32_accepted():
    p = plan(8, "fp8", block_size=32)
    assert p.block_size == 32 and p.block_size_reason == "set by --block-size 32"


def test_forced_block_respects_every_backend():
    only64 = BackendDeclaration(
        name="only_multiples_of_64", priority=5, layer_kinds=frozenset({"full"}), platforms=frozenset({"cpu"}),
        kv_dtypes=REFERENCE.kv_dtypes, head_sizes=None,
        block_sizes=type(REFERENCE.block_sizes)(multiple_of=64, why="test"),
        quantized_query=REFERENCE.quantized_query, index_limit=REFERENCE.index_limit,
    )
    backends = (only64, REFERENCE, RING)
    assert resolve(ring_spec(), CacheConfig(kv_cache_dtype="bf16"), ParallelConfig(1), backends=backends).block_size == 64
    with pytest.raises(PlanError, match="only_multiples_of_64.*multiple of 64"):
        resolve(ring_spec(), CacheConfig(kv_cache_dtype="bf16", block_size=32), ParallelConfig(1), backends=backends)

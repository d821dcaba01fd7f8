"""Which fp8 decode kernel and split count the Triton backend launches, and when Gluon may run
at all (pure Python, CPU).

Numbers hand-computed from ``choose_variant_and_splits``' rule for an H200 (132 SMs):
fill = ceil(4 * 132 / programs); the warp kernel needs ctx >= 2048 and
programs * min(fill, ctx // 1024) >= 264; otherwise the cta kernel with min(fill, ctx // 256).
A forced split count replaces the count only.
"""

from __future__ import annotations

import pytest

from kvforge.kernels.gluon_fp8_decode import choose_variant_and_splits
from kvforge.kernels.gluon_support import gluon_enabled


@pytest.mark.parametrize(
    "num_seqs,kv_heads,ctx,forced,expected",
    [
        (64, 8, 8192, None, ("warp", 2)),  # 512 programs, fill 2, by length 8
        (256, 8, 32768, None, ("warp", 1)),  # 2048 programs fill the GPU alone
        (8, 8, 32768, None, ("warp", 9)),  # fill ceil(528 / 64) = 9 < 32
        (8, 8, 8192, None, ("warp", 8)),  # by length: 8 splits of 1024 tokens
        (1, 8, 8192, None, ("cta", 32)),  # 8 x 8 = 64 programs < 264: cta, 256-token splits
        (64, 8, 1024, None, ("cta", 2)),  # short context: cta
        (256, 8, 1024, None, ("cta", 1)),
        (8, 8, 32768, 3, ("warp", 3)),  # forced splits replace the count, not the kernel
        (1, 8, 32768, 64, ("cta", 64)),  # shape rule: warp would get 32 splits x 8 = 256 < 264 -> cta
        (1, 8, 32768, 0, ("cta", 1)),  # 0 means 1, as in the tl.dot path
    ],
)
def test_variant_and_splits(num_seqs, kv_heads, ctx, forced, expected):
    assert choose_variant_and_splits(num_seqs, kv_heads, ctx, 132, forced) == expected


@pytest.mark.parametrize(
    "version,env,expected",
    [
        ("3.6.0", None, True),
        ("3.6.1", "0", True),
        ("3.6.0", "1", False),  # KVFORGE_DISABLE_GLUON=1
        ("3.6.0", "yes", False),
        ("3.9.0", None, False),  # Gluon's async copy API changed after 3.6
        ("3.5.1", None, False),
        (None, None, False),  # no Triton
    ],
)
def test_gluon_gate(version, env, expected):
    assert gluon_enabled(version, env) is expected


@pytest.mark.parametrize(
    "q_dtype,kv_dtype,head,max_query_len,group,expected",
    [
        ("bfloat16", "float8_e4m3fn", 128, 1, 4, True),
        ("float16", "float8_e5m2", 64, 1, 16, True),
        ("bfloat16", "float8_e4m3fn", 256, 1, 1, True),
        ("bfloat16", "float8_e4m3fn", 128, 2, 4, False),  # not a decode batch
        ("bfloat16", "float8_e4m3fn", 128, 1, 17, False),  # more than 16 query heads per KV head
        ("bfloat16", "float8_e4m3fn", 96, 1, 4, False),  # head size not a Gluon tile
        ("bfloat16", "bfloat16", 128, 1, 4, False),  # not an fp8 cache
        ("float32", "float8_e4m3fn", 128, 1, 4, False),  # float32 query keeps IEEE dots
    ],
)
def test_supports(monkeypatch, q_dtype, kv_dtype, head, max_query_len, group, expected):
    """Which calls the Gluon fp8 decode takes, with the device gate forced open (CPU tensors)."""
    import torch

    from kvforge.kernels import gluon_fp8_decode

    monkeypatch.setattr(gluon_fp8_decode, "gluon_runs_on", lambda t: True)
    q = torch.zeros(2, 4 * group, head, dtype=getattr(torch, q_dtype))
    cache = torch.zeros(1, 2, 4, 16, head, dtype=getattr(torch, kv_dtype))
    assert gluon_fp8_decode.supports(q, cache, max_query_len, group) is expected

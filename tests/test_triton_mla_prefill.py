"""The query-tiled MLA prefill kernel (kvforge/kernels/triton_mla_prefill.py) and the backend's steps with a
prefill chunk that use it (kvforge/attention/triton_mla.py): compiled on a GPU, in Triton's CPU interpreter
elsewhere (tests/triton_kernel_device.py). Latent 64 / rope 16 and 48 / 8 (padded in registers).

Oracle: the float64 formula over the cache rows read back and dequantized, each query token over its causal
prefix: ``s = softmax_scale * (q_latent . c + q_rope . k_rope)``, ``o = softmax(s) @ c`` (the same bounds as
tests/test_triton_mla_small_shapes.py: 2**-6 of max|ref| for 16-bit queries, 1e-5 for float32). Outputs
start as NaN: the rows a tile names must be written, every other row left alone; cache rows no sequence
owns hold NaN and must never be read.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mla_cache_rows import FP8, paged_rows
from triton_kernel_device import (
    BF16_DOT,
    DEVICE,
    INTERPRETED,
    requires_kernels,
    skip_unless_loaded_loop_bounds_work,
)

from kvforge.attention.metadata import AttentionMetadata
from kvforge.attention.routing import mla as mla_routing
from kvforge.kernels.triton_mla_prefill import mla_prefill_tiled, query_tiles

SOFTMAX_SCALE = 0.3


def _causal_reference(q_latent, q_rope, stored, r, query_lens, first_rows):
    """float64 latent attention of each sequence's query tokens over their causal prefixes: ``{row: [H, R]}``."""
    out = {}
    for rows, q, first in zip(stored, query_lens, first_rows):
        prefix = rows.shape[0] - q
        for j in range(q):
            keys = rows[: prefix + j + 1]
            c, kr = keys[:, :r], keys[:, r:]
            t = first + j
            s = SOFTMAX_SCALE * (q_latent[t].double() @ c.T + q_rope[t].double() @ kr.T)
            out[t] = torch.softmax(s, dim=-1) @ c
    return out


def test_query_tiles_hand_counts():
    """Tiles of 4 tokens over a 9-token prompt from scratch (rows 3-11), a 2-token chunk after 30 cached
    tokens (rows 0-1) and one token at context 8 (row 2): first row, tokens, block-table row, causal length of
    the first token, longest walk (length + tokens - 1) first, ties in sequence order."""
    table = query_tiles([3, 0, 2], [9, 2, 1], [9, 32, 8], [5, 7, 1], 4)
    assert table.dtype == np.int32 and table.flags.c_contiguous
    assert table.tolist() == [[0, 2, 7, 31], [11, 1, 5, 9], [7, 4, 5, 5], [2, 1, 1, 8], [3, 4, 5, 1]]
    with pytest.raises(ValueError, match="3 query tokens in a sequence of 2"):
        query_tiles([0], [3], [2], [0], 4)


def test_query_tiling_rule():
    """64 rows a program: heads rounded up to a power of two, tokens to fill; one token a program at 64 heads
    and more, where tiles share nothing and the decode kernels serve; short chunks stay per token."""
    assert [mla_routing.prefill_query_tiling(h) for h in (1, 3, 8, 16, 32, 64, 128)] == [
        (1, 64), (4, 16), (8, 8), (16, 4), (32, 2), (64, 1), (64, 1)]
    least = mla_routing.PREFILL_TILE_MIN_QUERY_LEN
    assert mla_routing.takes_query_tiles(least, 16) and not mla_routing.takes_query_tiles(least - 1, 16)
    assert mla_routing.takes_query_tiles(4096, 32) and not mla_routing.takes_query_tiles(4096, 64)


# (cache dtype, query dtype, bound)
CASES = [
    pytest.param(torch.float16, torch.float16, 2.0**-6, id="fp16"),
    pytest.param(torch.bfloat16, torch.bfloat16, 2.0**-6, id="bf16", marks=pytest.mark.skipif(INTERPRETED, reason=BF16_DOT)),
    pytest.param(torch.float32, torch.float32, 1e-5, id="fp32"),
    pytest.param(torch.float16, torch.bfloat16, 2.0**-6, id="fp16-cache-bf16q"),  # float32 IEEE dots
    pytest.param(torch.float8_e4m3fn, torch.bfloat16, 2.0**-6, id="e4m3-bf16q"),
    pytest.param(torch.float8_e5m2, torch.float16, 2.0**-6, id="e5m2-fp16q"),
]


@requires_kernels
@pytest.mark.parametrize("kv_dtype,q_dtype,bound", CASES)
@pytest.mark.parametrize("heads,r,p,block_size", [pytest.param(3, 64, 16, 16, id="h3-r64-p16-block16"),
                                                  pytest.param(17, 48, 8, 1, id="h17-r48-p8-block1")])
def test_tiled_prefill_matches_the_causal_formula(kv_dtype, q_dtype, bound, heads, r, p, block_size):
    """A 70-token prompt from scratch (the causal diagonal crosses 64-token key tiles), a 21-token chunk after
    50 cached tokens (its last tile partial), a 1-token chunk after 9; at 3 heads 16 tokens a program, at 17
    (two head blocks of 32, the second mostly empty) 2. Rows the tiles do not name stay NaN."""
    skip_unless_loaded_loop_bounds_work()
    gen = torch.Generator().manual_seed(heads + r)
    scale = 0.0625 if kv_dtype in FP8 else 1.0
    query_lens, lens = [70, 21, 1], [70, 71, 10]
    cache, tables, stored = paged_rows(lens, block_size, r + p, kv_dtype, scale, gen)
    first_rows = [2, 72, 0]  # rows 1 and 93-94 belong to no tile
    rows = 95
    q_latent = (torch.randn(rows, heads, r, generator=gen) * 0.5).to(q_dtype)
    q_rope = (torch.randn(rows, heads, p, generator=gen) * 0.5).to(q_dtype)
    tokens = mla_routing.prefill_query_tiling(heads)[1]
    table = torch.from_numpy(query_tiles(first_rows, query_lens, lens, [0, 1, 2], tokens)).to(DEVICE)
    out = torch.full((rows, heads, r), float("nan"), dtype=q_dtype, device=DEVICE)
    scale_t = torch.tensor([scale], device=DEVICE) if kv_dtype in FP8 else None
    got = mla_prefill_tiled(q_latent.to(DEVICE), q_rope.to(DEVICE), cache.to(DEVICE), table, tables.to(DEVICE),
                            scale_t, SOFTMAX_SCALE, out)
    assert got is out
    got = got.cpu()
    want = _causal_reference(q_latent, q_rope, stored, r, query_lens, first_rows)
    named = sorted(want)
    assert torch.isnan(got[[t for t in range(rows) if t not in want]]).all(), "a row no tile names was written"
    g = got[named].double()
    assert torch.isfinite(g).all(), "unwritten (NaN) or NaN-polluted outputs"
    w = torch.stack([want[t] for t in named])
    err = ((g - w).abs().max() / w.abs().max()).item()
    assert err <= bound, err


@requires_kernels
@pytest.mark.parametrize("mode", ["absorbed", "auto"])
def test_step_with_tiled_per_token_and_expanded_sequences(mode, monkeypatch):
    """The backend's step with a prefill chunk (``mla_attention``): in step order a 20-token prompt (tiles), a
    decoding sequence at context 40 (a decode query), a 3-token chunk after 12 cached tokens (decode queries),
    a 24-token chunk after 40 (tiles; under "auto", with the absorbed bound lowered to 60, expanded for
    torch's attention instead) and two padding tokens (zero). The latent rows leave step order (decode
    queries first), so the step gathers and scatters them. Against the float64 formula, ``o = w_uv
    softmax(s) c`` over each token's causal prefix, fp16."""
    import kvforge.attention.triton_mla as triton_mla

    skip_unless_loaded_loop_bounds_work()
    monkeypatch.setattr(mla_routing, "ABSORBED_PREFILL_MAX_SEQ_LEN", 60)
    gen = torch.Generator().manual_seed(3)
    heads, dn, r, p, v, block_size = 3, 8, 64, 16, 12, 16
    query_lens, lens = [20, 1, 3, 24], [20, 40, 15, 64]
    cache, tables, stored = paged_rows(lens, block_size, r + p, torch.float16, 1.0, gen)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
    num_tokens = qsl[-1] + 2
    q_nope = (torch.randn(num_tokens, heads, dn, generator=gen) * 0.5).to(torch.float16)
    q_rope = (torch.randn(num_tokens, heads, p, generator=gen) * 0.5).to(torch.float16)
    w_uk = (torch.randn(heads, dn, r, generator=gen) * 0.2).to(torch.float16)
    w_uv = (torch.randn(heads, v, r, generator=gen) * 0.2).to(torch.float16)
    meta = AttentionMetadata(torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                             torch.tensor(lens, dtype=torch.int32, device=DEVICE), tables.to(DEVICE),
                             torch.full((num_tokens,), -1, dtype=torch.int64, device=DEVICE), max(query_lens),
                             max(lens), block_size, host_query_start_loc=tuple(qsl), host_seq_lens=tuple(lens))
    step = triton_mla._prefill_step(meta, num_tokens, mode, heads)
    assert step.per_token.num_seqs == 4  # the decoding token and the 3-token chunk
    assert step.tokens is not None and step.num_rows == (48 if mode == "absorbed" else 24)
    assert step.expanded == (() if mode == "absorbed" else (3,))
    got = triton_mla.mla_attention(q_nope.to(DEVICE), q_rope.to(DEVICE), cache.to(DEVICE), meta, None,
                                   SOFTMAX_SCALE, w_uk.to(DEVICE), w_uv.to(DEVICE), prefill_mode=mode)
    assert got.shape == (num_tokens, heads, v)
    got = got.cpu().double()
    assert torch.all(got[qsl[-1]:] == 0)
    q_latent = torch.einsum("thd,hdr->thr", q_nope.double(), w_uk.double())
    want = _causal_reference(q_latent, q_rope, stored, r, query_lens, qsl[:-1])
    w = torch.stack([torch.einsum("hr,hvr->hv", want[t], w_uv.double()) for t in range(qsl[-1])])
    err = ((got[: qsl[-1]] - w).abs().max() / w.abs().max()).item()
    assert err <= 2.0**-6, err

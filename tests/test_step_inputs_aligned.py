"""Every device view of a step's inputs starts 16 bytes into its buffer times a whole number, for every KV
group and any batch: Triton specializes kernels on pointer alignment, so an alignment that moved with the
batch would compile new kernel variants while serving (docs/GPU_ENGINE.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge import LLM
from kvforge.engine.model_runner import pack_aligned


def _offset(t: torch.Tensor) -> int:
    return t.data_ptr() - t.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_pack_aligned_keeps_values_and_aligns_starts(dtype):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-9, 9, size=n).astype(dtype) for n in (1, 3, 0, 5, 2, 7)]
    packed, starts = pack_aligned(arrays)
    assert packed.dtype == dtype
    for a, start in zip(arrays, starts):
        assert start * packed.itemsize % 16 == 0
        np.testing.assert_array_equal(packed[start:start + a.size], a)
    assert starts == sorted(starts) and packed.size >= sum(a.size for a in arrays)


@pytest.fixture(scope="module")
def hybrid_llm(tmp_path_factory):
    from tiny_checkpoints import make_checkpoint

    path = tmp_path_factory.mktemp("gemma3")
    make_checkpoint("gemma3", path, sliding_window=8, max_position_embeddings=256)
    llm = LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True, progress=False, block_size=4,
              max_model_len=128, kv_cache_memory=1 << 22)
    yield llm
    llm.engine.shutdown()


@pytest.mark.parametrize("lens", [(1,), (1, 1, 1), (3, 2), (5, 1, 7), (1, 1, 1, 1, 1), (9, 4, 1, 2, 6, 3)])
@pytest.mark.parametrize("rows", [None, "last"])
def test_every_view_is_16_byte_aligned(hybrid_llm, lens, rows):
    runner = hybrid_llm.engine.runner
    groups = runner.num_groups
    assert groups > 1  # a hybrid model: one slot mapping and one block table per group
    bs = runner.block_size
    chunks = []
    for i, n in enumerate(lens):
        start = 3 * i
        need = -(-(start + n) // bs)  # blocks covering the context after the step, the same in every group
        chunks.append(([5] * n, start, [[1 + 10 * i + 100 * g + k for k in range(need)] for g in range(groups)]))
    logits_rows = None if rows is None else list(np.cumsum(lens) - 1)
    host = runner.build_host(chunks, logits_rows)
    ids, pos, metas, out_rows = runner._to_device(host)
    views = [ids, pos] + ([out_rows] if out_rows is not None else [])
    for meta in metas:
        views += [meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping]
        if meta.decode_order is not None:
            views.append(meta.decode_order)
    assert all(_offset(v) % 16 == 0 for v in views), [_offset(v) for v in views]
    # and the values are the host's
    np.testing.assert_array_equal(ids.numpy(), host.ids)
    for g, meta in enumerate(metas):
        np.testing.assert_array_equal(meta.slot_mapping.numpy(), host.slots[g])
        np.testing.assert_array_equal(meta.block_tables.numpy(), host.tables[g])
        np.testing.assert_array_equal(meta.seq_lens.numpy(), host.seq_lens)

"""On CUDA, under ``torch.cuda.set_sync_debug_mode("error")``: a sampled batch's sampling (every filter, seeds,
penalties, a logit bias, allowed tokens, min_tokens, deferred logprobs) and an eager step's slot batch make no
synchronizing call,
so the host never waits for the step in flight there (tests/blocking_copies.py checks the calls on CPU)."""

from __future__ import annotations

import pytest
import torch
from blocking_copies import every_rule_batch

from kvforge.attention.linear_state import SlotBatch
from kvforge.engine.sampler import Sampler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _no_sync(fn):
    torch.cuda.synchronize()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def test_sampling_never_synchronizes():
    logits, params, generators, histories, generated = every_rule_batch("cuda")
    out = _no_sync(lambda: Sampler().sample(logits, params, generators, histories, num_generated=generated,
                                            defer_logprobs=True))
    tokens = out.token_ids.tolist()
    assert tokens[2] in (1, 2, 3, 4) and tokens[3] != 7 and tokens[4] in out.logprobs.resolve()[4]


def test_slot_batches_never_synchronize():
    batch = _no_sync(lambda: SlotBatch.build([3, 2], [0, 1], [True, False], torch.device("cuda"), spec_lens=[2, 0],
                                             verify_rows=3, snapshots=[(1, 0, 2)]))
    assert batch.slot_ids.tolist() == [0, 1] and batch.has_initial_state.tolist() == [True, False]

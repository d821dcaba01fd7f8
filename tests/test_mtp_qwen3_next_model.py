"""The Qwen3-Next multi-token-prediction layer (kvforge/models/qwen3_next_mtp.py) against a float64 reference
built from transformers' Qwen3-Next modules (tests/qwen3_next_mtp_checkpoint.py), CPU, a tiny random
checkpoint in float32.

The target's prefill through the engine's runner leaves its hidden states (``last_hidden``); the MTP layer over
positions 0 .. T - 2 (tokens 1 .. T - 1 following them) gives logits that must equal the reference within
1e-4 * max(1, max |ref|) (float32 against float64 through the target's Gated DeltaNet, gated attention and MoE
layers and the MTP block: the engine tests of Qwen3-Next against transformers stay within 1e-4 at this size).
Then the layer applied to its own output one position further (the second proposal's pass). Planning: the
MTP layer joins the target's full-attention group; loading: a missing MTP tensor is an error naming it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from linear_attention_setup import one_torch_thread  # noqa: E402, F401 (autouse fixture)
from qwen3_next_mtp_checkpoint import save_qwen3_next_with_mtp  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from kvforge import LLM  # noqa: E402
from kvforge.errors import ConfigError  # noqa: E402

MTP = {"method": "qwen3_next_mtp", "num_speculative_tokens": 2}


def _llm(path, **kw):
    return LLM(str(path), dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 22,
               progress=False, device="cpu", speculative_config=MTP, **kw)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want).abs().max().item()
    assert err <= 1e-4 * max(1.0, want.abs().max().item()), err


def test_mtp_logits_match_reference(tmp_path):
    ref = save_qwen3_next_with_mtp(tmp_path)
    engine = _llm(tmp_path).engine
    assert engine.speculative.method == "mtp"  # vLLM's name of the method, taken as kvforge's
    # The MTP layer (index 4, after the 4 target layers) sits in the full-attention group, after layer 2.
    assert [layer.index for layer in engine.plan.draft.layers] == [4]
    (group,) = [g for g in engine.plan.groups if g.draft_layers]
    assert group.layers == (2,) and group.draft_layers == (4,)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (11,), generator=g).tolist()
    runner = engine.runner
    runner.step_state_slots = [0]  # a fresh sequence (position 0): its state slot is not read
    tables = [[5, 1, 7] for _ in range(engine.pool.num_groups)]  # scattered blocks of 4 tokens
    runner.run([(ids, 0, tables)], [len(ids) - 1])
    hidden = runner.last_hidden
    ref_hidden = ref.hidden(ids)
    _close(hidden, ref_hidden)

    mtp = engine.draft_runner  # the target model over the plan's proposer layer
    logits, out = mtp.run_mtp([(ids[1:], 0, tables)], hidden[:-1], list(range(len(ids) - 1)))
    ref_out = ref.outputs(ids[1:], ref_hidden[:-1])
    want = ref.logits(ref_out)
    _close(logits, want)
    _close(out, ref_out)

    # Second pass: the layer's own output at position T - 2 and a guessed token, at position T - 1.
    guess = int(want[-1].argmax())
    logits2, _ = mtp.run_mtp([([guess], len(ids) - 1, tables)], out[-1:], [0])
    want2 = ref.logits(ref.outputs(ids[1:] + [guess], torch.cat([ref_hidden[:-1], ref_out[-1:]])))[-1]
    _close(logits2[0], want2)
    # The MTP layer is a model of its own: its guesses are not the target's (random weights).
    target = ref.logits(ref_hidden)
    assert not torch.allclose(target[1:], logits.double(), atol=1e-3)


def test_mtp_weights_missing_from_checkpoint_are_named(tmp_path):
    save_qwen3_next_with_mtp(tmp_path)
    tensors = load_file(str(tmp_path / "mtp.safetensors"))
    del tensors["mtp.pre_fc_norm_hidden.weight"]
    save_file(tensors, str(tmp_path / "mtp.safetensors"))
    with pytest.raises(ConfigError, match=r"lacks 1 tensor.*mtp\.pre_fc_norm_hidden\.weight"):
        _llm(tmp_path)

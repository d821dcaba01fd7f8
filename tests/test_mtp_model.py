"""The DeepSeek-V3 multi-token-prediction layer (kvforge/models/deepseek_mtp.py) vs a float64 reference
of the report's equations (tests/mtp_checkpoint.py), CPU, a tiny random checkpoint in float32.

The target's prefill through the engine's runner leaves its hidden states (``last_hidden``); the MTP
layer over positions 0 .. T - 2 (tokens 1 .. T - 1 following them) gives logits that must equal the
reference within 1e-4 * max(1, max |ref|) (float32 vs float64 through two MLA blocks and MoE; the engine
test of DeepSeek against transformers measures ~2e-6 at this size). Then the layer applied to its own
output one position further (the second proposal's pass), against the reference fed the same way.
Loading: the checkpoint's MTP tensors land in the layer (a missing one is an error naming it).
"""

from __future__ import annotations

import pytest
import torch
from mtp_checkpoint import save_deepseek_v3_with_mtp
from safetensors.torch import load_file, save_file

from kvforge import LLM
from kvforge.errors import ConfigError

torch.set_num_threads(1)
MTP = {"method": "mtp", "num_speculative_tokens": 2}


def _llm(path, **kw):
    return LLM(str(path), dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 20,
               progress=False, device="cpu", speculative_config=MTP, **kw)


def test_mtp_logits_match_reference(tmp_path):
    ref = save_deepseek_v3_with_mtp(tmp_path)
    llm = _llm(tmp_path)
    engine = llm.engine
    # The MTP layer (checkpoint index 2) sits in the target's one MLA group, after its layers: shared tables.
    assert len(engine.plan.layers) == 2 and [layer.index for layer in engine.plan.draft.layers] == [2]
    assert len(engine.plan.groups) == 1 and engine.plan.groups[0].draft_layers == (2,)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (11,), generator=g).tolist()
    tables = [[5, 1, 7]]  # scattered blocks of 4 tokens
    runner = engine.runner
    runner.run([(ids, 0, tables)], [len(ids) - 1])
    hidden = runner.last_hidden
    ref_hidden = ref.hidden(ids)
    assert (hidden.double() - ref_hidden).abs().max().item() <= 1e-4 * max(1.0, ref_hidden.abs().max().item())

    mtp = engine.draft_runner  # the target model over the plan's proposer layer
    logits, out = mtp.run_mtp([(ids[1:], 0, tables)], hidden[:-1], list(range(len(ids) - 1)))
    ref_out = ref.outputs(ids[1:], ref_hidden[:-1])
    want = ref.logits(ref_out)
    scale = max(1.0, want.abs().max().item())
    assert (logits.double() - want).abs().max().item() <= 1e-4 * scale
    assert (out.double() - ref_out).abs().max().item() <= 1e-4 * max(1.0, ref_out.abs().max().item())

    # Second pass: the layer's own output at position T - 2 and a guessed token, at position T - 1.
    guess = int(want[-1].argmax())
    logits2, _ = mtp.run_mtp([([guess], len(ids) - 1, tables)], out[-1:], [0])
    want2 = ref.logits(ref.outputs(ids[1:] + [guess], torch.cat([ref_hidden[:-1], ref_out[-1:]])))[-1]
    assert (logits2[0].double() - want2).abs().max().item() <= 1e-4 * max(1.0, want2.abs().max().item())
    # The MTP layer is a real model: its guesses are not the target's (random weights), so this test would
    # notice a layer that returned the target's own logits.
    target = runner.run([(ids, 0, tables)], list(range(len(ids))))
    assert not torch.allclose(target[1:], logits, atol=1e-3)


def test_mtp_weights_missing_from_checkpoint_are_named(tmp_path):
    save_deepseek_v3_with_mtp(tmp_path)
    tensors = load_file(str(tmp_path / "mtp.safetensors"))
    del tensors["model.layers.2.eh_proj.weight"]
    save_file(tensors, str(tmp_path / "mtp.safetensors"))
    with pytest.raises(ConfigError, match=r"lacks 1 tensor.*model\.layers\.2\.eh_proj\.weight"):
        _llm(tmp_path)

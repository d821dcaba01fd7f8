"""benchmarks/decode_sweep.py runs end to end (CPU, a tiny Llama config with dummy weights) and times only
decode-only steps of the full batch."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

CONFIG = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=128, vocab_size=256, max_position_embeddings=512,
              rms_norm_eps=1e-5, torch_dtype="float32")


def test_sweep_writes_every_point(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_sweep.py"
    spec = importlib.util.spec_from_file_location("decode_sweep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "sweep.json"
    assert module.main(["--model", str(tmp_path), "--device", "cpu", "--batches", "1", "2", "--contexts", "16",
                        "40", "--steps", "5", "--repeats", "2", "--kv", "float32", "fp8", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"float32", "fp8"}
    for kv in runs.values():
        assert set(kv) == {"1x16", "2x16", "1x40", "2x40"}
        for point in kv.values():
            # 5 new tokens: the first comes from the prefill step, the other 4 from decode-only steps.
            assert point["decode_steps"] == 4 and point["tok_s"] > 0
    assert "| 2x40 |" in capsys.readouterr().out


def test_batches_whose_prompts_take_several_steps_still_decode_together(tmp_path):
    """Three 40-token prompts at 64 tokens a step take several steps to admit; every request asks for more
    tokens than ``--steps`` by those steps, so the full batch still shares at least ``steps - 1`` decode steps."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_sweep.py"
    spec = importlib.util.spec_from_file_location("decode_sweep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.admission_steps(1, 40, 64) == 1 and module.admission_steps(3, 40, 64) >= 3
    runs = module.sweep(str(tmp_path), "float32", [3, 4, 6], [40, 64], steps=5, device="cpu",
                        max_num_batched_tokens=65)
    for point in runs.values():  # budgets near the context: decode tokens delay the next prompt
        assert point["decode_steps"] >= 4 and point["tok_s"] > 0
    with pytest.raises(ValueError, match="exceed the largest batch"):
        module.sweep(str(tmp_path), "float32", [70], [40], steps=5, device="cpu", max_num_batched_tokens=65)

"""benchmarks/step_profile.py on CPU at a tiny size (a dummy Llama config, MTP-free), so an engine change the
script depends on fails here, not at measurement time."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_profile.py"
CONFIG = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
              rms_norm_eps=1e-5, torch_dtype="float32")


def test_step_profile_runs_on_cpu(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), str(tmp_path), "--load-format", "dummy", "--device", "cpu",
                                      "--skip-tokenizer-init", "--max-model-len", "256", "--input-len", "32", "32",
                                      "--steps", "3", "--warm-steps", "1",
                                      "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith("step: ") and "over 3 synchronized steps" in out
    assert "llm_engine.py" in out and "Ordered by: internal time" in out

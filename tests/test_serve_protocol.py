"""benchmarks/serve_protocol.py: the word-level tokenizer it writes (one token per load-generator word, every
id inside the vocabulary) and one whole run on CPU (a tiny random Llama, a server per KV dtype, the load
generator against each, the table, the servers gone afterwards)."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve_protocol  # noqa: E402

from kvforge.bench.serve_bench import WORDS, build_prompt  # noqa: E402


def test_a_generator_word_is_one_token_and_ids_stay_in_the_vocabulary(tmp_path):
    directory = serve_protocol.write_word_tokenizer(1024, tmp_path / "tok")
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tok.get_vocab_size() == 1024
    prompt = build_prompt("ab12", 50, random.Random(0))
    words = prompt.split()[1:]
    ids = tok.encode(" ".join(words)).ids
    assert len(ids) == len(words) and max(ids) < len(set(WORDS))  # one known token per word
    assert all(0 <= i < 1024 for i in tok.encode(prompt).ids)  # the id prefix maps to [UNK] and punctuation
    with pytest.raises(ValueError, match="cannot hold"):
        serve_protocol.write_word_tokenizer(10, tmp_path / "small")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_run_on_cpu(tmp_path):
    model = tmp_path / "tiny"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=1024, max_position_embeddings=1024)
    transformers.LlamaForCausalLM(cfg).save_pretrained(model)
    port = _free_port()
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_protocol.py"), str(model), "--kv", "bf16", "fp8",
         "--isl", "48", "--osl", "4", "--concurrency", "2", "--num-requests", "2", "--repetitions", "1",
         "--port", str(port), "--serve-args", "--device cpu --max-model-len 256", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    table = run.stdout[run.stdout.index("| KV |"):]
    assert "| bf16 |" in table and "| fp8 |" in table and "fp8 / bf16 total throughput" in table
    assert (out / "bench_bf16_isl48.json").is_file() and (out / "bench_fp8_isl48.json").is_file()
    with socket.socket() as s:  # no server listens there any more (closed connections may linger in TIME_WAIT)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()

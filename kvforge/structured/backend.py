"""Grammar compilation and matching for structured outputs, on xgrammar.

The vocabulary xgrammar matches against is each token's bytes in decoded text (``Tokenizer.token_bytes``);
special tokens and ids past the tokenizer's vocabulary (a model's padded embedding) are empty, which
xgrammar never allows inside an output, and the model's end-of-sequence ids are the grammar's stop
tokens: a complete output allows only those. Compiled grammars are cached by xgrammar (bounded by
``CACHE_BYTES``), so a request compiled once while it is checked is matched from the cache when the engine
takes it.
"""

from __future__ import annotations

import json
from collections.abc import Collection

from kvforge.errors import InvalidRequestError
from kvforge.structured.params import StructuredOutputsParams

#: Memory xgrammar's cache of compiled grammars may hold.
CACHE_BYTES = 256 << 20
INSTALL_HINT = "pip install xgrammar (or kvforge[structured])"


def xgrammar_module():
    """The xgrammar module, or InvalidRequestError naming the package to install."""
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError(f"structured outputs need the xgrammar package, which is not installed: "
                                  f"{INSTALL_HINT}", field="structured_outputs") from None
    return xgrammar


def choice_grammar(choices: Collection[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (each a JSON-escaped string literal)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarBackend:
    """Compiles StructuredOutputsParams for one model's vocabulary and makes a matcher per request; safe to call
    from several threads (xgrammar's compiler is)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Collection[int]):
        self._xgr = xgrammar_module()
        known = min(tokenizer.vocab_size, vocab_size)
        vocab = [b"" if tokenizer.is_special(i) else tokenizer.token_bytes(i) for i in range(known)]
        vocab += [b""] * (vocab_size - known)
        self.vocab_size = vocab_size
        self.info = self._xgr.TokenizerInfo(vocab, self._xgr.VocabType.RAW, vocab_size=vocab_size,
                                            stop_token_ids=sorted(stop_token_ids))
        self._compiler = self._xgr.GrammarCompiler(self.info, max_threads=2, cache_limit_bytes=CACHE_BYTES)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params``; InvalidRequestError naming the field when xgrammar refuses it."""
        kind = params.kind
        whitespace = not params.disable_any_whitespace
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(params.json, any_whitespace=whitespace)
            if kind == "json_object":  # any object: not strict, or it could hold no property at all
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=whitespace,
                                                          strict_mode=False)
            if kind == "regex":
                return self._compiler.compile_regex(params.regex)
            if kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(params.choice))
            return self._compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(f"structured_outputs.{kind} could not be compiled: {message}",
                                      field=f"structured_outputs.{kind}") from None

    def matcher(self, params: StructuredOutputsParams):
        """A fresh xgrammar GrammarMatcher for ``params`` (one per request: it holds the request's position)."""
        return self._xgr.GrammarMatcher(self.compile(params))

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
import re
import threading
from collections import OrderedDict
from collections.abc import Collection

from kvforge.errors import InvalidRequestError
from kvforge.structured.params import StructuredOutputsParams
from kvforge.structured.schema_support import close_objects, unenforced

#: Memory xgrammar's cache of compiled grammars may hold.
CACHE_BYTES = 256 << 20
#: Constraints remembered as checked (their first token), so a request checked when it arrives is not checked
#: again when the engine takes it.
CHECKED_CONSTRAINTS = 4096
#: The longest run of whitespace a JSON output may hold between two tokens of JSON (without
#: ``disable_any_whitespace``): room for pretty-printed JSON 15 levels deep at 4 spaces a level (a newline and
#: 60 spaces), 31 at 2, and an end to a model that would otherwise emit blank lines until ``max_tokens``.
JSON_WHITESPACE_RUN_MAX = 64
INSTALL_HINT = "pip install xgrammar (or kvforge[structured])"
#: The time and source position xgrammar puts before its messages.
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")
#: A Lark rule head (``?start:`` / ``name:``), which xgrammar's EBNF reader refuses.
_LARK_RULE = re.compile(r"^\s*\??[A-Za-z_]\w*\s*:(?!:)", re.MULTILINE)
#: Where xgrammar's EBNF lexer found a character it does not take (its column counts bytes).
_LEXER_AT = re.compile(r"line (\d+), column (\d+): Unexpected character: $")


def _outside_ascii(text: str, grammar: str) -> str:
    """xgrammar's message ``text``, cut where it gives the first byte of a character of ``grammar`` outside
    ASCII, told with that character and its column counted in characters."""
    at = _LEXER_AT.search(text)
    lines = grammar.split("\n")
    line = lines[int(at[1]) - 1].encode() if at is not None and 0 < int(at[1]) <= len(lines) else b""
    before = line[:int(at[2]) - 1].decode("utf-8", "replace") if line else ""
    char = line[int(at[2]) - 1:].decode("utf-8", "replace")[:1] if line else ""
    if char.isascii():  # not found where the message says (or no place given)
        return text + "a character outside ASCII"
    return (f"{text[:at.start()]}line {at[1]}, column {len(before) + 1}: unexpected character {char!r}: outside ASCII, "
            f"EBNF takes one only inside a quoted string or a character class (\"{char}\", [{char}])")


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
        self.stop_token_ids = tuple(sorted(stop_token_ids))
        self.info = self._xgr.TokenizerInfo(vocab, self._xgr.VocabType.RAW, vocab_size=vocab_size,
                                            stop_token_ids=sorted(stop_token_ids))
        self._compiler = self._xgr.GrammarCompiler(self.info, max_threads=2, cache_limit_bytes=CACHE_BYTES)
        self._checked: OrderedDict[StructuredOutputsParams, None] = OrderedDict()
        self._checked_lock = threading.Lock()
        #: First-token checks run (each constraint once while it stays among the remembered ones).
        self.first_token_checks = 0

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params``; InvalidRequestError naming the field when xgrammar refuses it,
        when a schema uses a keyword xgrammar would not enforce, or when the constraint allows no first token
        of this vocabulary (an output could never begin)."""
        field = f"structured_outputs.{params.kind}"
        if params.kind == "harmony_call":  # one grammar per function, for the arguments of the one called
            return tuple(self._function(name, schema, field) for name, schema in params.harmony_call)
        compiled = self._compile(params, field)
        with self._checked_lock:
            if params in self._checked:
                self._checked.move_to_end(params)
                return compiled
        self.first_token_checks += 1
        matcher = self._xgr.GrammarMatcher(compiled)
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bitmask.any():
            raise InvalidRequestError(f"{field} allows no output: no token of this model's vocabulary can begin "
                                      f"it", field=field)
        with self._checked_lock:
            self._checked[params] = None
            while len(self._checked) > CHECKED_CONSTRAINTS:
                self._checked.popitem(last=False)
        return compiled

    def can_begin_with(self, params: StructuredOutputsParams, token_ids) -> bool:
        """Whether an output of ``params`` may begin with one of ``token_ids`` (a forced function call's
        grammars, which begin after the call's header, are not checked: True)."""
        if params.kind == "harmony_call":
            return True
        matcher = self._xgr.GrammarMatcher(self.compile(params))
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        words = bitmask[0].tolist()
        return any(0 <= t < self.vocab_size and (words[t // 32] >> (t % 32)) & 1 for t in token_ids)

    def _function(self, name: str, schema: str, field: str):
        try:
            return self.compile(StructuredOutputsParams(json=json.loads(schema)))
        except InvalidRequestError as e:
            why = str(e).replace(e.field, "the schema", 1) if e.field else str(e)
            raise InvalidRequestError(f"{field}: the parameters of function {name!r}: {why}", field=field) from None

    def _compile(self, params: StructuredOutputsParams, field: str):
        kind = params.kind
        whitespace = not params.disable_any_whitespace
        spaces = JSON_WHITESPACE_RUN_MAX if whitespace else None
        try:
            if kind == "json":
                schema = json.loads(params.json)
                if schema is True:  # any JSON value
                    return self._compiler.compile_json_schema("true", any_whitespace=whitespace, strict_mode=False,
                                                              max_whitespace_cnt=spaces)
                if params.disable_additional_properties:
                    schema = close_objects(schema)
                problems = list(dict.fromkeys(unenforced(schema)))  # a target two references name: once
                if problems:
                    raise InvalidRequestError(f"{field} uses what xgrammar does not enforce, so an output could break "
                                              f"the schema: {'; '.join(problems)}", field=field)
                return self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=whitespace,
                                                          max_whitespace_cnt=spaces)
            if kind == "json_object":  # any object: not strict, or it could hold no property at all
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=whitespace,
                                                          strict_mode=False, max_whitespace_cnt=spaces)
            if kind == "regex":
                return self._compiler.compile_regex(params.regex)
            if kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(params.choice))
            return self._compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            text = str(e).strip()
            hint = ""
            if isinstance(e, UnicodeDecodeError):  # the message ends in one byte of a character outside ASCII
                text = e.object[:e.start].decode("utf-8", "replace")
                text = _outside_ascii(text, params.grammar) if kind == "grammar" else text + "a character outside ASCII"
            message = _XGRAMMAR_PREFIX.sub("", text.splitlines()[0]) if text else type(e).__name__
            if kind == "grammar" and _LARK_RULE.search(params.grammar):
                hint = " (this reads as a Lark grammar; give the grammar in EBNF: root ::= ...)"
            raise InvalidRequestError(f"{field} could not be compiled: {message}{hint}", field=field) from None

    def matcher(self, params: StructuredOutputsParams):
        """A fresh xgrammar GrammarMatcher for ``params`` (one per request: it holds the request's position); a
        ``harmony_call`` constraint's matcher is kvforge/structured/harmony_call.py's gate, built by the engine."""
        if params.kind == "harmony_call":
            raise ValueError("a harmony_call constraint is matched by harmony_call_gate, which needs the tokenizer")
        return self._xgr.GrammarMatcher(self.compile(params))

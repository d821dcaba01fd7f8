"""StructuredOutputsParams: what a request's output must match (vLLM's names)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass

from kvforge.errors import InvalidRequestError
from kvforge.structured.schema_support import unreadable

#: The constraint fields, exactly one of which a request sets.
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "harmony_call")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on the output, as vLLM spells it:

    - ``json``: a JSON schema (a dict, its JSON text, or a pydantic model class); the output is a JSON value
      that the schema accepts;
    - ``regex``: the output matches the regular expression in full;
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: an EBNF grammar (GBNF-style rules, ``root ::= ...``) the output derives from;
    - ``json_object``: the output is any JSON object;
    - ``harmony_call`` (kvforge's own): a gpt-oss output that calls one of these functions, ``(name, parameters
      JSON schema)`` pairs, in its harmony format: reasoning (free), then a commentary message addressed to the
      function whose arguments the schema accepts, then ``<|call|>`` (kvforge/structured/harmony_call.py); it
      needs the engine's ``--reasoning-parser openai_gptoss``. The server sends a chat's forced call
      (``tool_choice`` ``"required"`` or named) to gpt-oss as this constraint.

    ``disable_any_whitespace``: JSON outputs take no whitespace but ``json.dumps``'s one-line separators
    (``", "`` and ``": "``); otherwise any whitespace between a JSON value's tokens. A schema's objects
    take the properties it lists, in its order, and others only where the schema allows them
    (``additionalProperties``; xgrammar's strict mode, as vLLM runs it); ``disable_additional_properties``
    sets ``additionalProperties: false`` on every object of the schema. A schema value xgrammar cannot compile
    (:func:`~kvforge.structured.schema_support.unreadable`) is refused here, naming its place, and a keyword
    xgrammar would not enforce when the request is compiled (kvforge/structured/schema_support.py). The schema is
    stored as compact JSON text in its own key order, so equal constraints compare and hash equal; ``json``
    may also be ``true`` (any JSON value). A request with a constraint ends when the output is complete (the
    grammar then allows only an end-of-sequence token), whatever ``ignore_eos`` or ``min_tokens`` say.

    vLLM's other fields are taken at the values that change nothing here: ``disable_fallback`` (any: there
    is one backend), ``whitespace_pattern`` and ``structural_tag`` (None).
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    harmony_call: tuple[tuple[str, str], ...] | None = None

    def __post_init__(self):
        if self.json_object is None:
            object.__setattr__(self, "json_object", False)
        for name, why in (("whitespace_pattern", "JSON outputs take any whitespace, or with disable_any_whitespace "
                                                 "none but json.dumps's separators"),
                          ("structural_tag", "structural tags are not supported")):
            if getattr(self, name) is not None:
                _bad(name, f"must be left unset: {why}")
        schema = self.json
        if isinstance(schema, type) and callable(getattr(schema, "model_json_schema", None)):  # pydantic model
            schema = schema.model_json_schema()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                _bad("json", f"is not valid JSON ({e})")
        if schema is not None:
            if not isinstance(schema, dict) and schema is not True:
                _bad("json", f"must be a JSON schema (an object, or true for any value), got {schema!r:.40}")
            at = _nonfinite_at(schema)
            if at is not None and isinstance(at[1], float):
                _bad("json", f"holds a number that is not finite ({at[1]}) at {at[0]}: a JSON number beyond a "
                             f"double's range (such as 1e400) reads as infinity; give a finite number there")
            if at is not None:
                size = int(abs(at[1]).bit_length() * math.log10(2))  # its digits, without writing them all out
                _bad("json", f"holds an integer beyond a double's range (about {'-' if at[1] < 0 else ''}1e{size}) "
                             f"at {at[0]}: xgrammar reads JSON numbers as doubles (at most about 1.8e308); give a "
                             f"smaller number there")
            try:
                object.__setattr__(self, "json", json.dumps(schema, separators=(",", ":"), allow_nan=False))
                problems = list(dict.fromkeys(unreadable(schema))) if isinstance(schema, dict) else []
            except (TypeError, ValueError) as e:
                _bad("json", f"is not JSON data ({e})")
            except RecursionError:
                _bad("json", "is nested too deeply to read (hundreds of levels); flatten it, e.g. name repeated parts "
                             "under $defs and refer to them with $ref")
            if problems:  # a target two references name: once
                _bad("json", f"is a schema xgrammar cannot compile: {'; '.join(problems)}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                _bad("choice", f"must be a list of strings, got {type(self.choice).__name__}")
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                _bad("choice", "must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.harmony_call is not None:
            object.__setattr__(self, "harmony_call", _functions(self.harmony_call))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _bad(name, f"must be a non-empty string, got {value!r}")
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                _bad(name, f"must be true or false, got {getattr(self, name)!r}")
        given = [name for name in CONSTRAINTS if self._is_set(name)]
        if len(given) != 1:
            what = "none" if not given else " and ".join(given)
            raise InvalidRequestError(f"structured outputs take exactly one of {', '.join(CONSTRAINTS)}, got {what}",
                                      field="structured_outputs")

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not False and value is not None

    @property
    def kind(self) -> str:
        """The constraint's field name: ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` or
        ``harmony_call``."""
        return next(name for name in CONSTRAINTS if self._is_set(name))

    @classmethod
    def from_value(cls, value) -> StructuredOutputsParams | None:
        """``value`` as given to ``SamplingParams(structured_outputs=...)``: the class itself, a dict of its fields
        (as JSON requests send it) or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            _bad("", f"must be an object (StructuredOutputsParams), got {type(value).__name__}")
        unknown = sorted(str(k) for k in value if k not in cls.__dataclass_fields__)
        if unknown:
            _bad("", f"has no field {', '.join(unknown)} (fields: {', '.join(cls.__dataclass_fields__)})")
        fields = {k: v for k, v in value.items() if v is not None}
        return cls(**fields)


def _functions(value) -> tuple[tuple[str, str], ...]:
    """``harmony_call``'s functions as (name, compact schema JSON) pairs, in order."""
    if isinstance(value, dict):
        value = list(value.items())
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        _bad("harmony_call", "must be a non-empty list of (function name, parameters schema) pairs")
    out = []
    for pair in value:
        if isinstance(pair, str) or not isinstance(pair, (list, tuple)) or len(pair) != 2:
            _bad("harmony_call", f"must hold (function name, parameters schema) pairs, got {pair!r:.60}")
        name, schema = pair
        if not isinstance(name, str) or not name or any(c.isspace() or c in "<>" for c in name):
            _bad("harmony_call", f"function names are non-empty, without spaces or angle brackets; got {name!r}")
        if any(name == seen for seen, _ in out):
            _bad("harmony_call", f"names function {name!r} twice")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                _bad("harmony_call", f"function {name!r}: its parameters schema is not valid JSON ({e})")
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            _bad("harmony_call", f"function {name!r}: its parameters schema must describe an object (a call's "
                                 f"arguments are a JSON object), got {schema!r:.60}")
        try:
            out.append((name, StructuredOutputsParams(json=schema).json))
        except InvalidRequestError as e:  # told by the function, not by a json field the request did not send
            _bad("harmony_call", f"function {name!r}: its parameters schema{str(e).removeprefix(e.field or '')}")
    return tuple(out)


def _nonfinite_at(value) -> tuple[str, float | int] | None:
    """The first NaN or infinity in ``value`` (a schema's dicts and lists, walked without recursion: any depth),
    or integer beyond a double's range, as (JSON-pointer path, the number), or None."""
    stack = [("#", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return path, item
        if isinstance(item, int) and not isinstance(item, bool) and abs(item) > sys.float_info.max:
            return path, item
        if isinstance(item, dict):
            children = [(str(k), v) for k, v in item.items()]
        elif isinstance(item, (list, tuple)):
            children = [(str(n), v) for n, v in enumerate(item)]
        else:
            continue
        for key, child in reversed(children):  # popped in document order
            stack.append((f"{path}/{key.replace('~', '~0').replace('/', '~1')}", child))
    return None


def _bad(name: str, why: str):
    field = f"structured_outputs.{name}" if name else "structured_outputs"
    raise InvalidRequestError(f"{field} {why}", field=field)

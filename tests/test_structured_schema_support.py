"""JSON-schema keywords xgrammar compiles without enforcing (kvforge/structured/schema_support.py): each is
refused by name, and the refusal is warranted: xgrammar's own compiler, given the same schema, lets an
instance that breaks the keyword end as complete (when xgrammar starts enforcing one, its case here fails
and the keyword can leave the list). Keywords it does enforce compile and hold."""

from __future__ import annotations

import json

import pytest

from kvforge.errors import InvalidRequestError
from kvforge.structured import StructuredOutputsParams
from kvforge.structured.schema_support import close_objects

xgrammar = pytest.importorskip("xgrammar")

NOT_ENFORCED = [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]"),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, "[1]"),
    ("not", {"type": "integer", "not": {"const": 10}}, "10"),
    ("allOf of 2 schemas", {"allOf": [{"type": "integer", "minimum": 3}, {"type": "integer", "maximum": 5}]}, "9"),
    ("if", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 3}}, "7"),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a":1}'),
    ("format 'idn-email'", {"type": "string", "format": "idn-email"}, '"@@"'),
    ("pattern with minLength/maxLength", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcdef"'),
    ("required b", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, '{"a":1}'),
    ("$ref 'http", {"$ref": "http://example.com/s.json"}, '"s"'),
    ("multipleOf at #", {"type": "number", "multipleOf": 0.5}, "0.75"),
    ("multipleOf at #", {"type": "integer", "multipleOf": 1.5}, "2"),
    ("multipleOf with only a lower bound at #", {"type": "integer", "multipleOf": 5, "minimum": 0}, "7"),
    ("multipleOf with only an upper bound at #", {"type": "integer", "multipleOf": 5, "exclusiveMaximum": 100}, "7"),
    ("multipleOf with bounds 10,001 integers apart at #", {"type": "integer", "multipleOf": 5, "minimum": 0,
                                                            "maximum": 10000}, "7"),
    ("multipleOf 1025 at #", {"type": "integer", "multipleOf": 1025}, "1"),
    ("lookahead in pattern", {"type": "string", "pattern": "^(?!a)[a-c]$"}, '"a"'),
    ("lookahead in pattern", {"type": "string", "pattern": "^[ab](?!b)[a-c]$"}, '"ab"'),  # after a class
    ("lookahead in pattern '^(?!x).*$'", {"type": "object", "patternProperties": {"^(?!x).*$": {"type": "integer"}},
                                          "additionalProperties": False}, '{"x":1}'),
    ("format with minLength/maxLength", {"type": "string", "format": "date", "minLength": 20}, '"1999-02-23"'),
    ("oneOf at #: branches 0 and 1", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    ("oneOf at #: branches 0 and 1", {"oneOf": [{"type": "object", "properties": {"kind": {"const": "cat"}}},
                                                {"type": "object", "properties": {"kind": {"const": "dog"}}}]}, "{}"),
    ("oneOf at #/properties/n: branches 1 and 2", {"type": "object", "properties": {"n": {"oneOf": [
        {"type": "string"}, {"type": "integer", "maximum": 2}, {"type": "integer", "minimum": 1}]}},
        "required": ["n"]}, '{"n":2}'),
    ("maxLength beside $ref", {"$defs": {"S": {"type": "string"}}, "type": "object",
                                "properties": {"a": {"$ref": "#/$defs/S", "maxLength": 3}}, "required": ["a"]},
     '{"a":"abcdef"}'),
    ("type beside anyOf", {"type": "integer", "anyOf": [{"type": "integer"}, {"type": "string"}]}, '"x"'),
    ("maximum beside allOf", {"type": "object", "properties": {"x": {"allOf": [{"type": "integer"}],
                                                                     "maximum": 3}}, "required": ["x"]}, '{"x":5}'),
    ("required b at #", {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True,
                         "required": ["a", "b"]}, '{"a":1}'),
    ("format with pattern", {"type": "string", "format": "date", "pattern": "^2024-"}, '"2023-01-02"'),
    ("pattern at # without a type", {"pattern": "^a+$"}, '"b"'),
    ("minimum at # without a type", {"minimum": 3}, "1"),
    ("enum values at # outside type", {"type": "string", "enum": ["a", 1]}, "1"),
    ("maxLength beside enum", {"type": "string", "enum": ["ab", "abcdef"], "maxLength": 3}, '"abcdef"'),
    ("dependencies", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "dependencies": {"a": ["b"]}}, '{"a":1}'),
    ("$ref '#node'", {"$defs": {"N": {"$anchor": "node", "type": "integer"}}, "type": "object",
                      "properties": {"a": {"$ref": "#node"}}, "required": ["a"]}, '{"a":"x"}'),
    ("not at #/components/A", {"type": "object", "properties": {"a": {"$ref": "#/components/A"}}, "required": ["a"],
                               "components": {"A": {"type": "integer", "not": {"const": 3}}}}, '{"a":3}'),
    ("uniqueItems at #/properties/tags", {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}, "required": ["tags"]},
     '{"tags":["a","a"]}'),
]
ENFORCED = [
    ({"type": "integer", "multipleOf": 5}, "7"), ({"type": "integer", "minimum": 5}, "3"),
    ({"type": "string", "maxLength": 3}, '"abcdef"'), ({"type": "string", "pattern": "^[a-z]+$"}, '"AB"'),
    ({"type": "string", "format": "date"}, '"soon"'), ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"b":1}'),
    ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}, '"s"'),
    ({"type": "string", "pattern": "^\\(?=$"}, '"x"'),  # an escaped parenthesis is no lookahead
    ({"type": "string", "pattern": "^[(?=]+$"}, '"x"'),  # nor one inside a character class
    # a discriminated union (pydantic's form): each branch requires "kind" with its own const
    ({"$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                        "required": ["kind"]},
                "Dog": {"type": "object", "properties": {"kind": {"enum": ["dog"]}}, "required": ["kind"]}},
      "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}, {"type": "null"}]}, '{"kind":"bird"}'),
    ({"oneOf": [{"const": 1}, {"const": 2.5}, {"enum": ["1", True]}]}, "3"),
    # pydantic's discriminated union whose tags have defaults (so no branch requires its tag)
    ({"$defs": {"Cat": {"properties": {"pet_type": {"const": "cat", "default": "cat", "type": "string"},
                                       "meows": {"type": "integer"}}, "required": ["meows"], "type": "object"},
                "Dog": {"properties": {"pet_type": {"const": "dog", "default": "dog", "type": "string"},
                                       "barks": {"type": "integer"}}, "required": ["barks"], "type": "object"}},
      "type": "object", "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                                               "discriminator": {"propertyName": "pet_type"}}}, "required": ["pet"]},
     '{"pet":{"meows":1,"barks":2}}'),
    ({"format": "uri", "minLength": 1, "type": "string"}, '""'),  # pydantic's AnyUrl
    ({"type": ["integer", "null"], "multipleOf": 3}, "4"),
    ({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 9999}, "7"),
    ({"type": "integer", "multipleOf": 5, "exclusiveMinimum": -1, "exclusiveMaximum": 10000}, "7"),
    ({"type": "integer", "multipleOf": 1024}, "1"),
    ({"oneOf": [{"type": "string", "maxLength": 2}, {"type": "string", "minLength": 4}]}, '"abc"'),  # apart by length
    ({"oneOf": [{"type": "integer", "maximum": 0}, {"type": "integer", "exclusiveMinimum": 0}]}, "0.5"),
    ({"$defs": {"S": {"type": "string"}}, "$ref": "#/$defs/S", "description": "a note"}, "1"),
]


@pytest.fixture(scope="module")
def backend():
    from kvforge.spec.embedded import embedded_model_path
    from kvforge.structured.backend import GrammarBackend
    from kvforge.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(embedded_model_path())
    return GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def _ends_complete(compiled, text: str, eos: int) -> bool:
    matcher = xgrammar.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(eos) and matcher.is_terminated()


@pytest.mark.parametrize("named, schema, breaking", NOT_ENFORCED, ids=[c[0] for c in NOT_ENFORCED])
def test_unenforced_keyword_is_refused_and_would_have_been_ignored(backend, named, schema, breaking):
    with pytest.raises(InvalidRequestError) as err:
        backend.compile(StructuredOutputsParams(json=schema))
    assert err.value.field == "structured_outputs.json" and named in str(err.value), err.value
    raw = xgrammar.GrammarCompiler(backend.info).compile_json_schema(json.dumps(schema))
    assert _ends_complete(raw, breaking, min(backend.info.stop_token_ids))


@pytest.mark.parametrize("schema, breaking", ENFORCED)
def test_enforced_keyword_compiles_and_holds(backend, schema, breaking):
    compiled = backend.compile(StructuredOutputsParams(json=schema))
    assert not _ends_complete(compiled, breaking, min(backend.info.stop_token_ids))


@pytest.mark.parametrize("fmt", ["password", "binary"])
def test_formats_every_string_meets_compile_as_plain_strings(backend, fmt):
    """pydantic's SecretStr (``password``) and bytes (``binary``) fields: OpenAPI formats that restrict
    nothing, so any string holds and a non-string does not."""
    compiled = backend.compile(StructuredOutputsParams(json={"type": "object", "properties": {
        "secret": {"type": "string", "format": fmt, "writeOnly": True}}, "required": ["secret"]}))
    eos = min(backend.info.stop_token_ids)
    assert _ends_complete(compiled, '{"secret": "any text, 12 @@ ;"}', eos)
    assert not _ends_complete(compiled, '{"secret": 12}', eos)


def test_disable_additional_properties_closes_every_object(backend):
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}},
                                                     "additionalProperties": True}},
              "additionalProperties": True}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert schema["additionalProperties"] is True  # the given schema is left as it was
    eos = min(backend.info.stop_token_ids)
    assert _ends_complete(backend.compile(StructuredOutputsParams(json=schema)), '{"a":{"b":1,"c":2},"d":3}', eos)
    strict = backend.compile(StructuredOutputsParams(json=schema, disable_additional_properties=True))
    assert not _ends_complete(strict, '{"a":{"b":1,"c":2}}', eos) and _ends_complete(strict, '{"a":{"b":1}}', eos)


def test_other_refusals_and_forms(backend):
    with pytest.raises(InvalidRequestError, match="allows no output"):
        backend.compile(StructuredOutputsParams(regex="[^\\x00-\\U0010FFFF]"))
    with pytest.raises(InvalidRequestError) as err:
        backend.compile(StructuredOutputsParams(regex="(abc"))
    assert "could not be compiled" in str(err.value) and not str(err.value).split(": ", 1)[1].startswith("[")
    with pytest.raises(InvalidRequestError, match="Lark grammar"):
        backend.compile(StructuredOutputsParams(grammar='?start: value\nvalue: "a" | "b"'))
    anything = backend.compile(StructuredOutputsParams(json=True))
    eos = min(backend.info.stop_token_ids)
    assert _ends_complete(anything, "[1, {}]", eos) and not _ends_complete(anything, "{", eos)
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(json={"enum": {1, 2}})
    assert err.value.field == "structured_outputs.json"
    vllm_fields = StructuredOutputsParams(regex="a", json_object=None, disable_fallback=True, whitespace_pattern=None,
                                          structural_tag=None)
    assert vllm_fields.kind == "regex"
    for name in ("whitespace_pattern", "structural_tag"):
        with pytest.raises(InvalidRequestError) as err:
            StructuredOutputsParams(regex="a", **{name: "x"})
        assert err.value.field == f"structured_outputs.{name}"


@pytest.mark.parametrize("grammar, line_column", [("\u00e9", "line 1, column 1"),
                                                  ('root ::= "a" |\n  ("\u00e9" \u00e9)', "line 2, column 8")])
def test_a_grammar_character_outside_ascii_is_named(backend, grammar, line_column):
    """xgrammar takes a character outside ASCII only in a quoted string or a character class, and its message
    about one elsewhere holds that character's first byte alone (its column counts bytes): the refusal names
    the character and its column in characters."""
    with pytest.raises(InvalidRequestError) as err:
        backend.compile(StructuredOutputsParams(grammar=grammar))
    assert err.value.field == "structured_outputs.grammar" and "codec" not in str(err.value)
    assert f"{line_column}: unexpected character '\u00e9': outside ASCII" in str(err.value)
    assert "only inside a quoted string or a character class" in str(err.value)
    compiled = backend.compile(StructuredOutputsParams(grammar='root ::= "\u00e9t\u00e9" | [\u00e0-\u00fc]'))
    assert _ends_complete(compiled, "\u00e9t\u00e9", min(backend.info.stop_token_ids))


@pytest.mark.parametrize("keyword, kind, bound", [
    ("minLength", "string", -1), ("maxLength", "string", -1), ("maxLength", "string", 2**70),
    ("minItems", "array", -1), ("maxItems", "array", 2**31), ("minProperties", "object", 2**32),
    ("maxProperties", "object", 2**32), ("minLength", "string", 1.5), ("maxItems", "array", True),
])
def test_a_length_or_count_outside_its_range_is_refused_by_name(backend, keyword, kind, bound):
    """Bounds xgrammar would refuse with its own check's text, or read as another bound (2**32 wraps to 0) or
    as none (a maxLength of -1), are refused naming the keyword and where it is."""
    schema = {"type": "object", "properties": {"a": {"type": kind, keyword: bound}}}
    with pytest.raises(InvalidRequestError) as err:
        backend.compile(StructuredOutputsParams(json=schema))
    assert f"{keyword} {json.dumps(bound)} at #/properties/a: must be an integer from 0 to 2147483647" in str(
        err.value)
    assert "Check failed" not in str(err.value)


def test_proposals_the_grammar_refuses_are_not_offered_to_the_matcher(backend, capfd):
    from kvforge.structured.token_masks import proposal_bitmask

    matcher = backend.matcher(StructuredOutputsParams(regex="(x\n){1,9}"))
    special = next(i for i in range(backend.vocab_size) if backend.info.decoded_vocab[i] == b""
                   and i not in backend.info.stop_token_ids)
    capfd.readouterr()
    bitmask = proposal_bitmask([matcher], [[special, 5, 6]], backend.vocab_size)
    assert bitmask.shape[0] == 4 and "special token" not in capfd.readouterr().err
    assert matcher.accept_string("x\n")  # rolled back to the start


def test_first_token_checked_once_per_constraint(backend):
    """A constraint checked when a request arrives is matched from memory when the engine takes it; one that
    allows no output is refused every time it comes."""
    digits = StructuredOutputsParams(regex="[0-9]{3}-once")
    before = backend.first_token_checks
    backend.compile(digits)
    backend.matcher(digits)
    backend.matcher(StructuredOutputsParams(regex="[0-9]{3}-once"))  # an equal constraint
    assert backend.first_token_checks == before + 1
    empty = StructuredOutputsParams(regex="[^\\x00-\\U0010FFFF]")
    for _ in range(2):
        with pytest.raises(InvalidRequestError, match="allows no output"):
            backend.matcher(empty)
    assert backend.first_token_checks == before + 3


@pytest.mark.parametrize("a, b, apart", [
    ({"type": "integer"}, {"type": "number"}, False),  # 1 matches both
    ({"type": "integer"}, {"type": "string"}, True),
    ({"const": 1}, {"const": 1.0}, False),  # one JSON number
    ({"const": 1}, {"const": True}, True),  # a boolean is no number
    ({"enum": ["a", "b"]}, {"enum": ["b"]}, False),
    ({}, {"type": "null"}, False),  # no type: any instance
    ({"type": ["string", "null"]}, {"type": "object"}, True),
    ({"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
     {"type": "object", "properties": {"k": {"const": "b"}}}, True),  # a match of both has k: "a" and "b" at once
    ({"type": "object", "properties": {"k": {"const": "a"}}, "additionalProperties": True},
     {"type": "object", "properties": {"k": {"const": "b"}}, "additionalProperties": True}, False),  # {}
    # closed (as compiled): an output of either lacks what the other requires
    ({"type": "object", "properties": {"t": {"const": "cat"}, "meows": {"type": "integer"}}, "required": ["meows"]},
     {"type": "object", "properties": {"t": {"const": "dog"}, "barks": {"type": "integer"}}, "required": ["barks"]},
     True),
    ({"type": "object", "properties": {"meows": {"type": "integer"}}, "required": ["meows"]},
     {"type": "object", "properties": {"barks": {"type": "integer"}}}, False),  # {"meows": 1} matches the open 2nd
    ({"type": ["object", "string"], "properties": {"k": {"const": "a"}}, "required": ["k"]},
     {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}, True),
    ({"type": ["object", "string"], "properties": {"k": {"const": "a"}}, "required": ["k"]},
     {"type": ["object", "string"], "properties": {"k": {"const": "b"}}, "required": ["k"]}, False),  # "s"
    (False, {"type": "string"}, True),
    ({"type": "integer", "maximum": 0}, {"type": "integer", "minimum": 1}, True),
    ({"type": "integer", "maximum": 1}, {"type": "integer", "minimum": 1}, False),  # 1
    ({"type": "number", "exclusiveMaximum": 1}, {"type": "number", "minimum": 1}, True),
    ({"type": "number", "maximum": 1}, {"type": "number", "exclusiveMinimum": 1}, True),
    ({"type": "number", "maximum": 1}, {"type": "integer", "minimum": 1, "maximum": 9}, False),  # 1
    ({"type": "integer", "maximum": 0}, {"type": "number", "minimum": 0.5}, True),
    ({"type": "number", "minimum": 1, "exclusiveMinimum": True}, {"type": "number", "maximum": 1}, False),  # read as 1
    ({"type": "string", "maxLength": 3}, {"type": "string", "minLength": 4}, True),
    ({"type": "string", "maxLength": 3}, {"type": "string", "minLength": 3}, False),  # "abc"
    ({"type": "array", "maxItems": 1}, {"type": "array", "minItems": 2}, True),
    ({"type": ["integer", "string"], "maximum": 0}, {"type": ["integer", "string"], "minimum": 1}, False),  # "s"
    ({"type": ["integer", "string"], "maximum": 0, "maxLength": 2},
     {"type": ["integer", "string"], "minimum": 1, "minLength": 3}, True),
    ({"type": ["integer", "null"], "maximum": 0}, {"type": ["integer", "null"], "minimum": 1}, False),  # null
    ({"const": 5}, {"type": "integer", "maximum": 0}, False),  # not shown (a listed value beside a range)
])
def test_disjoint_branches_only_where_no_instance_matches_both(a, b, apart):
    """Each pair's answer, with the instance that matches both named where there is one."""
    from kvforge.structured.disjoint_schemas import disjoint

    assert disjoint(a, b, {}) is apart and disjoint(b, a, {}) is apart


UNREADABLE = [
    ({"type": "integer", "minimum": 1.5}, 'minimum 1.5 at #/minimum: an integer\'s bound must be a whole number; '
                                          'give "minimum": 2 (the same integers)'),
    ({"type": "integer", "exclusiveMaximum": 1.5}, 'exclusiveMaximum 1.5 at #/exclusiveMaximum: an integer\'s bound '
                                                   'must be a whole number; give "maximum": 1'),
    ({"type": ["integer", "number"], "maximum": 1.5}, "drop integer from type (number takes integers too)"),
    ({"type": "number", "minimum": 0, "exclusiveMinimum": True},
     'exclusiveMinimum true at #/exclusiveMinimum: draft 4\'s form, which xgrammar does not read; give the bound '
     'itself: "exclusiveMinimum": 0 in place of "minimum": 0'),
    ({"type": "integer", "maximum": 5, "exclusiveMaximum": False}, "exclusiveMaximum false at #/exclusiveMaximum: "
                                                                   "draft 4's form"),
    ({"type": "array", "items": [{"type": "integer"}]}, "items [{\"type\": \"integer\"}] at #/items: draft 4's tuple "
                                                        "form, which xgrammar does not read; send the list as "
                                                        "prefixItems"),
    ({"type": "object", "properties": {"a/b": {"type": "integer", "maximum": 2**63}}},
     f"maximum {2**63} at #/properties/a~1b/maximum: an integer's bound must lie from -9223372036854775808 to "
     f"9223372036854775807"),
    ({"type": "integer", "minimum": -2**63 - 1}, "an integer's bound must lie from -9223372036854775808"),
    ({"type": "integer", "minimum": 1e20}, "minimum 1e+20 at #/minimum: an integer's bound must lie from"),
    ({"type": "integer", "minimum": "1"}, 'minimum "1" at #/minimum: must be a number'),
    ({"type": "integer", "minimum": 5, "maximum": 3}, "minimum 5, maximum 3 at #: no number meets them all"),
    ({"type": "integer", "exclusiveMinimum": 4, "exclusiveMaximum": 5}, "at #: no integer meets them all"),
    ({"type": "string", "minLength": 5, "maxLength": 3}, "minLength 5 at #/minLength: above maxLength 3"),
    ({"type": "array", "prefixItems": [{}], "minItems": 2}, "minItems 2 at #/minItems: above the 1 items prefixItems"),
    ({"type": "integer", "multipleOf": -2}, "multipleOf -2 at #/multipleOf: must be a number greater than 0"),
    ({"type": "string", "pattern": 5}, "pattern 5 at #/pattern: must be a string"),
    ({"type": "any"}, 'type "any" at #/type: "any" is no JSON type'),
    ({"type": "object", "required": "a"}, 'required "a" at #/required: must be an array'),
    ({"enum": []}, "enum [] at #/enum: allows no value"),
    ({"anyOf": [False, {"type": "integer"}]}, "anyOf false at #/anyOf/0: a schema no value meets"),
    ({"type": "object", "properties": {"a": 5}}, "properties 5 at #/properties/a: must be a schema"),
    ({"type": "object", "propertyNames": {"type": "integer"}}, "propertyNames at #/propertyNames/type: property "
                                                               "names are strings"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}}, "$ref '#/$defs/B' at #/properties/a/$ref: "
                                                                     "names no schema"),
]


@pytest.mark.parametrize("schema, told", UNREADABLE, ids=[t.split(" at ")[0][:40] for _, t in UNREADABLE])
def test_a_value_xgrammar_cannot_compile_is_refused_when_parsed(backend, schema, told):
    """Refused as the parameters are made, at the keyword's JSON-pointer path with what to send, where xgrammar
    itself refuses the schema with a message that names neither."""
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(json=schema)
    assert err.value.field == "structured_outputs.json" and told in str(err.value), err.value
    assert "structured_outputs.json is a schema xgrammar cannot compile: " in str(err.value)
    with pytest.raises(RuntimeError) as raw:
        xgrammar.GrammarCompiler(backend.info).compile_json_schema(json.dumps(schema))
    assert "#/" not in str(raw.value).replace("#/$defs/B", "")  # xgrammar's own message names no keyword path


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": -2**63, "maximum": 2**63 - 1}, {"type": "integer", "minimum": 2.0},
    {"type": "integer", "maximum": 9.2e18}, {"type": "number", "minimum": 1e300}, {"type": "number", "minimum": 2**64},
    {"type": "number", "minimum": 0, "exclusiveMinimum": 0}, {"type": "number", "minimum": 5, "maximum": 5},
    {"type": "integer", "exclusiveMinimum": 4, "exclusiveMaximum": 6}, {"type": "array", "items": False},
    {"type": "array", "prefixItems": [{}], "minItems": 1}, {"type": "object", "properties": {"a": True}},
    {"type": ["integer", "null"], "minimum": 3}, {"type": "string", "minLength": 3, "maxLength": 3},
    {"$defs": {"a/b": {"type": "integer"}}, "$ref": "#/$defs/a~1b"},
])
def test_values_xgrammar_compiles_are_kept(backend, schema):
    assert json.loads(StructuredOutputsParams(json=schema).json) == schema
    backend.compile(StructuredOutputsParams(json=schema))


def test_an_integer_beyond_a_double_is_refused_when_parsed(backend):
    schema = {"type": "integer", "enum": [1, 10**400]}
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(json=schema)
    assert "holds an integer beyond a double's range (about 1e400) at #/enum/1" in str(err.value)
    with pytest.raises(InvalidRequestError, match=r"\(about -1e5000\) at #/maximum"):
        StructuredOutputsParams(json={"type": "number", "maximum": -10**5000})
    with pytest.raises(RuntimeError):
        xgrammar.GrammarCompiler(backend.info).compile_json_schema(json.dumps(schema))


def test_a_function_schema_refused_when_parsed_names_the_function():
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(harmony_call=[("f", {"type": "object", "properties": {"n": {
            "type": "integer", "minimum": 0.5}}})])
    assert err.value.field == "structured_outputs.harmony_call"
    assert str(err.value).startswith("structured_outputs.harmony_call function 'f': its parameters schema is a schema "
                                     "xgrammar cannot compile: minimum 0.5 at #/properties/n/minimum")

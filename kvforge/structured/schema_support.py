"""The JSON-schema keywords xgrammar compiles without enforcing them: a schema that uses one is refused,
so no output that breaks its schema ever ends as if it were complete.

Found by compiling a schema with each keyword and feeding the matcher an instance that breaks it
(tests/test_structured_schema_support.py keeps that check): ``not``, ``if``/``then``/``else``,
``contains`` (and ``minContains``/``maxContains``), ``uniqueItems``, ``dependentRequired``,
``dependentSchemas``, ``dependencies``, an ``allOf`` of more than one schema, a ``$ref`` outside the
schema or to an anchor, a ``format`` outside :data:`ENFORCED_FORMATS` (but for :data:`ANNOTATION_FORMATS`, which every string
meets), ``pattern`` or ``format`` beside
``minLength``/``maxLength`` or beside each other, a ``required`` property that ``properties`` does not
list, ``multipleOf`` on anything but an integer by an integer, a lookahead (``(?=``, ``(?!``) in a
``pattern`` or ``patternProperties`` name, anything but annotations beside ``$ref``/``anyOf``/``oneOf``/
``allOf`` (read alone) or beside ``enum``/``const`` (only the values are enforced), one type's
constraints where no ``type`` is given, and a ``oneOf`` whose branches are not shown apart
(kvforge/structured/disjoint_schemas.py: xgrammar matches it as ``anyOf``). A ``$ref`` target outside
``$defs`` is scanned where the reference names it. A length or count bound (``minLength``, ``maxItems``, ...)
outside 0 to :data:`COUNT_MAX` is refused too: xgrammar refuses some such bounds, but reads others as another
bound or as none.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from kvforge.structured.disjoint_schemas import admits, declared_types, overlapping_pair, resolve

#: String formats xgrammar enforces.
ENFORCED_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uri", "uri-reference",
                              "uri-template", "uuid", "ipv4", "ipv6", "hostname", "json-pointer",
                              "relative-json-pointer"})
#: OpenAPI's formats that every string meets (pydantic's SecretStr and bytes): nothing is lost unenforced.
ANNOTATION_FORMATS = frozenset({"password", "binary"})
#: Keywords never enforced, with what to do instead.
NOT_ENFORCED = {
    "not": "state what is allowed instead",
    "if": "use anyOf of the cases", "then": "use anyOf of the cases", "else": "use anyOf of the cases",
    "contains": "list the items with prefixItems or enum", "minContains": "drop it", "maxContains": "drop it",
    "dependentRequired": "use anyOf of the allowed property sets",
    "dependentSchemas": "use anyOf of the allowed property sets",
    "dependencies": "use anyOf of the allowed property sets",
}
#: Formats no empty string meets: a minLength of 1 beside them asks nothing more.
NONEMPTY_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uri", "uuid", "ipv4", "ipv6",
                              "hostname"})
#: Keywords that only annotate (or, as ``nullable``, only widen): harmless where xgrammar skips them.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "discriminator", "$defs", "definitions", "$id", "$schema", "$anchor",
                         "nullable"})
#: Keywords xgrammar reads alone: nothing beside them but annotations is applied.
_COMBINERS = ("$ref", "anyOf", "oneOf", "allOf")
#: Keywords that restrict one type's values, which xgrammar applies only where the schema names a type.
_TYPED = ("pattern", "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
          "exclusiveMaximum", "multipleOf", "minItems", "maxItems")
#: Keywords that bound a length or a count, and the largest bound xgrammar reads as given (a 32-bit int's
#: largest: beyond it some bounds are refused, others wrap or read as no bound, as a negative one may).
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
COUNT_MAX = 2**31 - 1
#: References into these are scanned where they are defined.
_SCANNED_REFS = ("#/$defs/", "#/definitions/")
#: Keywords whose value is one subschema, and those whose value is a list or a name -> subschema object.
_ONE = ("items", "additionalProperties", "propertyNames", "not", "if", "then", "else", "contains")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")


def has_lookahead(pattern: str) -> bool:
    """Whether ``pattern`` opens a lookahead group: ``(?=`` or ``(?!`` neither escaped nor inside a
    character class (where ``[(?=]`` is three literal characters). A ``]`` always closes a class, so a
    lookahead is never missed where a reading keeps a leading ``]`` inside."""
    in_class, i = False, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"  # ECMAScript's reading ("[]" is empty) scans more outside a class
        elif char == "[":
            in_class = True
        elif pattern.startswith(("(?=", "(?!"), i):
            return True
        i += 1
    return False


def unenforced(schema, path: str = "#", root=None, followed: set | None = None) -> Iterator[str]:
    """Each use of a keyword xgrammar would not enforce in ``schema``, as ``"<keyword> at <path>: <what to
    do>"`` (the path in JSON-pointer form; ``root``: the whole schema, which ``$ref`` points into;
    ``followed``: the references already scanned)."""
    if not isinstance(schema, dict):
        return
    root = schema if root is None else root
    followed = set() if followed is None else followed
    for keyword, instead in NOT_ENFORCED.items():
        if keyword in schema:
            yield f"{keyword} at {path}: {instead}"
    for keyword in _COUNTS:
        bound = schema.get(keyword, 0)
        if isinstance(bound, bool) or not isinstance(bound, int) or not 0 <= bound <= COUNT_MAX:
            yield f"{keyword} {json.dumps(bound)[:40]} at {path}: must be an integer from 0 to {COUNT_MAX}"
    if schema.get("uniqueItems") is True:
        yield f"uniqueItems at {path}: drop it (or list the items with prefixItems)"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        yield f"allOf of {len(schema['allOf'])} schemas at {path}: merge them into one schema"
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        yield f"$ref {ref!r} at {path}: only references inside the schema (#/...) are followed; inline it"
    elif isinstance(ref, str) and ref not in followed and not ref.startswith(_SCANNED_REFS):
        followed.add(ref)  # a target outside $defs is scanned where the reference names it
        yield from unenforced(resolve(schema, root), ref, root, followed)
    combiners = [k for k in _COMBINERS if k in schema]
    if combiners:
        extra = sorted(k for k in schema if k not in ANNOTATIONS and k not in _COMBINERS)
        if extra or len(combiners) > 1:
            yield (f"{', '.join(extra or combiners[1:])} beside {combiners[0]} at {path}: xgrammar reads the "
                   f"{combiners[0]} alone; move the other keywords into it (into each branch)")
    types = schema.get("type")
    if types == []:
        yield f"type [] at {path}: name at least one type"
    values = [schema["const"]] if "const" in schema else schema.get("enum") if isinstance(schema.get("enum"),
                                                                                        list) else None
    if values is not None:
        others = sorted(k for k in schema if k not in ANNOTATIONS and k not in ("const", "enum", "type"))
        if others:
            yield (f"{', '.join(others)} beside {'const' if 'const' in schema else 'enum'} at {path}: only the "
                   f"listed values are enforced; list only values that meet the rest and drop it")
        allowed = declared_types(types)
        if allowed is not None and not all(admits(allowed, v) for v in values):
            yield f"enum values at {path} outside type {types!r}: the values are enforced, not the type; drop them"
    elif types is None and not combiners:
        loose = sorted(k for k in _TYPED if k in schema)
        if loose:
            yield f"{', '.join(loose)} at {path} without a type: xgrammar applies them only beside one; give the type"
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in ENFORCED_FORMATS and fmt not in ANNOTATION_FORMATS:
        yield (f"format {fmt!r} at {path}: enforced formats are {', '.join(sorted(ENFORCED_FORMATS))}; drop it or "
               f"give a pattern")
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        yield f"pattern with minLength/maxLength at {path}: put the length into the pattern"
    if "format" in schema and "pattern" in schema:
        yield f"format with pattern at {path}: drop one (the pattern alone may spell the format)"
    needless = fmt in NONEMPTY_FORMATS and "maxLength" not in schema and schema.get("minLength", 0) in (0, 1)
    if "format" in schema and ("minLength" in schema or "maxLength" in schema) and not needless:
        yield (f"format with minLength/maxLength at {path}: drop the length, or give a pattern with the length "
               f"in place of the format")
    patterns = [schema["pattern"]] if isinstance(schema.get("pattern"), str) else []
    if isinstance(schema.get("patternProperties"), dict):
        patterns += [name for name in schema["patternProperties"] if isinstance(name, str)]
    for pattern in patterns:
        if has_lookahead(pattern):
            yield f"lookahead in pattern {pattern!r} at {path}: write the pattern without (?= or (?!"
    if "multipleOf" in schema:
        step = schema["multipleOf"]
        whole = isinstance(step, int) and not isinstance(step, bool) or isinstance(step, float) and step.is_integer()
        if (declared_types(types) or set()) - {"null"} != {"integer"} or not whole:
            yield (f"multipleOf at {path}: enforced only for type integer by a whole number; use an integer of a "
                   f"smaller unit, or drop it")
    if isinstance(schema.get("oneOf"), list):
        pair = overlapping_pair(schema["oneOf"], root)
        if pair is not None:
            yield (f"oneOf at {path}: branches {pair[0]} and {pair[1]} may both match, and an output matching both "
                   f"would pass; use anyOf, or tell the branches apart by type, const/enum, or a required "
                   f"property with distinct const values")
    listed = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    missing = [name for name in required if name not in listed]
    if missing:
        yield (f"required {', '.join(map(str, missing))} at {path}: not in properties, which xgrammar never "
               f"requires; list it in properties")
    for keyword in _ONE:
        yield from unenforced(schema.get(keyword), f"{path}/{keyword}", root, followed)
    for keyword in _LIST:
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                yield from unenforced(sub, f"{path}/{keyword}/{i}", root, followed)
    for keyword in _NAMED:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                yield from unenforced(sub, f"{path}/{keyword}/{name}", root, followed)


def close_objects(schema):
    """A copy of ``schema`` with ``additionalProperties: false`` on every object schema in it (vLLM's
    ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _NAMED and isinstance(value, dict):
            out[key] = {name: close_objects(sub) for name, sub in value.items()}
        elif key in _ONE or key in _LIST:
            out[key] = close_objects(value)
        else:
            out[key] = value
    if out.get("type") == "object" or "properties" in out:
        out["additionalProperties"] = False
    return out

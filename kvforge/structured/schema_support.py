"""The JSON-schema keywords xgrammar compiles without enforcing them: a schema that uses one is refused,
so no output that breaks its schema ever ends as if it were complete.

Found by compiling a schema with each keyword and feeding the matcher an instance that breaks it
(tests/test_structured_schema_support.py keeps that check): ``not``, ``if``/``then``/``else``,
``contains`` (and ``minContains``/``maxContains``), ``uniqueItems``, ``dependentRequired``,
``dependentSchemas``, ``dependencies``, an ``allOf`` of more than one schema, a ``$ref`` outside the
schema or to an anchor, a ``format`` outside :data:`ENFORCED_FORMATS` (but for :data:`ANNOTATION_FORMATS`, which every string
meets), ``pattern`` or ``format`` beside
``minLength``/``maxLength`` or beside each other, a ``required`` property that ``properties`` does not
list, ``multipleOf`` on anything but an integer by an integer (and there by a step above
:data:`MULTIPLE_OF_MAX`, or beside one bound, or two too far apart), a lookahead (``(?=``, ``(?!``) in a
``pattern`` or ``patternProperties`` name, anything but annotations beside ``$ref``/``anyOf``/``oneOf``/
``allOf`` (read alone) or beside ``enum``/``const`` (only the values are enforced), one type's
constraints where no ``type`` is given, and a ``oneOf`` whose branches are not shown apart
(kvforge/structured/disjoint_schemas.py: xgrammar matches it as ``anyOf``). A ``$ref`` target outside
``$defs`` is scanned where the reference names it. A length or count bound (``minLength``, ``maxItems``, ...)
outside 0 to :data:`COUNT_MAX` is refused too: xgrammar refuses some such bounds, but reads others as another
bound or as none.

A value xgrammar cannot compile at all (:func:`unreadable`: a keyword's value of the wrong kind, a bound no value
meets, draft 4's boolean ``exclusiveMinimum`` and array ``items``, an integer's bound that is not a whole
64-bit number, a ``$ref`` to nothing) is refused as the parameters are made, at the keyword's path with what to
send instead, where xgrammar's own message would name neither.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

from kvforge.structured.disjoint_schemas import JSON_TYPES, admits, declared_types, overlapping_pair, resolve

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
#: ``multipleOf`` on an integer is enforced by a step of at most ``MULTIPLE_OF_MAX``, where the schema bounds
#: the integer on neither side or on both, at most ``MULTIPLE_OF_MAX_SPAN`` integers wide (bounded on one side
#: or more widely, and by a larger step, xgrammar compiles the type without the step).
MULTIPLE_OF_MAX = 1024
MULTIPLE_OF_MAX_SPAN = 10000
#: A number's bounds, lower ones first; xgrammar reads an integer's as a 64-bit integer, from INT_MIN to
#: INT_MAX (or, written with a fraction or exponent, as a double strictly between them).
_BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
INT_MIN, INT_MAX = -2**63, 2**63 - 1
#: Where xgrammar takes ``false`` (the schema no value meets) as a subschema.
_FALSE_TAKEN = ("items", "additionalProperties", "$defs", "definitions")
#: What to send in place of ``false`` where xgrammar does not take it.
_WITHOUT_FALSE = {"properties": "leave the property out (an object takes no property it does not list, unless "
                                "additionalProperties allows it)",
                  "anyOf": "leave the branch out", "oneOf": "leave the branch out"}
#: Keywords whose value xgrammar reads as one JSON kind only, and that kind in words.
_KINDS = {"type": (str, list), "pattern": str, "format": str, "$ref": str, "required": list, "enum": list,
          "anyOf": list, "oneOf": list, "allOf": list, "prefixItems": list,
          "properties": dict, "patternProperties": dict, "$defs": dict, "definitions": dict}
_KIND_NAMES = {str: "a string", list: "an array", dict: "an object", (str, list): "a type name or an array of them"}
#: Bounds on a count that no value meets when the first is above the second, with the type they bound.
_COUNT_PAIRS = (("minLength", "maxLength", "string"), ("minItems", "maxItems", "array"),
                ("minProperties", "maxProperties", "object"))
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


def pointer(name) -> str:
    """``name`` as one step of a JSON pointer (``~`` and ``/`` escaped)."""
    return str(name).replace("~", "~0").replace("/", "~1")


def subschemas(schema) -> Iterator[tuple[str, object]]:
    """The values of ``schema``'s keywords that are themselves schemas, each with its path from ``schema``
    (``properties/a``, ``anyOf/0``, ``items``), in the keywords' order."""
    for keyword in _ONE:
        if keyword in schema:
            yield keyword, schema[keyword]
    for keyword in _LIST:
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                yield f"{keyword}/{i}", sub
    for keyword in _NAMED:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                yield f"{keyword}/{pointer(name)}", sub


def walk(schema, path: str = "#", root=None, followed: set | None = None) -> Iterator[tuple[str, dict]]:
    """Each object schema in ``schema`` with its JSON-pointer path, ``schema`` first and each one before those
    inside it (``root``: the whole schema, which ``$ref`` points into). A ``$ref`` target outside ``$defs``
    comes where the reference names it, once (``followed``: the references already taken), with the
    reference as its path."""
    if not isinstance(schema, dict):
        return
    root = schema if root is None else root
    followed = set() if followed is None else followed
    yield path, schema
    ref = schema.get("$ref")
    if (isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) and ref not in followed
            and not ref.startswith(_SCANNED_REFS)):
        followed.add(ref)
        target = resolve(schema, root)
        if target is not schema:  # a reference to nothing is refused where it is (unreadable)
            yield from walk(target, ref, root, followed)
    for at, sub in subschemas(schema):
        yield from walk(sub, f"{path}/{at}", root, followed)


def unenforced(schema) -> Iterator[str]:
    """Each use of a keyword xgrammar would not enforce in ``schema``, as ``"<keyword> at <path>: <what to
    do>"`` (the path in JSON-pointer form)."""
    for path, node in walk(schema):
        yield from _unenforced_at(node, path, schema)


def _unenforced_at(schema: dict, path: str, root) -> Iterator[str]:
    """:func:`unenforced`'s uses in the one schema ``schema`` at ``path`` (not inside it)."""
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
        else:
            yield from _integer_step_unenforced(schema, int(step), path)
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


def _integer_bounds(schema: dict) -> tuple[float | None, float | None]:
    """The least and the greatest integer a schema's numeric bounds allow (None: unbounded on that side)."""
    lows = [math.ceil(schema["minimum"])] if _is_number(schema.get("minimum")) else []
    lows += [math.floor(schema["exclusiveMinimum"]) + 1] if _is_number(schema.get("exclusiveMinimum")) else []
    highs = [math.floor(schema["maximum"])] if _is_number(schema.get("maximum")) else []
    highs += [math.ceil(schema["exclusiveMaximum"]) - 1] if _is_number(schema.get("exclusiveMaximum")) else []
    return (max(lows) if lows else None), (min(highs) if highs else None)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer_step_unenforced(schema: dict, step: int, path: str) -> Iterator[str]:
    """An integer's whole ``multipleOf`` where xgrammar would not enforce it (:data:`MULTIPLE_OF_MAX`)."""
    if step > MULTIPLE_OF_MAX:
        yield (f"multipleOf {step} at {path}: enforced only up to {MULTIPLE_OF_MAX}; give a smaller step (an enum "
               f"of the allowed values, or a smaller unit), or drop it")
        return
    low, high = _integer_bounds(schema)
    if low is None and high is None:
        return
    if low is None or high is None:
        yield (f"multipleOf with only a{' lower' if high is None else 'n upper'} bound at {path}: enforced with "
               f"no bound or with both, at most {MULTIPLE_OF_MAX_SPAN:,} integers apart; give both bounds, or drop "
               f"the bound or the step")
    elif high - low + 1 > MULTIPLE_OF_MAX_SPAN:
        yield (f"multipleOf with bounds {high - low + 1:,} integers apart at {path}: enforced only between bounds "
               f"at most {MULTIPLE_OF_MAX_SPAN:,} integers apart; narrow the bounds, or drop them or the step")


def unreadable(schema) -> Iterator[str]:
    """Each value in ``schema`` that xgrammar cannot compile, as ``"<keyword> <value> at <path>: <what is
    wrong>; <what to send instead>"`` (the path: the keyword's own, in JSON-pointer form): a keyword's value
    of the wrong kind, a bound no value meets, draft 4's spellings (a boolean ``exclusiveMinimum``, an
    array as ``items``), an integer's bound that is not a whole 64-bit number, and a ``$ref`` to nothing."""
    for path, node in walk(schema):
        yield from _unreadable_at(node, path, schema)


def _shown(value) -> str:
    return json.dumps(value)[:40]


def _unreadable_at(schema: dict, path: str, root) -> Iterator[str]:
    """:func:`unreadable`'s values in the one schema ``schema`` at ``path`` (not inside it)."""
    wrong = set()
    for keyword, kind in _KINDS.items():
        if keyword in schema and (not isinstance(schema[keyword], kind) or isinstance(schema[keyword], bool)):
            wrong.add(keyword)
            yield f"{keyword} {_shown(schema[keyword])} at {path}/{keyword}: must be {_KIND_NAMES[kind]}"
    given = [] if "type" in wrong else [schema["type"]] if isinstance(schema.get("type"), str) else schema.get("type", [])
    unknown = [t for t in given if not isinstance(t, str) or t not in JSON_TYPES]
    if unknown:
        yield (f"type {_shown(schema['type'])} at {path}/type: {_shown(unknown[0])} is no JSON type; name "
               f"{', '.join(sorted(JSON_TYPES))}")
    types = {t for t in given if isinstance(t, str)}
    if schema.get("enum") == []:
        yield f"enum [] at {path}/enum: allows no value; list at least one"
    for at, sub in subschemas(schema):
        if at == "items" and isinstance(sub, list):
            yield (f"items {_shown(sub)} at {path}/items: draft 4's tuple form, which xgrammar does not read; send "
                   f"the list as prefixItems (and the schema of any further items, or false for none, as items)")
        elif not isinstance(sub, (dict, bool)) or (at == "propertyNames" and isinstance(sub, bool)):
            yield (f"{at.split('/')[0]} {_shown(sub)} at {path}/{at}: must be a schema (an object"
                   f"{'' if at == 'propertyNames' else ', or true or false'})")
        elif sub is False and at.split("/")[0] not in _FALSE_TAKEN:
            keyword = at.split("/")[0]
            yield (f"{keyword} false at {path}/{at}: a schema no value meets, which xgrammar takes only as items or "
                   f"additionalProperties; {_WITHOUT_FALSE.get(keyword, 'state what is allowed instead')}")
    names = schema.get("propertyNames")
    if isinstance(names, dict) and "string" not in (declared_types(names.get("type")) or {"string"}):
        yield (f"propertyNames at {path}/propertyNames/type: property names are strings, and no "
               f"{_shown(names['type'])} value is one; give type string")
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        probe = {"$ref": ref}
        if resolve(probe, root) is probe or not isinstance(resolve(probe, root), (dict, bool)):
            yield f"$ref {ref!r} at {path}/$ref: names no schema in this one; point it at one (under $defs)"
    bounded = []
    for keyword in _BOUNDS:
        if keyword not in schema:
            continue
        bound, at = schema[keyword], f"{path}/{keyword}"
        inclusive = keyword.replace("exclusiveM", "m")
        if isinstance(bound, bool) and keyword != inclusive:
            partner = schema.get(inclusive)
            yield (f"{keyword} {_shown(bound)} at {at}: draft 4's form, which xgrammar does not read; " + (
                f"drop it ({inclusive} alone is inclusive)" if not bound else
                f'give the bound itself: "{keyword}": {_shown(partner)} in place of "{inclusive}": {_shown(partner)}'
                if isinstance(partner, (int, float)) and not isinstance(partner, bool) else
                f'give the bound itself ("{keyword}": <the bound>)'))
        elif isinstance(bound, bool) or not isinstance(bound, (int, float)):
            yield f"{keyword} {_shown(bound)} at {at}: must be a number"
        elif "integer" in types and isinstance(bound, float) and not bound.is_integer():
            whole = math.ceil(bound) if keyword in _BOUNDS[:2] else math.floor(bound)
            plain = "minimum" if keyword in _BOUNDS[:2] else "maximum"
            yield (f"{keyword} {_shown(bound)} at {at}: an integer's bound must be a whole number; " + (
                "drop integer from type (number takes integers too)" if "number" in types else
                f'give "{plain}": {whole} (the same integers)'))
        elif "integer" in types and not (INT_MIN <= bound <= INT_MAX if isinstance(bound, int)
                                          else INT_MIN < bound < -INT_MIN):
            yield (f"{keyword} {_shown(bound)} at {at}: an integer's bound must lie from {INT_MIN} to {INT_MAX} "
                   f"(xgrammar reads it as a 64-bit integer); give one in that range" + (
                       " written as an integer" if isinstance(bound, float) else ""))
        else:
            bounded.append(keyword)
    if len(bounded) == sum(k in schema for k in _BOUNDS) and types & {"integer", "number"}:
        yield from _empty_range(schema, path, types, bounded)
    multiple = schema.get("multipleOf")
    if "multipleOf" in schema and (isinstance(multiple, bool) or not isinstance(multiple, (int, float))
                                   or multiple <= 0):
        yield f"multipleOf {_shown(multiple)} at {path}/multipleOf: must be a number greater than 0"
    for least, most, kind in _COUNT_PAIRS:
        low, high = schema.get(least), schema.get(most)
        if kind in types and all(isinstance(n, int) and not isinstance(n, bool) for n in (low, high)) and low > high:
            yield (f"{least} {low} at {path}/{least}: above {most} {high}, so no {kind} meets both; give a {least} "
                   f"no greater than the {most}")
    prefix = schema.get("prefixItems")
    low = schema.get("minItems")
    if ("array" in types and isinstance(prefix, list) and schema.get("items", False) is False
            and isinstance(low, int) and not isinstance(low, bool) and low > len(prefix)):
        yield (f"minItems {low} at {path}/minItems: above the {len(prefix)} items prefixItems lists, and no further "
               f"item is allowed (items false or not given); give items the schema of further items, or a minItems "
               f"of at most {len(prefix)}")


def _empty_range(schema: dict, path: str, types: set, bounded: list) -> Iterator[str]:
    """The refusal of numeric bounds (all numbers, named in ``bounded``) that no value of ``types`` meets."""
    low, low_open, high, high_open = -math.inf, False, math.inf, False
    for keyword in bounded:
        bound, is_open = schema[keyword], keyword.startswith("exclusive")
        if keyword in _BOUNDS[:2] and (bound > low or (bound == low and is_open)):
            low, low_open = bound, is_open
        elif keyword in _BOUNDS[2:] and (bound < high or (bound == high and is_open)):
            high, high_open = bound, is_open
    if math.isinf(low) or math.isinf(high):
        return
    empty = low > high or (low == high and (low_open or high_open))
    kind = "number"
    if not empty and "integer" in types:
        least = math.floor(low) + 1 if low_open else math.ceil(low)
        greatest = math.ceil(high) - 1 if high_open else math.floor(high)
        empty, kind = least > greatest, "integer"
    if empty:
        given = ", ".join(f"{k} {_shown(schema[k])}" for k in bounded)
        yield (f"{given} at {path}: no {kind} meets them all; give bounds with a value between them (the lower "
               f"bound below the upper)")


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

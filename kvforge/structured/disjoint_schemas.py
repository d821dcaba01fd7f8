"""Whether no output a grammar allows for one of two JSON schemas can match the other, as far as their
types, constants, properties and ranges show.

``oneOf`` means "exactly one branch matches". A grammar can only say "some branch matches" (``anyOf``),
which is the same thing exactly when no output of one branch matches another; where that cannot be shown
here, a ``oneOf`` would let an output matching two branches through, so it is refused
(kvforge/structured/schema_support.py). Shown by distinct types or constants, by a property one branch
requires and the other lists with a disjoint schema, or (objects being compiled closed, xgrammar's strict
mode: only the listed properties) by each of two closed objects requiring a property the other does not
list, or by ranges that share no value (``minimum``/``maximum`` and their exclusive forms for numbers,
``minLength``/``maxLength`` for strings, ``minItems``/``maxItems`` for arrays: xgrammar enforces each) in
every type both allow. The proof is conservative: False means "not shown", not "overlapping".
"""

from __future__ import annotations

import json
import math

#: The JSON types; an ``integer`` is also a ``number``.
JSON_TYPES = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})


def resolve(schema, root):
    """``schema`` with a ``#/...`` ``$ref`` followed inside ``root`` (once per hop, at most 32 hops);
    the schema as it is where the reference cannot be followed."""
    for _ in range(32):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#"):
            return schema
        target = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return schema
            target = target[part]
        schema = target
    return schema


def _value_key(value):
    """A key equal for JSON-equal values (1 and 1.0 are one number; True is not 1)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ("number", float(value))
    return ("json", json.dumps(value, sort_keys=True))


def json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def declared_types(types) -> set[str] | None:
    """The type names a schema's ``type`` keyword gives (None where it gives none)."""
    if isinstance(types, str):
        return {types}
    if isinstance(types, list):
        return {t for t in types if isinstance(t, str)}
    return None


def admits(types: set[str], value) -> bool:
    """Whether a ``type`` of these names admits ``value`` (an integer is also a number)."""
    kind = json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def _values(schema) -> list | None:
    """The only values ``schema`` allows (its ``const`` or ``enum``), or None where it does not list them."""
    if "const" in schema:
        return [schema["const"]]
    if isinstance(schema.get("enum"), list):
        return schema["enum"]
    return None


def _types(schema) -> set[str]:
    """The JSON types an instance of ``schema`` may have (all of them where nothing says)."""
    values = _values(schema)
    if values is not None:
        return {json_type(v) for v in values}
    names = (declared_types(schema.get("type")) or set(JSON_TYPES)) & JSON_TYPES
    if "number" in names:
        names.add("integer")
    if "integer" in names:
        names.add("number")  # an integer instance is a number: the two overlap
    return names


def disjoint(a, b, root, depth: int = 0) -> bool:
    """Whether no output of one of ``a`` and ``b`` can match the other (``$ref`` followed inside ``root``), by
    the rules of the module docstring."""
    a, b = resolve(a, root), resolve(b, root)
    if not isinstance(a, dict) or not isinstance(b, dict) or depth > 16:
        return a is False or b is False
    common = _types(a) & _types(b)
    if not common:
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None:
        return not {_value_key(v) for v in va} & {_value_key(v) for v in vb}
    if va is not None or vb is not None or common & {"null", "boolean"}:
        return False
    # every type both allow must be told apart within that type
    if common & {"integer", "number"} and not _apart(_number_range(a), _number_range(b)):
        return False
    if "string" in common and not _apart(_count_range(a, "minLength", "maxLength"),
                                         _count_range(b, "minLength", "maxLength")):
        return False
    if "array" in common and not _apart(_count_range(a, "minItems", "maxItems"),
                                        _count_range(b, "minItems", "maxItems")):
        return False
    return "object" not in common or _objects_apart(a, b, root, depth)


def _objects_apart(a, b, root, depth: int) -> bool:
    """Whether no object matches both: a property one requires and the other lists with a disjoint schema,
    or two closed objects each requiring a property the other does not list."""
    props_a = a.get("properties") if isinstance(a.get("properties"), dict) else {}
    props_b = b.get("properties") if isinstance(b.get("properties"), dict) else {}
    required_a = a.get("required") if isinstance(a.get("required"), list) else []
    required_b = b.get("required") if isinstance(b.get("required"), list) else []
    for name in (set(required_a) & set(props_b)) | (set(required_b) & set(props_a)):
        if name in props_a and name in props_b and disjoint(props_a[name], props_b[name], root, depth + 1):
            return True
    return _closed(a) and _closed(b) and not set(required_b) <= set(props_a) and not set(required_a) <= set(props_b)


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _number_range(schema) -> tuple[float, bool, float, bool]:
    """``(low, low_open, high, high_open)`` of the numbers ``schema`` allows. A boolean ``exclusiveMinimum``
    (draft 4) is read as inclusive: the range is only ever wider than the schema's."""
    low, low_open, high, high_open = -math.inf, False, math.inf, False
    for name, is_open in (("minimum", False), ("exclusiveMinimum", True)):
        bound = _number(schema.get(name))
        if bound is not None and (bound > low or (bound == low and is_open)):
            low, low_open = bound, is_open
    for name, is_open in (("maximum", False), ("exclusiveMaximum", True)):
        bound = _number(schema.get(name))
        if bound is not None and (bound < high or (bound == high and is_open)):
            high, high_open = bound, is_open
    return low, low_open, high, high_open


def _count_range(schema, least: str, most: str) -> tuple[float, bool, float, bool]:
    """The range of a count (a string's length, an array's items) as :func:`_number_range` gives it."""
    low, high = _number(schema.get(least)), _number(schema.get(most))
    return (0.0 if low is None else low), False, (math.inf if high is None else high), False


def _apart(first: tuple[float, bool, float, bool], second: tuple[float, bool, float, bool]) -> bool:
    """Whether two ranges share no value."""
    def below(upper, lower):  # every value of range ``upper`` lies below every value of range ``lower``
        return upper[2] < lower[0] or (upper[2] == lower[0] and (upper[3] or lower[1]))
    return below(first, second) or below(second, first)


def _closed(schema) -> bool:
    """Whether an object schema compiles closed: its outputs hold only the properties it lists."""
    return schema.get("additionalProperties", False) is False and not schema.get("patternProperties")


def overlapping_pair(branches: list, root) -> tuple[int, int] | None:
    """The first two of ``branches`` not shown disjoint, or None where every pair is."""
    for i in range(len(branches)):
        for j in range(i + 1, len(branches)):
            if not disjoint(branches[i], branches[j], root):
                return i, j
    return None

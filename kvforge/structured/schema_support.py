"""The JSON-schema keywords xgrammar compiles without enforcing them: a schema that uses one is refused,
so no output that breaks its schema ever ends as if it were complete.

Found by compiling a schema with each keyword and feeding the matcher an instance that breaks it
(tests/test_structured_schema_support.py keeps that check): ``not``, ``if``/``then``/``else``,
``contains`` (and ``minContains``/``maxContains``), ``uniqueItems``, ``dependentRequired``,
``dependentSchemas``, an ``allOf`` of more than one schema, a ``$ref`` outside the schema, a ``format``
outside :data:`ENFORCED_FORMATS`, ``pattern`` beside ``minLength``/``maxLength``, and a ``required``
property that ``properties`` does not list where no other property is allowed.
"""

from __future__ import annotations

from collections.abc import Iterator

#: String formats xgrammar enforces.
ENFORCED_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uri", "uri-reference",
                              "uri-template", "uuid", "ipv4", "ipv6", "hostname", "json-pointer",
                              "relative-json-pointer"})
#: Keywords never enforced, with what to do instead.
NOT_ENFORCED = {
    "not": "state what is allowed instead",
    "if": "use anyOf of the cases", "then": "use anyOf of the cases", "else": "use anyOf of the cases",
    "contains": "list the items with prefixItems or enum", "minContains": "drop it", "maxContains": "drop it",
    "dependentRequired": "use anyOf of the allowed property sets",
    "dependentSchemas": "use anyOf of the allowed property sets",
}
#: Keywords whose value is one subschema, and those whose value is a list or a name -> subschema object.
_ONE = ("items", "additionalProperties", "propertyNames", "not", "if", "then", "else", "contains")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")


def unenforced(schema, path: str = "#") -> Iterator[str]:
    """Each use of a keyword xgrammar would not enforce in ``schema``, as ``"<keyword> at <path>: <what to
    do>"`` (the path in JSON-pointer form)."""
    if not isinstance(schema, dict):
        return
    for keyword, instead in NOT_ENFORCED.items():
        if keyword in schema:
            yield f"{keyword} at {path}: {instead}"
    if schema.get("uniqueItems") is True:
        yield f"uniqueItems at {path}: drop it (or list the items with prefixItems)"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        yield f"allOf of {len(schema['allOf'])} schemas at {path}: merge them into one schema"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        yield f"$ref {ref!r} at {path}: only references inside the schema (#/...) are followed; inline it"
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in ENFORCED_FORMATS:
        yield (f"format {fmt!r} at {path}: enforced formats are {', '.join(sorted(ENFORCED_FORMATS))}; drop it or "
               f"give a pattern")
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        yield f"pattern with minLength/maxLength at {path}: put the length into the pattern"
    listed = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    closed = schema.get("additionalProperties", False) is False and not schema.get("patternProperties")
    missing = [name for name in required if name not in listed]
    if missing and closed:
        yield (f"required {', '.join(map(str, missing))} at {path}: not in properties, so never allowed; list it "
               f"in properties")
    for keyword in _ONE:
        yield from unenforced(schema.get(keyword), f"{path}/{keyword}")
    for keyword in _LIST:
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                yield from unenforced(sub, f"{path}/{keyword}/{i}")
    for keyword in _NAMED:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                yield from unenforced(sub, f"{path}/{keyword}/{name}")


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

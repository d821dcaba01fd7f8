"""Typed reading of a request's JSON fields: the error a bad field raises (InvalidRequestError, a 400 naming
the field), JSON's names of value types, and request values as error messages show them (JSON, cut short).
"""

from __future__ import annotations

import json
from typing import Any

from kvforge.errors import InvalidRequestError

#: A request value shown in an error message is cut to this many characters (then ``...``).
SHOWN_CHARS = 40


#: JSON's type names by Python type, bool before int (a bool is an int to isinstance).
_JSON_TYPE_NAMES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                    (list, "array"), (dict, "object"))


def type_name(value: Any) -> str:
    """JSON's name of the type of ``value`` (a value ``json.loads`` gives): null, boolean, integer, number,
    string, array or object."""
    return next((name for kind, name in _JSON_TYPE_NAMES if isinstance(value, kind)), type(value).__name__)


def shown(value: Any) -> str:
    """``value`` as an error message shows it: as JSON (``true``, ``null``, ``"text"``), at most
    :data:`SHOWN_CHARS` characters, so a value of any size gives a short message."""
    text = json.dumps(value[:SHOWN_CHARS] if isinstance(value, str) else value, ensure_ascii=False, default=str)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def bad_field(name: str, why: str):
    raise InvalidRequestError(f"'{name}': {why}", field=name)


def expected(*kinds: str) -> str:
    """``kinds`` (type_name's names) as a message names them: ``a string or an object``."""
    return " or ".join(("an " if kind[0] in "aeiou" else "a ") + kind for kind in kinds)


def get_typed(body: dict, name: str, default, *kinds: str, where: str = ""):
    """``body[name]`` (absent or null: ``default``) where its JSON type is one of ``kinds`` (type_name's
    names), else a 400 naming the field and the types it takes; ``where`` prefixes the field's name in errors
    (``stream_options.``)."""
    value = body.get(name)
    if value is None:
        return default
    if type_name(value) not in kinds:
        bad_field(where + name, f"expected {expected(*kinds)}, got {type_name(value)}")
    return value


def get_bool(body: dict, name: str, default: bool | None, where: str = "") -> bool | None:
    """``body[name]`` as a bool (absent or null: ``default``)."""
    return get_typed(body, name, default, "boolean", where=where)


def get_string(body: dict, name: str, default: str | None) -> str | None:
    return get_typed(body, name, default, "string")


def get_array(body: dict, name: str, default: list | None) -> list | None:
    return get_typed(body, name, default, "array")


def get_object(body: dict, name: str, default: dict | None) -> dict | None:
    return get_typed(body, name, default, "object")


def check_body(body: Any) -> dict:
    """A request body that is a JSON object, else a 400 naming ``body``."""
    if not isinstance(body, dict):
        bad_field("body", f"expected a JSON object, got {type_name(body)}")
    return body

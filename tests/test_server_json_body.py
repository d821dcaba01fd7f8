"""The request body's JSON: malformed bodies, nesting deeper than the parser takes, and strings that
hold a lone UTF-16 surrogate are InvalidRequestErrors naming where; valid text passes unchanged."""

from __future__ import annotations

import pytest

from kvforge.errors import InvalidRequestError
from kvforge.server.protocol import decode_json_body


def test_valid_text_passes_unchanged_surrogate_pairs_included():
    body = decode_json_body(b'{"prompt": ["caf\\u00e9", "\\ud83d\\ude00"], "n": 2}')
    assert body == {"prompt": ["caf\u00e9", "\U0001F600"], "n": 2}


@pytest.mark.parametrize("raw, where", [
    (b'{"prompt": "\\ud800abc"}', "prompt"),
    (b'{"prompt": ["ok", "\\udfff"]}', "prompt[1]"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages[0].content"),
    (b'{"logit_bias": {"\\udc00": 1}}', "logit_bias"),
    (b'"\\ud800"', "body"),
])
def test_a_lone_surrogate_is_refused_naming_its_place(raw, where):
    with pytest.raises(InvalidRequestError) as err:
        decode_json_body(raw)
    assert err.value.field == where and "lone UTF-16 surrogate" in str(err.value)


@pytest.mark.parametrize("raw, why", [
    (b"{", "malformed JSON body"),
    (b"\xff\xfe", "malformed JSON body"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_bodies_the_parser_cannot_take(raw, why):
    with pytest.raises(InvalidRequestError) as err:
        decode_json_body(raw)
    assert err.value.field == "body" and why in str(err.value)

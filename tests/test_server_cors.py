"""CORS (vLLM's --allowed-origins/--allowed-methods/--allowed-headers/--allow-credentials): a browser origin
gets Access-Control-Allow-Origin on every response (errors and streams included), a preflight is answered
before authentication, a refused origin, method or header is named, and requests without Origin are
untouched."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine  # noqa: E402

from kvforge.errors import ConfigError  # noqa: E402
from kvforge.server.app import ServerThread, create_app  # noqa: E402
from kvforge.server.cors import CorsPolicy, parse_json_list  # noqa: E402

PAGE = "https://app.example"


def call(url: str, method: str = "GET", headers: dict | None = None, body: dict | None = None):
    """(status, headers, text) without raising on HTTP errors."""
    req = urllib.request.Request(url, method=method, headers=headers or {},
                                 data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


@pytest.fixture(scope="module")
def open_server():
    with ServerThread(create_app(FakeEngine(), api_key="k")) as srv:  # the default policy: vLLM's
        yield srv


@pytest.fixture(scope="module")
def strict_server():
    policy = CorsPolicy(origins=(PAGE,), methods=("GET", "POST"), headers=("Authorization", "Content-Type"),
                        credentials=True)
    with ServerThread(create_app(FakeEngine(), cors=policy)) as srv:
        yield srv


def test_the_default_policy_allows_any_origin_on_every_response(open_server):
    ok = call(open_server.url + "/v1/models", headers={"Origin": PAGE, "Authorization": "Bearer k"})
    refused = call(open_server.url + "/v1/models", headers={"Origin": PAGE})  # 401 still readable by the page
    assert ok[0] == 200 and ok[1]["Access-Control-Allow-Origin"] == "*"
    assert refused[0] == 401 and refused[1]["Access-Control-Allow-Origin"] == "*"
    plain = call(open_server.url + "/health")
    assert "Access-Control-Allow-Origin" not in plain[1]


def test_a_preflight_is_answered_before_authentication(open_server):
    status, headers, _ = call(open_server.url + "/v1/chat/completions", "OPTIONS",
                              {"Origin": PAGE, "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 200
    assert headers["Access-Control-Allow-Origin"] == "*" and headers["Access-Control-Allow-Methods"] == "POST"
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert int(headers["Access-Control-Max-Age"]) > 0


def test_a_stream_carries_the_origin_header(open_server):
    status, headers, text = call(open_server.url + "/v1/completions", "POST",
                                 {"Origin": PAGE, "Authorization": "Bearer k", "Content-Type": "application/json"},
                                 {"prompt": "ab", "max_tokens": 2, "stream": True})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*" and text.rstrip().endswith("[DONE]")


def test_named_origins_echo_the_origin_with_credentials(strict_server):
    status, headers, _ = call(strict_server.url + "/v1/models", headers={"Origin": PAGE})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == PAGE
    assert headers["Access-Control-Allow-Credentials"] == "true" and "Origin" in headers["Vary"]
    other = call(strict_server.url + "/v1/models", headers={"Origin": "https://evil.example"})
    assert other[0] == 200 and "Access-Control-Allow-Origin" not in other[1]  # the browser hides the answer


@pytest.mark.parametrize("origin, method, asked, names", [
    ("https://evil.example", "POST", "", "origin https://evil.example"),
    (PAGE, "DELETE", "", "method DELETE"),
    (PAGE, "POST", "x-secret", "headers x-secret"),
])
def test_a_refused_preflight_names_what_is_refused(strict_server, origin, method, asked, names):
    headers = {"Origin": origin, "Access-Control-Request-Method": method}
    if asked:
        headers["Access-Control-Request-Headers"] = asked
    status, _, text = call(strict_server.url + "/v1/completions", "OPTIONS", headers)
    assert status == 400 and names in text


def test_an_allowed_preflight_lists_the_policys_methods_and_headers(strict_server):
    status, headers, _ = call(strict_server.url + "/v1/completions", "OPTIONS",
                              {"Origin": PAGE, "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "content-type"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == PAGE
    assert headers["Access-Control-Allow-Methods"] == "GET, POST"
    assert headers["Access-Control-Allow-Headers"] == "Accept, Accept-Language, Authorization, Content-Language, Content-Type"


def test_safelisted_headers_pass_a_policy_that_lists_only_authorization():
    """A page sending JSON names Content-Type in its preflight: allowed whatever the list (Starlette's rule)."""
    policy = CorsPolicy(origins=(PAGE,), headers=("Authorization",))
    with ServerThread(create_app(FakeEngine(), cors=policy)) as srv:
        status, headers, _ = call(srv.url + "/v1/completions", "OPTIONS",
                                  {"Origin": PAGE, "Access-Control-Request-Method": "POST",
                                   "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 200 and "Content-Type" in headers["Access-Control-Allow-Headers"]


def test_flags_take_json_lists_of_strings():
    assert parse_json_list("--allowed-origins", '["*"]') == ("*",)
    for bad in ("*", '"*"', "[1]", "{}"):
        with pytest.raises(ConfigError, match="--allowed-origins takes a JSON list of strings"):
            parse_json_list("--allowed-origins", bad)
    with pytest.raises(ConfigError, match=r'\["GET", "POST"\]'):
        parse_json_list("--allowed-methods", "GET")

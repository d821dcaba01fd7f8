"""One API-key rule for the server and its clients (kvforge/server/api_keys.py): ``kvforge serve``
takes ``--api-key``, else ``$KVFORGE_API_KEY``; ``kvforge bench serve`` and ``kvforge eval gsm8k`` send
``--api-key``, else ``$KVFORGE_API_KEY``, else ``$OPENAI_API_KEY``. Checked on the rule itself and end to
end: the server started by ``serve_main`` and ``kvforge bench serve`` against a live server."""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine  # noqa: E402

from kvforge.bench.serve_bench import bench_serve_main  # noqa: E402
from kvforge.server.api_keys import client_api_key, server_api_key  # noqa: E402
from kvforge.server.app import ServerThread, create_app  # noqa: E402


@pytest.mark.parametrize("flag, environ, want", [
    (None, {}, None),
    ("flag", {"KVFORGE_API_KEY": "kv", "OPENAI_API_KEY": "oa"}, "flag"),
    (None, {"KVFORGE_API_KEY": "kv", "OPENAI_API_KEY": "oa"}, "kv"),
    (None, {"OPENAI_API_KEY": "oa"}, "oa"),
    (None, {"KVFORGE_API_KEY": "", "OPENAI_API_KEY": "oa"}, "oa"),  # empty counts as unset
    ("", {"OPENAI_API_KEY": ""}, None),
])
def test_client_key_precedence(flag, environ, want):
    assert client_api_key(flag, environ) == want


@pytest.mark.parametrize("flag, environ, want", [
    (None, {}, None),
    ("flag", {"KVFORGE_API_KEY": "kv"}, "flag"),
    (None, {"KVFORGE_API_KEY": "kv"}, "kv"),
    (None, {"OPENAI_API_KEY": "oa"}, None),  # the server never takes the client's OpenAI key
    (None, {"KVFORGE_API_KEY": ""}, None),
])
def test_server_key_precedence(flag, environ, want):
    assert server_api_key(flag, environ) == want


def _status(url: str, key: str | None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class _ServedFakeEngine(FakeEngine):
    def shutdown(self) -> None:  # serve_main shuts its engine down on the way out
        pass


@pytest.mark.parametrize("flag, env, want", [(None, "from-env", "from-env"), ("from-flag", "from-env", "from-flag")],
                         ids=["environment", "flag-wins"])
def test_serve_requires_the_key_from_the_flag_else_the_environment(monkeypatch, flag, env, want):
    import kvforge.engine.llm_engine
    import kvforge.server.app
    from kvforge.server.cli import serve_main

    monkeypatch.setenv("KVFORGE_API_KEY", env)
    monkeypatch.setattr(kvforge.engine.llm_engine.LLMEngine, "from_engine_args",
                        staticmethod(lambda engine_args: _ServedFakeEngine()))
    seen = {}

    def serve_once(app, host, port, sock=None):  # stands in for serve(): check the app, then stop
        sock.close()
        with ServerThread(app) as srv:
            url = srv.url + "/v1/models"
            seen["statuses"] = {k: _status(url, k) for k in (want, "other", None)}
        return 0

    monkeypatch.setattr(kvforge.server.app, "serve", serve_once)
    argv = ["--device", "cpu", "--port", "0"] + (["--api-key", flag] if flag else [])
    assert serve_main(argv) == 0
    assert seen["statuses"] == {want: 200, "other": 401, None: 401}


@pytest.fixture(scope="module")
def keyed_server():
    with ServerThread(create_app(FakeEngine(), api_key="right")) as srv:
        yield srv


BENCH = ["--isl", "8", "--osl", "2", "--concurrency", "1", "--num-requests", "1", "--repetitions", "1",
         "--warmup", "0"]


@pytest.mark.parametrize("flag, kvforge_env, openai_env, rc", [
    (None, "right", "wrong", 0),
    (None, None, "right", 0),
    ("right", "wrong", "wrong", 0),
    (None, "wrong", "right", 2),  # $KVFORGE_API_KEY comes before $OPENAI_API_KEY
    (None, None, None, 2),
], ids=["kvforge-env", "openai-env", "flag", "kvforge-env-first", "none"])
def test_bench_serve_sends_the_flag_else_kvforge_else_openai_key(keyed_server, monkeypatch, capsys, flag,
                                                               kvforge_env, openai_env, rc):
    for name, value in (("KVFORGE_API_KEY", kvforge_env), ("OPENAI_API_KEY", openai_env)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    argv = ["--base-url", keyed_server.url, *BENCH] + (["--api-key", flag] if flag else [])
    assert bench_serve_main(argv) == rc
    if rc:  # /v1/models answered 401: the message says how to send a key
        err = capsys.readouterr().err
        assert "401" in err and "--api-key" in err and "KVFORGE_API_KEY" in err and "OPENAI_API_KEY" in err


def test_bench_serve_names_the_fix_when_completions_answer_401(keyed_server, monkeypatch, capsys):
    monkeypatch.delenv("KVFORGE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    # With --model the listing is skipped: every completion fails with 401.
    assert bench_serve_main(["--base-url", keyed_server.url, "--model", FakeEngine.model_name, *BENCH]) == 1
    err = capsys.readouterr().err
    assert "HTTP 401" in err and "--api-key" in err and "KVFORGE_API_KEY" in err


@pytest.mark.parametrize("header, status", [("Bearer right", 200), ("bearer right", 200), ("BEARER  right ", 200),
                                            ("Bearer wrong", 401), ("Basic right", 401), ("right", 401)])
def test_the_bearer_scheme_is_case_insensitive(keyed_server, header, status):
    req = urllib.request.Request(keyed_server.url + "/v1/models", headers={"Authorization": header})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == status
    except urllib.error.HTTPError as e:
        assert e.code == status


def test_a_method_a_route_does_not_serve_keeps_the_routes_label(keyed_server):
    """A 405 on a served path counts under that path in the HTTP metric, not under "other"."""
    req = urllib.request.Request(keyed_server.url + "/v1/chat/completions", headers={"Authorization": "Bearer right"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 405 and err.value.headers["Allow"] == "POST"
    with urllib.request.urlopen(keyed_server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    assert any(line.startswith("kvforge:http_requests_total{") and 'path="/v1/chat/completions"' in line
               and 'status="405"' in line for line in text.splitlines())

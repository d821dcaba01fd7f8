"""``--served-model-name A B`` (vLLM's flag): the server answers to every name and reports the first."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine  # noqa: E402
from http_json import http  # noqa: E402

from kvforge.config import EngineArgs  # noqa: E402
from kvforge.server.app import ServerThread, create_app  # noqa: E402


def _args(argv):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_the_flag_takes_one_or_more_names():
    assert (_args([]).served_model_name, _args([]).served_model_aliases) == (None, ())
    one = _args(["--served-model-name", "a"])
    assert (one.served_model_name, one.served_model_aliases) == ("a", ())
    two = _args(["--served-model-name", "org/a", "b", "c"])
    assert (two.served_model_name, two.served_model_aliases) == ("org/a", ("b", "c"))


def _call(url, body=None):
    return http("GET" if body is None else "POST", url, body, timeout=30)


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    engine.model_name, engine.model_aliases = "org/a", ("b",)
    with ServerThread(create_app(engine)) as srv:
        yield srv


def test_every_name_is_served_and_the_first_is_reported(server):
    status, listed = _call(server.url + "/v1/models")
    assert status == 200 and [m["id"] for m in listed["data"]] == ["org/a", "b"]
    assert _call(server.url + "/v1/models/b")[1]["id"] == "b"
    for name in ("org/a", "b", None):
        body = {"prompt": "hi", "max_tokens": 2, **({"model": name} if name else {})}
        status, out = _call(server.url + "/v1/completions", body)
        assert status == 200 and out["model"] == "org/a"
    assert _call(server.url + "/tokenize", {"model": "b", "prompt": "hi"})[0] == 200
    status, out = _call(server.url + "/v1/completions", {"model": "c", "prompt": "hi"})
    assert status == 404 and 'serves "org/a", "b"' in out["error"]["message"]

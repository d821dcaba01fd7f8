"""Connections as raw HTTP sees them. Clients that stall cannot hold them forever: a connection without a
whole request's headers is closed after ``KEEP_ALIVE_TIMEOUT_S``, a body that stops arriving is answered 408
after ``BODY_READ_TIMEOUT_S`` (both shortened here), and the server serves on. ``Expect: 100-continue``
gets the 413 of a body over the limit before the body is sent, and 100 Continue otherwise. A request aiohttp
cannot parse is answered 400 and logged as one WARNING line, not an ERROR with a traceback."""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine  # noqa: E402
from http_json import http  # noqa: E402

import kvforge.server.app as server_app  # noqa: E402


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(server_app, "KEEP_ALIVE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(server_app, "BODY_READ_TIMEOUT_S", 1.0)
    with server_app.ServerThread(server_app.create_app(FakeEngine(), max_request_bytes=4096)) as srv:
        yield srv


def _send(srv, payload: bytes) -> tuple[float, bytes]:
    """Send ``payload`` and read until the server closes or has sent one whole response: (seconds until
    then, what it sent)."""
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as conn:
        conn.sendall(payload)
        t0, got = time.monotonic(), b""
        while chunk := conn.recv(4096):
            got += chunk
            head, sep, body = got.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if sep and length is not None and len(body) >= length:
                break
        return time.monotonic() - t0, got


@pytest.mark.parametrize("payload", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"],
                         ids=["nothing", "half-the-headers"])
def test_a_connection_without_a_whole_request_is_closed(server, payload):
    waited, got = _send(server, payload)
    assert got == b"" and waited < 10
    assert http("GET", server.url + "/health")[0] == 200


def test_a_body_that_stops_arriving_is_a_408_and_the_connection_closes(server):
    waited, got = _send(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 100\r\n\r\n{")
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"Connection: close" in head and waited < 10
    error = json.loads(body)["error"]
    assert error["param"] == "body" and "did not arrive within 1 s" in error["message"]
    assert http("GET", server.url + "/health")[0] == 200


def test_expect_continue_refuses_a_body_over_the_limit_before_it_is_sent(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n")
    waited, got = _send(server, head % 5000)  # over the 4096-byte limit; no body follows
    status, _, rest = got.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large" and waited < 5
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_too_large"
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as conn:
        conn.sendall(head % len(body))
        assert conn.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"  # invited, then answered
        conn.sendall(body)
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("payload,problem", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
     "Invalid character in chunk size"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"2\r\n{}\r\n0\r\n\r\n", "Transfer-Encoding can't be present with Content-Length"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", "Got more than 8190 bytes"),
], ids=["chunk-size", "length-and-chunked", "long-header"])
def test_a_request_aiohttp_cannot_parse_is_one_warning_line(server, caplog, payload, problem):
    caplog.set_level(logging.DEBUG)
    _, got = _send(server, payload)
    assert got.startswith(b"HTTP/1.0 400 Bad Request") or got.startswith(b"HTTP/1.1 400 Bad Request"), got[:200]
    assert http("GET", server.url + "/health")[0] == 200
    lines = [r for r in caplog.records if r.name == "kvforge.server.http"]
    assert [r.levelname for r in lines] == ["WARNING"], [(r.levelname, r.getMessage()) for r in lines]
    message = lines[0].getMessage()
    assert message.startswith("malformed HTTP request from 127.0.0.1, answered 400: " + problem), message
    assert "\n" not in message and len(message) < 300 and lines[0].exc_info is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("encoding", ["xz", "gzip, deflate", "compress"])
def test_a_content_encoding_the_server_does_not_decode_is_a_415(server, encoding):
    """aiohttp hands such a body on still encoded; it is refused before it is read, not parsed as JSON."""
    _, got = _send(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Encoding: %s\r\nContent-Length: 2\r\n\r\n{}" % encoding.encode())
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 415") and b"Connection: close" in head
    error = json.loads(body)["error"]
    assert error["param"] == "body" and f"Content-Encoding {encoding!r} is not supported" in error["message"]
    assert http("GET", server.url + "/health")[0] == 200


def test_a_body_that_fails_to_decode_logs_no_error(server, caplog):
    """The handler answers 400; aiohttp's drain of the rest of that body logs one DEBUG line, no traceback."""
    caplog.set_level(logging.DEBUG)
    _, got = _send(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Encoding: gzip\r\nContent-Length: 14\r\n\r\nnot compressed")
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    message = json.loads(body)["error"]["message"]
    assert message.startswith("the request body is not valid 'gzip' data (Can not decode content-encoding: gzip)")
    assert http("GET", server.url + "/health")[0] == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], \
        [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in caplog.records if r.exc_info]

"""Streams whose client is gone when the server writes to it: before the response's headers go out, or
before its last event. Each route's stream ends without an error in the log, and its engine request is
aborted (its KV blocks freed)."""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine  # noqa: E402
from http_json import http  # noqa: E402

from kvforge.server.app import ServerThread, create_app  # noqa: E402

MODEL = FakeEngine.model_name

ROUTES = [
    ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 200, "stream": True}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                              "max_tokens": 200, "stream": True}),
    ("/v1/responses", {"model": MODEL, "input": "hello", "max_output_tokens": 200, "stream": True}),
]


@pytest.fixture
def server():
    engine = FakeEngine(step_delay=0.002)
    with ServerThread(create_app(engine)) as srv:
        yield srv, engine


def post_and_read(url: str, path: str, body: dict) -> bytes:
    """POST ``body`` and read until the server closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    return got


def wait_idle(srv, engine):
    deadline = time.time() + 10
    while srv.async_engine.num_in_flight or engine.has_unfinished_requests() or engine.stats()["kv_blocks_used"]:
        assert time.time() < deadline, (srv.async_engine.num_in_flight, engine.stats())
        time.sleep(0.01)


def errors(caplog) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("path,body", ROUTES, ids=[p for p, _ in ROUTES])
def test_client_gone_before_the_stream_headers(server, monkeypatch, caplog, path, body):
    """The connection closes just as the stream's headers are written (a client that gave up while its
    request was being queued): no error is logged, and the request is aborted."""
    srv, engine = server
    caplog.set_level(logging.ERROR)
    prepare = web.StreamResponse.prepare
    closed = []

    async def prepare_after_close(self, request):
        if self.content_type == "text/event-stream" and not closed:
            closed.append(request.transport)
            request.transport.close()
        return await prepare(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", prepare_after_close)
    assert b"data:" not in post_and_read(srv.url, path, body)
    assert closed
    wait_idle(srv, engine)
    assert not errors(caplog)


@pytest.mark.parametrize("path,body", ROUTES, ids=[p for p, _ in ROUTES])
def test_client_gone_before_the_last_event(server, monkeypatch, caplog, path, body):
    """The connection closes after the stream's last chunk, before its end is written (``data: [DONE]``, or
    the end of the Responses stream after its ``response.completed`` event): no error is logged."""
    srv, engine = server
    caplog.set_level(logging.ERROR)
    write = web.StreamResponse.write
    closed = []

    async def write_after_close(self, data):
        if data.startswith(b"data: [DONE]"):
            closed.append(self)
            self._req.transport.close()
        written = await write(self, data)
        if data.startswith(b"event: response.completed"):
            closed.append(self)
            self._req.transport.close()
        return written

    monkeypatch.setattr(web.StreamResponse, "write", write_after_close)
    body = {**body, "max_tokens": 3} if "max_tokens" in body else {**body, "max_output_tokens": 3}
    got = post_and_read(srv.url, path, body)
    assert closed and b"data:" in got
    wait_idle(srv, engine)
    assert not errors(caplog)


def test_a_queued_request_whose_client_left_frees_its_place():
    """With every run slot taken and the queue full, a queued request whose client leaves gives its place to
    the next request at once, not only after the engine's next steps have run its abort."""
    engine = FakeEngine(step_delay=0.2, max_num_seqs=2)
    with ServerThread(create_app(engine, max_queued_requests=1, shutdown_grace_s=1)) as srv:
        aengine = srv.async_engine
        host, port = srv.url.removeprefix("http://").split(":")

        def open_stream(prompt):
            data = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 100, "stream": True}).encode()
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            return sock

        def wait_in_flight(n):
            deadline = time.time() + 5
            while aengine.num_in_flight != n:
                assert time.time() < deadline, aengine.num_in_flight
                time.sleep(0.005)

        running = [open_stream("first"), open_stream("second")]
        wait_in_flight(2)
        queued = open_stream("third")
        wait_in_flight(3)
        # The queue is full: a fourth request is refused.
        status, _ = http("POST", srv.url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert status == 503
        deadline = time.time() + 5
        while (aengine.last_stats.get("num_running"), aengine.last_stats.get("num_waiting")) != (2, 1):
            assert time.time() < deadline, aengine.last_stats  # an engine step has seen them all
            time.sleep(0.005)
        queued.close()
        wait_in_flight(2)  # its stream is released; the engine has not stepped since
        # Taken (it waits for a run slot): its stream begins with the response's headers.
        taken = open_stream("fourth")
        assert taken.recv(12) == b"HTTP/1.1 200"
        for sock in [*running, taken]:
            sock.close()
        wait_idle(srv, engine)

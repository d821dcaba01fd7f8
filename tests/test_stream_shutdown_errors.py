"""A stream cut by the server's shutdown ends with an error event whose code is ``shutting_down`` on every
route (completions, chat, Responses), as a response refused during shutdown is a 503 ``shutting_down``; the
Responses stream logs no traceback for it."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import aiohttp
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine  # noqa: E402

from kvforge.server.app import ServerThread, create_app  # noqa: E402

BODIES = {
    "/v1/completions": {"prompt": "abc", "max_tokens": 400, "ignore_eos": True, "stream": True},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 400,
                             "ignore_eos": True, "stream": True},
    "/v1/responses": {"input": "abc", "max_output_tokens": 400, "stream": True},
}


def _error_of(text: str) -> dict:
    events = [json.loads(line[len("data: "):]) for line in text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    last = events[-1]
    return last["error"] if "error" in last else last  # the Responses stream's error event is the object itself


@pytest.mark.parametrize("route", list(BODIES))
def test_a_stream_cut_by_shutdown_says_shutting_down(route, caplog):
    srv = ServerThread(create_app(FakeEngine(step_delay=0.02), shutdown_grace_s=0)).start()
    try:
        async def run():
            async with aiohttp.ClientSession() as client:
                async with client.post(srv.url + route, json=BODIES[route]) as resp:
                    assert resp.status == 200
                    chunks = []
                    async for line in resp.content:
                        chunks.append(line.decode())
                        if sum(c.startswith("data:") for c in chunks) == 3:  # the stream runs: shut down now
                            asyncio.run_coroutine_threadsafe(srv.async_engine.shutdown(0), srv.loop)
                    return "".join(chunks)

        with caplog.at_level(logging.ERROR):
            text = asyncio.run(run())
        error = _error_of(text)
        assert error["code"] == "shutting_down", error
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        srv.stop()


@pytest.mark.parametrize("cut_short", [False, True])
def test_the_abort_log_says_what_ended_the_drain(cut_short, caplog):
    srv = ServerThread(create_app(FakeEngine(step_delay=0.02), shutdown_grace_s=0)).start()
    try:
        async def run():
            async with aiohttp.ClientSession() as client:
                async with client.post(srv.url + "/v1/completions", json=BODIES["/v1/completions"]) as resp:
                    started = False
                    async for line in resp.content:  # read to the end: the client stays while the drain runs
                        if line.startswith(b"data:") and not started:  # drain for up to 60 s, or cut it short
                            started = True
                            if cut_short:
                                srv.loop.call_soon_threadsafe(srv.async_engine.end_grace)
                            asyncio.run_coroutine_threadsafe(srv.async_engine.shutdown(60 if cut_short else 0.25),
                                                             srv.loop)

        with caplog.at_level(logging.WARNING, logger="kvforge"):
            asyncio.run(run())
        lines = [r.getMessage() for r in caplog.records if "aborting" in r.getMessage()]
        why = "a second signal ended the drain" if cut_short else "the grace of 0.25 s ran out"
        assert lines == [f"aborting 1 request(s) still running: {why}"], lines
    finally:
        srv.stop()

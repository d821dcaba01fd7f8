"""``GET /metrics`` never waits for the engine: while a step runs on the engine thread (here held by a gate),
a scrape answers with the gauges at the end of the step before it, and the next scrape after the step sees
its result."""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine  # noqa: E402

from kvforge.server.app import ServerThread, create_app  # noqa: E402

WAIT_S = 60  # a bound on each hand-off between threads, never a synchronisation by time


class GatedEngine(FakeEngine):
    """A fake engine whose steps wait for ``gate`` once ``hold`` is set; ``entered`` says one is waiting."""

    def __init__(self):
        super().__init__(max_num_seqs=4)
        self.hold, self.entered, self.gate = threading.Event(), threading.Event(), threading.Event()

    def step(self):
        if self.hold.is_set():
            self.entered.set()
            assert self.gate.wait(WAIT_S)
        return super().step()


def _gauge(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(name + "{") or line.startswith(name + " "))


def test_a_scrape_during_a_step_does_not_wait_for_it():
    engine = GatedEngine()
    srv = ServerThread(create_app(engine)).start()
    try:
        engine.hold.set()
        body = json.dumps({"model": engine.model_name, "prompt": "abc", "max_tokens": 2}).encode()
        request = urllib.request.Request(srv.url + "/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        answer = {}
        client = threading.Thread(target=lambda: answer.update(r=urllib.request.urlopen(request, timeout=WAIT_S).read()))
        client.start()
        assert engine.entered.wait(WAIT_S)  # the request's first step holds the engine thread
        with urllib.request.urlopen(srv.url + "/metrics", timeout=WAIT_S / 4) as r:  # a waiting scrape would time out
            during = r.read().decode()
        assert not engine.gate.is_set()
        # the step before this one ran nothing: the request is not yet in the gauges
        assert _gauge(during, "kvforge:num_requests_running") == 0
        engine.hold.clear()
        engine.gate.set()
        client.join(WAIT_S)
        assert json.loads(answer["r"])["usage"]["completion_tokens"] == 2
        with urllib.request.urlopen(srv.url + "/metrics", timeout=WAIT_S) as r:
            after = r.read().decode()
        assert _gauge(after, "kvforge:num_requests_running") == 0
        assert _gauge(after, "kvforge:generation_tokens_total") == 2
    finally:
        engine.gate.set()
        srv.stop()

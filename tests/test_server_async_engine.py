"""``AsyncEngine`` (kvforge/server/async_engine.py) on the real engine (embedded SmolLM2, CPU): a request's
outputs reach its stream even when the engine loop processes its first step before ``add_requests`` has
resumed on the event loop, and a sample held back for its sample 0's prompt blocks that the engine
refuses fails as an internal error of that request, not as a dead engine."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import smollm2_test_engine  # noqa: E402

from kvforge.engine.sampling_params import SamplingParams  # noqa: E402
from kvforge.errors import InvalidRequestError  # noqa: E402
from kvforge.server.app import ServerThread, create_app  # noqa: E402
from kvforge.server.async_engine import AsyncEngine, EngineDeadError, InternalServerError  # noqa: E402

# Long enough to fill several KV blocks, so later samples have sample 0's prompt blocks to reuse.
PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type "
          "changed how books were made and read across Europe. Printers set each page by hand, letter by "
          "letter, and a single shop could produce more books in a month than a monastery copied in a "
          "lifetime.")
WAIT_S = 120  # a bound on each hand-off between the threads below, never a synchronisation by time


@pytest.fixture(scope="module")
def engine():
    engine = smollm2_test_engine(max_model_len=256, max_num_seqs=8)
    yield engine
    engine.shutdown()


async def _drain(stream) -> list:
    outs = []
    async for out in stream:
        outs.append(out)
    return outs


async def _add_with_its_first_step_processed_first(ae: AsyncEngine, prompts, samples, **kw):
    """``ae.add_requests(prompts, samples, **kw)``, interleaved with the engine loop so that the loop's next
    step runs on the engine thread right after the add, and the loop processes that step's outputs (the
    new requests' first) before ``add_requests`` resumes. No sleeps: the threads hand off through events.

    * The engine loop's next ``_iterate`` is submitted to the engine thread behind the add (the add waits
      for that submission).
    * Once the requests are added, the engine thread posts ``block`` to the event loop: it keeps the loop
      busy (as a handler's synchronous work would) until that step's result is posted to the loop, after
      the add's. ``block`` hooks the step's future before the step may start, behind asyncio's own hook,
      so the step's result is on the loop's queue when ``block`` returns.
    * The loop then takes both results in order; ``add_requests`` resumes a few callbacks later than the
      engine loop, which so processes the step first."""
    loop = asyncio.get_running_loop()
    executor = ae._executor
    orig_submit, orig_iterate, orig_prepare = executor.submit, ae._iterate, ae._prepare_and_add
    state = {"watch": False, "step": None, "hold": False}
    step_queued, registered, delivered = threading.Event(), threading.Event(), threading.Event()

    def submit(fn, *args, **kwargs):
        fut = orig_submit(fn, *args, **kwargs)
        if fn is iterate and state["watch"] and state["step"] is None:
            state["step"] = fut
            step_queued.set()
        return fut

    def iterate(aborts):  # engine thread
        if state["hold"]:
            state["hold"] = False
            assert registered.wait(WAIT_S)
        return orig_iterate(aborts)

    def prepare(*args):  # engine thread
        assert step_queued.wait(WAIT_S), "the engine loop queued no step behind the add"
        result = orig_prepare(*args)
        state["hold"] = True
        loop.call_soon_threadsafe(block)
        return result

    def block():  # event loop
        state["step"].add_done_callback(lambda _: delivered.set())
        registered.set()
        delivered.wait(WAIT_S)

    executor.submit, ae._iterate, ae._prepare_and_add = submit, iterate, prepare
    try:
        state["watch"] = True  # the engine loop is waiting for a step: its next one is submitted after the add
        streams = await ae.add_requests(prompts, samples, **kw)
    finally:
        del executor.submit, ae._iterate, ae._prepare_and_add
    assert delivered.is_set(), "the interleaving did not happen"
    return streams


@pytest.mark.parametrize("case", ["echo_max_tokens_0", "max_tokens_1", "max_tokens_3"])
def test_outputs_of_a_step_processed_before_the_add_resumes_reach_the_stream(engine, case):
    """A request that finishes in its first step (echo with max_tokens 0, any max_tokens 1) gets its one
    finished output, and a longer one each step in its own output, when the engine loop processes that
    first step before ``add_requests`` has resumed: its streams were registered before the add reached the
    engine thread, so no output arrives for a request the loop does not know."""
    prompt_only = case == "echo_max_tokens_0"
    max_tokens = 3 if case == "max_tokens_3" else 1
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1,
                            prompt_logprobs=1 if prompt_only else None, ignore_eos=True)

    async def run():
        ae = AsyncEngine(engine)
        await ae.start()
        # A long request keeps the engine loop stepping.
        (bg,) = await ae.add_requests(["Once upon a time"], [SamplingParams(max_tokens=200, temperature=0.0,
                                                                           ignore_eos=True)])
        await bg.__anext__()
        try:
            (stream,) = await _add_with_its_first_step_processed_first(ae, [[100, 200, 300, 400]], [params],
                                                                       prompt_only=prompt_only)
            try:
                outs = await asyncio.wait_for(_drain(stream), WAIT_S)
            finally:
                stream.close()
            assert ae.healthy and not bg.finished
            return outs
        finally:
            bg.close()
            await ae.shutdown(0)

    outs = asyncio.run(run())
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    if prompt_only:
        (out,) = outs
        assert list(out.prompt_token_ids) == [100, 200, 300, 400] and out.outputs[0].token_ids == []
        assert len(out.prompt_logprobs) == 4 and out.prompt_logprobs[0] is None
        assert all(lp is not None for lp in out.prompt_logprobs[1:])
    else:
        # One step, one token, one output each: the first step was not merged into the second.
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, max_tokens + 1))


def _held_back_samples(engine, max_tokens: int) -> list[SamplingParams]:
    base = SamplingParams(n=2, max_tokens=max_tokens, temperature=1.0, seed=7, ignore_eos=True)
    return [base.sample_params(j) for j in range(2)]


def _refusing_the_second_add(engine):
    """Patch ``engine.add_request`` to refuse its second call (the held-back sample 1); returns the undo."""
    calls = []
    orig = engine.add_request

    def add_request(request_id, prompt, params=None):
        calls.append(request_id)
        if len(calls) == 2:
            raise InvalidRequestError("refused for the test", field="prompt")
        return orig(request_id, prompt, params)

    engine.add_request = add_request
    return calls, lambda: delattr(engine, "add_request")


def test_a_refused_held_back_sample_is_an_internal_error_of_its_request(engine):
    """Sample 1 of a long prompt waits for sample 0's prompt blocks; should the engine refuse it then, that
    sample fails with InternalServerError (not EngineDeadError), sample 0 streams to its end and the engine
    loop runs on."""
    assert len(engine.tokenizer.encode(PROMPT)) > engine.block_manager.block_size

    async def run():
        ae = AsyncEngine(engine)
        await ae.start()
        try:
            calls, undo = _refusing_the_second_add(engine)
            try:
                s0, s1 = await ae.add_requests([PROMPT], _held_back_samples(engine, 3))
                assert len(calls) == 1, "sample 1 should wait for sample 0's prompt"
                outs = await asyncio.wait_for(_drain(s0), WAIT_S)
                with pytest.raises(InternalServerError, match="internal error") as exc:
                    await asyncio.wait_for(_drain(s1), WAIT_S)
                assert not isinstance(exc.value, EngineDeadError) and len(calls) == 2
            finally:
                undo()
            s0.close()
            s1.close()
            assert ae.healthy and len(outs[-1].outputs[0].token_ids) == 3
            (again,) = await ae.add_requests([PROMPT], [SamplingParams(max_tokens=2, temperature=0.0)])
            assert len((await _drain(again))[-1].outputs[0].token_ids) == 2
        finally:
            await ae.shutdown(0)

    asyncio.run(run())


def test_samples_that_differ_beyond_their_seed_are_added_at_once(engine):
    """Only samples the engine must take once it took sample 0 (the same parameters but the seed) wait for
    sample 0's prompt blocks; others are added with sample 0, so the engine checks them before the request
    is accepted."""

    async def run():
        ae = AsyncEngine(engine)
        await ae.start()
        try:
            samples = [SamplingParams(max_tokens=2, temperature=0.0), SamplingParams(max_tokens=4, temperature=0.0)]
            streams = await ae.add_requests([PROMPT], samples)
            assert not ae._later and not ae._leader_of
            return [len((await _drain(s))[-1].outputs[0].token_ids) for s in streams]
        finally:
            await ae.shutdown(0)

    assert asyncio.run(run()) == [2, 4]


def test_a_refused_held_back_sample_over_http_is_500_internal_error(engine):
    """Over HTTP the refused sample is a 500 ``internal_error`` (streamed: an error event of the same type and
    code), not ``engine_dead``; the server stays healthy."""
    srv = ServerThread(create_app(engine)).start()
    body = {"model": engine.model_name, "prompt": PROMPT, "n": 2, "max_tokens": 3, "temperature": 1.0,
            "seed": 7, "ignore_eos": True}

    def post(extra: dict):
        req = urllib.request.Request(srv.url + "/v1/completions", method="POST",
                                     data=json.dumps({**body, **extra}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=WAIT_S) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    try:
        _, undo = _refusing_the_second_add(engine)
        try:
            status, text = post({})
        finally:
            undo()
        err = json.loads(text)["error"]
        assert status == 500 and err["code"] == "internal_error" and err["type"] == "server_error"
        assert "internal error" in err["message"]

        _, undo = _refusing_the_second_add(engine)
        try:
            status, text = post({"stream": True})
        finally:
            undo()
        events = [json.loads(line[len("data: "):]) for line in text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert status == 200 and text.rstrip().endswith("data: [DONE]")
        assert events[-1]["error"]["code"] == "internal_error" and events[-1]["error"]["type"] == "server_error"

        with urllib.request.urlopen(srv.url + "/health", timeout=WAIT_S) as r:
            assert r.status == 200
        status, text = post({"n": 1})
        assert status == 200 and len(json.loads(text)["choices"]) == 1
    finally:
        srv.stop()

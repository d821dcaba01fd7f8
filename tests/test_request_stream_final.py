"""``RequestStream.final_output`` (kvforge/server/async_engine.py) wakes a non-streaming consumer once, for the
request's last output, where ``async for`` wakes it at every step; an error still reaches it."""

from __future__ import annotations

import asyncio

import pytest

from kvforge.engine.outputs import CompletionOutput, RequestOutput
from kvforge.server.async_engine import RequestStream


class _Owner:
    def _release(self, stream):
        pass


def _out(n: int, finished: bool) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, "x" * n, list(range(n)),
                                                           "length" if finished else None)], finished)


async def _feed(stream, steps: int, wakes: list) -> None:
    for n in range(1, steps + 1):
        stream._push(_out(n, n == steps))
        wakes.append(stream._event.is_set())
        await asyncio.sleep(0)  # the consumer may run between two steps, as between two engine steps


async def _consume(final_only: bool, steps: int):
    stream, wakes = RequestStream(_Owner(), "r", 1), []
    if final_only:
        consumer = asyncio.ensure_future(stream.final_output())
    else:
        async def each():
            return [out async for out in stream]
        consumer = asyncio.ensure_future(each())
    await asyncio.sleep(0)
    await _feed(stream, steps, wakes)
    return await consumer, sum(wakes)


def test_a_final_only_consumer_wakes_once_for_the_last_output():
    final, wakes = asyncio.run(_consume(True, 6))
    assert final.finished and final.outputs[0].token_ids == list(range(6))
    assert wakes == 1
    outs, wakes = asyncio.run(_consume(False, 6))
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5, 6] and wakes == 6


def test_a_final_output_pushed_before_the_wait_and_an_error_reach_the_consumer():
    async def run():
        stream = RequestStream(_Owner(), "r", 1)
        stream._push(_out(2, False))
        stream._push(_out(3, True))
        assert (await stream.final_output()).outputs[0].text == "xxx"
        assert (await stream.final_output()).outputs[0].text == "xxx"  # again: the same final
        failing = RequestStream(_Owner(), "s", 1)
        task = asyncio.ensure_future(failing.final_output())
        await asyncio.sleep(0)
        failing._push(_out(1, False))
        failing._fail(RuntimeError("engine refused it"))
        with pytest.raises(RuntimeError, match="engine refused it"):
            await task

    asyncio.run(run())

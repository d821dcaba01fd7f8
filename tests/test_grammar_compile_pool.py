"""Output constraints compile in a bounded pool beside the engine: at most ``GRAMMAR_COMPILE_THREADS`` at once,
and a constraint whose client left while it waited is never compiled. A slow stand-in compiler counts what
runs at once."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine  # noqa: E402

import kvforge.server.async_engine as async_engine  # noqa: E402

COMPILE_S = 0.3


class SlowCompiler:
    """``compile(constraint)`` sleeps, recording the most compiles seen running at once and each one run."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = self.most = 0
        self.compiled: list[str] = []

    def compile(self, constraint):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(COMPILE_S)
        with self.lock:
            self.running -= 1
            self.compiled.append(constraint)


class EngineWithGrammars(FakeEngine):
    def __init__(self, compiler: SlowCompiler):
        super().__init__()
        self.compiler = compiler

    def grammar_backend(self):
        return self.compiler


@pytest.mark.parametrize("threads", [1, 2])
def test_compiles_run_at_most_the_pool_size_at_once_and_departed_ones_never(monkeypatch, threads):
    monkeypatch.setattr(async_engine, "GRAMMAR_COMPILE_THREADS", threads)
    compiler = SlowCompiler()

    async def scenario():
        aengine = async_engine.AsyncEngine(EngineWithGrammars(compiler))
        await aengine.start()
        try:
            kept = [asyncio.create_task(aengine.check_constraint(f"kept-{i}")) for i in range(2 * threads)]
            left = [asyncio.create_task(aengine.check_constraint(f"left-{i}")) for i in range(3)]
            await asyncio.sleep(COMPILE_S / 3)  # the first compiles run; the clients behind them leave
            for task in left:
                task.cancel()
            t0 = time.monotonic()
            await asyncio.gather(*kept)
            return time.monotonic() - t0
        finally:
            await aengine.shutdown(grace_s=0)

    waited = asyncio.run(scenario())
    assert compiler.most == threads
    assert sorted(compiler.compiled) == sorted(f"kept-{i}" for i in range(2 * threads))
    assert waited >= COMPILE_S  # two rounds of the pool: the second started after the first ended


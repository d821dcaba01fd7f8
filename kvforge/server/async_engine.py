"""An asyncio front for the synchronous ``LLMEngine``.

One background task drives ``engine.step()`` whenever requests are pending.
Every engine call (tokenization, ``add_request``, ``abort_request``,
``step``, ``stats``) runs on a single worker thread, so the engine is never
touched from two threads at once and the event loop never blocks on compute.

Each request gets a ``RequestStream``: the loop publishes the latest
(cumulative) ``RequestOutput`` to it, so a slow reader never makes outputs pile
up; a reader that goes away closes the stream, which aborts the request and
frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling_params import SamplingParams
from kvforge.errors import InvalidRequestError
from kvforge.server.metrics import ServerMetrics
from kvforge.server.tokenization import NO_TOKENIZER, ChatTemplateOptions, chat_prompt_ids

logger = logging.getLogger("kvforge.server")


class QueueFullError(Exception):
    """Too many requests are waiting; the client should retry later (HTTP 503)."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class ServerShuttingDownError(Exception):
    """The server is draining and takes no new requests (HTTP 503)."""


class EngineDeadError(Exception):
    """The engine raised while stepping; requests in flight fail (HTTP 500)."""


class RequestStream:
    """The consumer side of one request: ``async for out in stream`` then ``close()``."""

    def __init__(self, owner: AsyncEngine, request_id: str, prompt_tokens: int):
        self._owner = owner
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens = 0
        self.finished = False
        self.final: RequestOutput | None = None
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self._closed = False

    # producer side (event loop thread) --------------------------------------

    def _push(self, out: RequestOutput) -> None:
        self._latest = out
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    # consumer side ------------------------------------------------------------

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._event.wait()
        self._event.clear()
        if self._error is not None:
            self.finished = True
            raise self._error
        out = self._latest
        if out.finished:
            self.finished = True
            self.final = out
        return out

    async def wait_output(self) -> None:
        """Wait until the request has an output (its prompt is computed) or has failed; consumes nothing."""
        if not self.finished:
            await self._event.wait()

    def close(self) -> None:
        """Release the request; aborts it in the engine unless it finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._owner._release(self)


class AsyncEngine:
    def __init__(self, engine, max_queued_requests: int = 1024, metrics: ServerMetrics | None = None):
        if max_queued_requests < 1:
            raise ValueError("max_queued_requests must be >= 1")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics or ServerMetrics()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvforge-engine")
        self._ids = itertools.count()
        self._streams: dict[str, RequestStream] = {}  # added to the engine, not yet finished/closed
        self._adding = 0  # add_request calls in flight
        self._added_since_stats = 0
        self._pending_aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._accepting = True
        self._dead: BaseException | None = None
        self.last_stats: dict = {}
        # The engine's record of recent steps (kvforge/engine/step_log.py); engines without one have none.
        self.step_log = getattr(engine, "step_log", None)
        self._steps_seen = self.step_log.total if self.step_log is not None else 0  # steps the metrics have seen
        self._executor_closed = False
        self.started = time.time()

    # -- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        self._wakeup = asyncio.Event()
        self.last_stats = await self._call(self.engine.stats)
        self._task = asyncio.create_task(self._run(), name="kvforge-engine-loop")

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + self._adding

    @property
    def prefix_block_size(self) -> int | None:
        """Tokens per KV block when a request whose prompt repeats a computed one reuses its full blocks
        (prefix caching on); None when nothing is reused."""
        blocks = getattr(self.engine, "block_manager", None)
        return blocks.block_size if getattr(blocks, "enable_prefix_caching", False) else None

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._task is not None and not self._task.done()

    @property
    def accepting(self) -> bool:
        return self._accepting

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to grace_s, abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        leftover = list(self._streams.values())
        if leftover:
            logger.warning("aborting %d request(s) still running after %.0fs", len(leftover), grace_s)
        for s in leftover:
            s._fail(ServerShuttingDownError("the server is shutting down; the request was aborted"))
            self._release(s)
        # Let handlers see the abort and the loop process it.
        for _ in range(100):
            if not self._pending_aborts and not self._streams:
                break
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._pending_aborts:
            aborts, self._pending_aborts = self._pending_aborts, []
            await self._call(self._do_aborts, aborts)
        self._executor_closed = True
        self._executor.shutdown(wait=True)

    # -- requests -----------------------------------------------------------------

    def admit(self, sequences: int) -> None:
        """The queue bound, for one client request of ``sequences`` engine requests (prompts x n), checked once
        for all of them: refused with 503 while the queue could not take them all, unless it is empty (a
        request never waits on itself); a request of more sequences than the bound can never be taken
        and is a 400 naming ``n``. The queue counts the engine's waiting requests at its last step and
        every request added since (they may be running already: the bound errs towards refusing)."""
        limit = self.max_queued_requests
        if sequences > limit:
            raise InvalidRequestError(
                f"'n': this request asks for {sequences} sequences (prompts x n), more than the server queues at "
                f"once (--max-queued-requests {limit}); send fewer prompts or a smaller n", field="n")
        queued = self.last_stats.get("num_waiting", 0) + self._added_since_stats + self._adding
        if queued and queued + sequences > limit:
            raise QueueFullError(f"too many queued requests ({queued} waiting, limit {limit}, this request "
                                 f"{sequences}); retry later")

    async def add_request(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams,
        *,
        messages: list[dict] | None = None,
        max_tokens_explicit: bool = True,
        max_tokens_field: str = "max_tokens",
        chat_options: ChatTemplateOptions | None = None,
        admitted: bool = False,
    ) -> RequestStream:
        """Validate and queue one request; returns its stream. ``admitted``: :meth:`admit` already took it
        in with the other sequences of its HTTP request (the queue bound is not checked again).

        ``messages`` (chat) are rendered with the tokenizer's chat template.
        ``params.max_tokens`` None means the rest of the context; a limit the
        client did not set explicitly is clamped to the context instead of
        refused. Raises InvalidRequestError, QueueFullError,
        ServerShuttingDownError or EngineDeadError.
        """
        if not self._accepting:
            raise ServerShuttingDownError("the server is shutting down")
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed: {self._dead!r}")
        if not admitted:
            self.admit(1)
        request_id = f"req-{next(self._ids)}"
        self._adding += 1
        fut = asyncio.get_running_loop().run_in_executor(
            self._executor, self._prepare_and_add, request_id, prompt, messages, params, max_tokens_explicit,
            max_tokens_field, chat_options,
        )
        try:
            prompt_tokens = await asyncio.shield(fut)
        except asyncio.CancelledError:
            # The client left while the request was being added: undo it once it lands.
            fut.add_done_callback(lambda f: f.exception() is None and self._schedule_abort(request_id))
            raise
        finally:
            self._adding -= 1
        self._added_since_stats += 1
        stream = RequestStream(self, request_id, prompt_tokens)
        self._streams[request_id] = stream
        self._wakeup.set()
        return stream

    def _prepare_and_add(self, request_id, prompt, messages, params, max_tokens_explicit, max_tokens_field,
                         chat_options=None) -> int:
        """Runs on the engine thread: render, count, check lengths, add."""
        tok = self.engine.tokenizer
        max_len = self.engine.max_model_len
        prompt_field = "prompt"
        if tok is None and (messages is not None or isinstance(prompt, str)):
            raise InvalidRequestError(NO_TOKENIZER, field="messages" if messages is not None else "prompt")
        if messages is not None:
            prompt_field = "messages"
            prompt = chat_prompt_ids(tok, messages, chat_options)
        elif isinstance(prompt, str):
            prompt = tok.encode(prompt)  # tokenize once; the engine gets the ids
        n = len(prompt)
        if n >= max_len:
            raise InvalidRequestError(
                f"'{prompt_field}': the prompt has {n} tokens, which leaves no room for output within this "
                f"model's maximum context length (--max-model-len) of {max_len} tokens; shorten the prompt to at "
                f"most {max_len - 1} tokens",
                field=prompt_field,
            )
        room = max_len - n
        if params.max_tokens is None or (params.max_tokens > room and not max_tokens_explicit):
            params = dataclasses.replace(params, max_tokens=room)
        elif params.max_tokens > room:
            raise InvalidRequestError(
                f"'{max_tokens_field}': the prompt has {n} tokens and {params.max_tokens} were requested, "
                f"but the maximum context length is {max_len} tokens; ask for at most {room}",
                field=max_tokens_field,
            )
        self.engine.add_request(request_id, prompt, params)
        return n

    def _release(self, stream: RequestStream) -> None:
        if self._streams.pop(stream.request_id, None) is None:
            return
        if not stream.finished or stream.final is None:
            self._schedule_abort(stream.request_id)
            self.metrics.on_abort(stream)

    def _schedule_abort(self, request_id: str) -> None:
        self._pending_aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    # -- the loop -----------------------------------------------------------------

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _do_aborts(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort_request(rid)

    def _iterate(self, aborts: list[str]):
        self._do_aborts(aborts)
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        steps = []
        if self.step_log is not None:
            steps = self.step_log.since(self._steps_seen)
            self._steps_seen = self.step_log.total
        return outputs, steps, self.engine.has_unfinished_requests(), self.engine.stats()

    async def stats(self) -> dict:
        """Fresh engine stats (waits for the current step, if any)."""
        if self._executor_closed:  # after shutdown, serve the last snapshot
            return self.last_stats
        self.last_stats = await self._call(self.engine.stats)
        return self.last_stats

    async def _run(self) -> None:
        while True:
            if not self._streams and not self._pending_aborts:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            aborts, self._pending_aborts = self._pending_aborts, []
            active = set(self._streams)
            try:
                outputs, steps, unfinished, stats = await self._call(self._iterate, aborts)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.exception("engine step failed; failing %d request(s)", len(self._streams))
                self._dead = e
                for s in list(self._streams.values()):
                    s._fail(EngineDeadError(f"the engine failed: {e!r}"))
                return
            self.last_stats = stats
            self._added_since_stats = 0
            self.metrics.on_steps(steps)
            now = time.monotonic()
            seen = set()
            for out in outputs:
                seen.add(out.request_id)
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # closed by its reader; the abort is queued
                self.metrics.on_output(stream, out, now)
                if out.finished:
                    del self._streams[out.request_id]
                    self.metrics.on_finish(stream, out, now)
                stream._push(out)
            if not unfinished:
                # Anything we still track that the engine no longer knows would hang forever.
                for rid in active - seen:
                    stream = self._streams.pop(rid, None)
                    if stream is not None:
                        stream._fail(EngineDeadError(f"the engine dropped request {rid}"))
            # Give handlers a turn to write what they got before the next (blocking) step.
            await asyncio.sleep(0)

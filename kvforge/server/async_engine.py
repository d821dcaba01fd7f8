"""An asyncio front for the synchronous ``LLMEngine``.

One background task drives ``engine.step()`` whenever requests are pending.
Every engine call (tokenization, ``add_request``, ``abort_request``,
``step``, ``stats``) runs on a single worker thread, so the engine is never
touched from two threads at once and the event loop never blocks on compute.

Each request gets a ``RequestStream``: the loop publishes the latest
(cumulative) ``RequestOutput`` to it, so a slow reader never makes outputs pile
up; a reader that goes away closes the stream, which aborts the request and
frees its KV blocks.

A request's streams are registered on the event loop before its add is handed
to the engine thread, so every output of every step that includes the request
reaches its stream, whenever the caller of ``add_requests`` resumes; an output
whose stream is missing belongs to a stream that was registered and then
released (closed by its reader, or failed by a shutdown). A failed add
unregisters its streams, and nothing of it is left in the engine.

The engine requests of one client request (its prompts times ``n``) are added
in one call on the engine thread, so no engine step runs between them; a
sample that is to reuse sample 0's prompt blocks is added on the engine thread
right after the step that computed that prompt, before the next step. A reader
that starts on its streams once they are returned so sees each of them from
its first step: a reader that keeps up gets one step per output, and one that
falls behind (a busy event loop) gets the latest output, which holds the steps
it missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from kvforge.engine.outputs import CompletionOutput, RequestOutput
from kvforge.engine.prompt_ids import check_prompt_token_ids, truncate_prompt
from kvforge.engine.sampling_params import SamplingParams
from kvforge.errors import InvalidRequestError
from kvforge.server.metrics import ServerMetrics
from kvforge.server.tokenization import ChatTemplateOptions, chat_prompt_ids, no_tokenizer

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


class InternalServerError(Exception):
    """One request failed on something that should not happen (a bug) while the engine runs on: HTTP 500
    ``internal_error``, not ``engine_dead``."""


#: How a failure on the engine's side of an accepted request is answered: HTTP status, OpenAI error type and
#: code. A stream that has begun sends the type and code in its error event (every route's).
SERVER_FAILURES: dict[type, tuple[int, str, str]] = {
    ServerShuttingDownError: (503, "server_overloaded", "shutting_down"),
    EngineDeadError: (500, "server_error", "engine_dead"),
    InternalServerError: (500, "server_error", "internal_error"),
}


class RequestStream:
    """The consumer side of one request: ``async for out in stream`` then ``close()``."""

    def __init__(self, owner: AsyncEngine, request_id: str, prompt_tokens: int, prompt_only: bool = False,
                 scored_token: int | None = None):
        self._owner = owner
        self.request_id = request_id
        # prompt_tokens and scored_token are set on the engine thread before the request is added
        # (AsyncEngine._prepare_and_add), so they are known before its first output.
        self.prompt_tokens = prompt_tokens
        # A prompt-only request (echo with max_tokens 0) generates nothing: its outputs show the prompt alone.
        # scored_token: its last prompt token, which the engine scores as its one sampled token
        # (AsyncEngine._prompt_only); None when the engine has the whole prompt.
        self.prompt_only = prompt_only
        self.scored_token = scored_token
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens = 0
        self.finished = False
        self.final: RequestOutput | None = None
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self._final_only = False  # final_output(): wake the consumer for the last output only
        self._closed = False
        self._added = False  # its add_requests call returned it: the engine had it before any later step

    # producer side (event loop thread) --------------------------------------

    def _push(self, out: RequestOutput) -> None:
        self._latest = out
        if out.finished or not self._final_only:
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

    async def final_output(self) -> RequestOutput:
        """The request's last output (finished), waking once for it where ``async for`` wakes every step; raises
        what the engine raised for it. Outputs before it are skipped, as a non-streaming response needs."""
        self._final_only = True
        while not self.finished:
            await self.__anext__()
        return self.final

    def close(self) -> None:
        """Release the request; aborts it in the engine unless it finished. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._owner._release(self)


#: Threads that compile requests' output constraints (half the cores, at least one, as vLLM sizes its pool):
#: grammars compile at most this many at once beside the engine's steps, and a constraint still queued when
#: its client leaves is never compiled.
GRAMMAR_COMPILE_THREADS = max(1, ((os.cpu_count() or 1) + 1) // 2)


class AsyncEngine:
    def __init__(self, engine, max_queued_requests: int = 1024, metrics: ServerMetrics | None = None):
        if max_queued_requests < 1:
            raise ValueError("max_queued_requests must be >= 1")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics or ServerMetrics()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvforge-engine")
        self._compile_pool = ThreadPoolExecutor(max_workers=GRAMMAR_COMPILE_THREADS,
                                                thread_name_prefix="kvforge-grammar")
        self._ids = itertools.count()
        # Registered before their add goes to the engine thread; removed when finished, closed or failed.
        self._streams: dict[str, RequestStream] = {}
        self._adding = 0  # engine requests whose add_requests call is in flight
        self._added_since_stats = 0
        self._pending_aborts: list[str] = []
        # Aborted requests the engine may still count in last_stats: those pending and those of the step running.
        self._aborts_unseen = 0
        # Engine thread only: samples to add once their sample 0 (the key) has an output, and the reverse map.
        self._later: dict[str, list[tuple[str, list[int], SamplingParams, int]]] = {}
        self._leader_of: dict[str, str] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._accepting = True
        self._grace_ended = False  # end_grace(): a second signal aborts what the drain still waits for
        self._dead: BaseException | None = None
        self.last_stats: dict = {}
        self._stepping = False  # a step runs on the engine thread
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
        return len(self._streams)

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

    async def wait_until_dead(self) -> BaseException | None:
        """Wait for the engine loop to end: the step's exception where the engine failed (its requests are
        failed with ``engine_dead``), None where :meth:`shutdown` stopped it."""
        if self._task is not None:
            await asyncio.wait({self._task})
        return self._dead

    def end_grace(self) -> None:
        """Cut :meth:`shutdown`'s grace short: the requests still in flight are aborted now."""
        self._grace_ended = True

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to grace_s (or until :meth:`end_grace`),
        abort the rest. A second call finds nothing left to do."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self.num_in_flight and not self._grace_ended and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        leftover = list(self._streams.values())
        if leftover:
            why = ("a second signal ended the drain" if self._grace_ended
                   else f"the grace of {grace_s:g} s ran out")
            logger.warning("aborting %d request(s) still running: %s", len(leftover), why)
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
        self._compile_pool.shutdown(wait=False, cancel_futures=True)  # a compile running keeps its thread
        self._executor.shutdown(wait=True)

    # -- requests -----------------------------------------------------------------

    def admit(self, sequences: int, n: int = 1) -> None:
        """The queue bound, for one client request of ``sequences`` engine requests (prompts x n), checked once
        for all of them. The server holds the engine's run slots (``max_num_seqs``) plus
        ``max_queued_requests`` waiting beyond them: a request is refused with 503 while the sequences it
        would leave waiting beyond the run slots exceed the bound, unless nothing is held (a request never
        waits on itself); a request of more sequences than slots and bound together can never be taken and
        is a 400 naming ``n`` (``prompt`` where n is 1: the prompts alone are too many). The count is the engine's running and waiting requests at its last step plus
        every request added since (some may have finished: the bound errs towards refusing), less the requests
        whose client left since (their aborts run before the next step), so a request that left frees its place
        at once."""
        limit, slots = self.max_queued_requests, self.engine.max_num_seqs
        if sequences > limit + slots:
            field = "n" if n > 1 else "prompt"
            raise InvalidRequestError(
                f"'{field}': this request asks for {sequences} sequences (prompts x n), more than the server holds "
                f"at once (--max-num-seqs {slots} running and --max-queued-requests {limit} queued); send fewer "
                f"prompts{' or a smaller n' if n > 1 else ''}", field=field)
        held = max(0, self.last_stats.get("num_running", 0) + self.last_stats.get("num_waiting", 0)
                   + self._added_since_stats + self._adding - self._aborts_unseen)
        if held and max(0, held + sequences - slots) > limit:
            raise QueueFullError(f"too many queued requests ({max(0, held - slots)} waiting beyond the {slots} "
                                 f"running, limit {limit}, this request {sequences}); retry later")

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
        """Validate and queue one request; returns its stream (:meth:`add_requests` with one prompt and one
        sample)."""
        (stream,) = await self.add_requests([prompt], [params], messages=messages,
                                            max_tokens_explicit=max_tokens_explicit,
                                            max_tokens_field=max_tokens_field, chat_options=chat_options,
                                            admitted=admitted)
        return stream

    async def check_constraint(self, constraint, field: str | None = None) -> None:
        """Compile a request's output constraint off the engine thread: one the compiler refuses is an
        InvalidRequestError naming ``field`` (the request's own spelling) before anything is queued, and the
        engine then takes the grammar from the compiler's cache instead of compiling between steps."""
        if constraint is None or not hasattr(self.engine, "grammar_backend"):
            return
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._compile_pool, lambda: self.engine.grammar_backend().compile(constraint))
        except InvalidRequestError as e:
            if field is None or e.field == field or not (e.field or "").startswith("structured_outputs"):
                raise
            raise InvalidRequestError(str(e).replace(e.field, field, 1), field=field) from None

    async def add_requests(
        self,
        prompts: list[str | list[int] | None],
        samples: list[SamplingParams],
        *,
        messages: list[dict] | None = None,
        max_tokens_explicit: bool = True,
        max_tokens_field: str = "max_tokens",
        chat_options: ChatTemplateOptions | None = None,
        prompt_only: bool = False,
        admitted: bool = False,
        priority: int = 0,
    ) -> list[RequestStream]:
        """Validate and queue one engine request per prompt and sample (``samples[j]``: the parameters of
        sample ``j``); returns their streams in order prompt position * ``len(samples)`` + sample number.
        ``admitted``: :meth:`admit` already took them in (the queue bound is not checked again). ``priority``:
        the requests' order under ``--scheduling-policy priority`` (lower first; 0 under fcfs).

        Every prompt is checked before any request is added, and all are added in one call on the engine
        thread, so no engine step runs between them: a step in between would give the requests added first
        tokens before their readers start (once this returns), which would then arrive together. With prefix
        caching on, the samples other than 0 of a prompt longer than one KV block are added on the engine
        thread right after the step that computed sample 0's prompt (before the next step), so they reuse
        its full blocks instead of computing the prompt again, and sample 0 streams meanwhile.

        ``messages`` (chat) are rendered with the tokenizer's chat template (``prompts`` is then ``[None]``).
        A ``max_tokens`` of None means the rest of the context; a limit the client did not set explicitly is
        clamped to the context instead of refused. ``prompt_only`` (echo with max_tokens 0): nothing is
        generated, so a prompt may fill the context. With several prompts an error names the prompt's place
        (``prompt[i]``). Raises InvalidRequestError, QueueFullError, ServerShuttingDownError or
        EngineDeadError.
        """
        if not self._accepting:
            raise ServerShuttingDownError("the server is shutting down")
        if self._dead is not None:
            raise EngineDeadError(f"the engine failed: {self._dead!r}")
        count = len(prompts) * len(samples)
        if not admitted:
            self.admit(count, len(samples))
        # The streams exist before the engine can run a step with their requests: _run finds every output.
        streams = [RequestStream(self, f"req-{next(self._ids)}", 0, prompt_only) for _ in range(count)]
        for stream in streams:
            self._streams[stream.request_id] = stream
        self._adding += count
        self._wakeup.set()
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self._prepare_and_add, streams, prompts, samples, messages, max_tokens_explicit,
                max_tokens_field, chat_options, prompt_only, priority,
            )
        except asyncio.CancelledError:
            # The client left while its requests were being added: abort them (after the add, if it runs:
            # the engine thread takes the aborts in order).
            for stream in streams:
                stream.close()
            self._aborts_unseen -= count  # not in the engine's stats, nor counted as being added any more
            raise
        except BaseException:
            # Refused: the engine thread added none of them (or aborted those it had added) before any step.
            for stream in streams:
                stream._closed = True
                self._streams.pop(stream.request_id, None)
            raise
        finally:
            self._adding -= count
        self._added_since_stats += count
        for stream in streams:
            stream._added = True
        return streams

    def _prepare_and_add(self, streams, prompts, samples, messages, max_tokens_explicit, max_tokens_field,
                         chat_options, prompt_only, priority) -> None:
        """Runs on the engine thread: render, count and check every prompt, then add the requests. Before the
        first add, each stream gets its prompt's token count and, for a prompt-only request, the prompt token
        scored as the engine's sampled token (see :meth:`_prompt_only`). Raises with nothing added."""
        n = len(samples)
        request_ids = [s.request_id for s in streams]
        prepared = []
        for i, prompt in enumerate(prompts):
            with _naming_prompt(i, len(prompts)):
                prepared.append(self._prepare(prompt, messages, samples, max_tokens_explicit, max_tokens_field,
                                              chat_options, prompt_only))
        for k, stream in enumerate(streams):
            _, stream.prompt_tokens, stream.scored_token, _ = prepared[k // n]
        block = self.prefix_block_size
        added: list[str] = []
        later: dict[str, list[tuple[str, list[int], SamplingParams, int]]] = {}
        try:
            for i, (ids, _, _, params) in enumerate(prepared):
                with _naming_prompt(i, len(prompts)):
                    self.engine.add_request(request_ids[i * n], ids, params[0], **_ranked(priority))
                added.append(request_ids[i * n])
            for i, (ids, _, _, params) in enumerate(prepared):
                followers = [(request_ids[i * n + j], ids, params[j], priority) for j in range(1, n)]
                # A sample reuses the full blocks before the prompt's last token (computed anew); a request
                # with prompt logprobs computes its whole prompt, reusing nothing. Only samples that differ
                # from sample 0 in their seed alone wait: the engine took sample 0, so it takes them too.
                if (followers and block is not None and len(ids) > block and params[0].prompt_logprobs is None
                        and all(_same_but_seed(p, params[0]) for _, _, p, _ in followers)):
                    later[request_ids[i * n]] = followers
                    continue
                for rid, ids_, p, rank in followers:
                    with _naming_prompt(i, len(prompts)):
                        self.engine.add_request(rid, ids_, p, **_ranked(rank))
                    added.append(rid)
        except BaseException:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        for *_, params in prepared:
            self.metrics.on_request(n, 0 if prompt_only else params[0].max_tokens)
        for leader, followers in later.items():
            self._later[leader] = followers
            for rid, *_ in followers:
                self._leader_of[rid] = leader

    def _prepare(self, prompt, messages, samples, max_tokens_explicit, max_tokens_field, chat_options, prompt_only):
        """One prompt's (engine prompt ids, prompt token count, scored token or None, params per sample)."""
        tok = self.engine.tokenizer
        max_len = self.engine.max_model_len
        prompt_field = "prompt"
        if tok is None and (messages is not None or isinstance(prompt, str)):
            raise no_tokenizer("messages" if messages is not None else "prompt")
        if messages is not None:
            prompt_field = "messages"
            prompt = chat_prompt_ids(tok, messages, chat_options)
        elif isinstance(prompt, str):
            prompt = tok.encode(prompt)  # tokenize once; the engine gets the ids
        prompt = truncate_prompt(list(prompt), samples[0].truncate_prompt_tokens, max_len, samples[0].max_tokens)
        n = len(prompt)
        if prompt_only:
            if n > max_len:
                raise InvalidRequestError(
                    f"'{prompt_field}': the prompt has {_count(n, 'token')}, more than this model's maximum context length "
                    f"(--max-model-len) of {max_len} tokens; shorten the prompt to at most {max_len} tokens",
                    field=prompt_field,
                )
            ids, scored, params = self._prompt_only(list(prompt), samples)
            return ids, n, scored, params
        if n >= max_len:
            raise InvalidRequestError(
                f"'{prompt_field}': the prompt has {_count(n, 'token')}, which leaves no room for output within this "
                f"model's maximum context length (--max-model-len) of {max_len} tokens; shorten the prompt to at "
                f"most {max_len - 1} tokens",
                field=prompt_field,
            )
        room = max_len - n
        params = []
        for p in samples:
            if p.max_tokens is None or (p.max_tokens > room and not max_tokens_explicit):
                p = dataclasses.replace(p, max_tokens=room)
            elif p.max_tokens > room:
                raise InvalidRequestError(
                    f"'{max_tokens_field}': the prompt has {_count(n, 'token')} and {p.max_tokens} were requested, "
                    f"but the maximum context length is {max_len} tokens; ask for at most {room}",
                    field=max_tokens_field,
                )
            params.append(p)
        return list(prompt), n, None, params

    def _prompt_only(self, ids: list[int], samples: list[SamplingParams]):
        """A prompt-only request (echo, max_tokens 0) generates nothing, yet a prompt's last token is scored
        from the logits of the position before it, which the engine computes only to sample. So the engine
        gets the prompt without its last token and samples exactly one token, forced to be that last token
        (``allowed_token_ids``; the logprobs stay those of the raw logits): its logprobs are the last prompt
        token's, and a prompt that fills the context needs no room beyond it. Returns (engine prompt,
        scored token or None for a one-token prompt, params per sample). An output constraint and bad words
        constrain nothing here (nothing is generated) and are dropped, so they cannot refuse the forced token."""
        if len(ids) < 2:
            return ids, None, [dataclasses.replace(p, max_tokens=1, min_tokens=0, structured_outputs=None, bad_words=())
                               for p in samples]
        scored = ids[-1]
        vocab = _vocab_size(self.engine)
        if vocab is not None:
            check_prompt_token_ids([scored], vocab)
            allowed = samples[0].allowed_token_ids or ()
            if allowed and max(allowed) >= vocab:  # the engine's own check, which the forced token replaces
                raise InvalidRequestError(f"token id {max(allowed)} in allowed_token_ids is outside the vocabulary "
                                          f"of {vocab} tokens (ids 0 to {vocab - 1})", field="allowed_token_ids")
        params = [dataclasses.replace(p, max_tokens=1, min_tokens=0, temperature=0.0, allowed_token_ids=[scored],
                                      logprobs=p.prompt_logprobs, structured_outputs=None, bad_words=())
                  for p in samples]
        return ids[:-1], scored, params

    def _release(self, stream: RequestStream) -> None:
        if self._streams.pop(stream.request_id, None) is None:
            return
        if not stream.finished or stream.final is None:
            self._schedule_abort(stream.request_id)
            self.metrics.on_abort(stream)

    def _schedule_abort(self, *request_ids: str) -> None:
        self._pending_aborts.extend(request_ids)
        self._aborts_unseen += len(request_ids)
        if self._wakeup is not None:
            self._wakeup.set()

    # -- the loop -----------------------------------------------------------------

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _do_aborts(self, request_ids: list[str]) -> list[tuple[str, BaseException]]:
        """Abort requests (engine thread). A sample still waiting for its sample 0 is dropped; the samples
        still waiting for an aborted sample 0 are added now. Returns the adds that failed."""
        for rid in request_ids:
            leader = self._leader_of.pop(rid, None)
            if leader is not None:
                self._later[leader] = [f for f in self._later[leader] if f[0] != rid]
            else:
                self.engine.abort_request(rid)
        failed = []
        for rid in request_ids:
            failed += self._add_later(rid)
        return failed

    def _add_later(self, leader: str) -> list[tuple[str, BaseException]]:
        """Add the samples waiting for ``leader`` (engine thread); returns those the engine refused, which it
        should not: each has sample 0's parameters but for its seed, and the engine took sample 0."""
        failed = []
        for rid, ids, params, rank in self._later.pop(leader, ()):
            del self._leader_of[rid]
            try:
                self.engine.add_request(rid, ids, params, **_ranked(rank))
            except Exception as e:
                failed.append((rid, e))
        return failed

    def _iterate(self, aborts: list[str]):
        failed = self._do_aborts(aborts)
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        for out in outputs:
            if out.request_id in self._later:
                # Its prompt is computed: its other samples join before the next step and reuse its blocks.
                failed += self._add_later(out.request_id)
        steps = []
        if self.step_log is not None:
            steps = self.step_log.since(self._steps_seen)
            self._steps_seen = self.step_log.total
        return outputs, failed, steps, self.engine.has_unfinished_requests(), self.engine.stats()

    async def stats(self) -> dict:
        """The engine's stats without waiting for a step: while one runs (or after shutdown), those at the end
        of the last step; otherwise fresh ones from the engine thread."""
        if self._executor_closed or self._stepping:
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
            # The requests the engine had before this step: their adds returned (streams still being added
            # may land before or after it).
            active = {rid for rid, s in self._streams.items() if s._added}
            self._stepping = True
            try:
                outputs, failed, steps, unfinished, stats = await self._call(self._iterate, aborts)
            except asyncio.CancelledError:
                # Shutdown: the step may never have started, so its aborts go back to the queue, which
                # shutdown() runs (an abort that did run is a no-op the second time).
                self._pending_aborts[:0] = aborts
                raise
            except Exception as e:
                logger.exception("engine step failed; failing %d request(s)", len(self._streams))
                self._dead = e
                for s in list(self._streams.values()):
                    s._fail(EngineDeadError(f"the engine failed: {e!r}"))
                return
            finally:
                self._stepping = False
            self.last_stats = stats
            self._added_since_stats = 0
            self._aborts_unseen = len(self._pending_aborts)  # this step's aborts are in its stats
            self.metrics.on_steps(steps)
            for rid, e in failed:
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    logger.error("the engine refused sample %s, held back for its sample 0 that it took: %r", rid, e)
                    stream._fail(InternalServerError(
                        f"internal error: the engine refused sample {rid} of this request after taking its sample "
                        f"0 with the same parameters but the seed: {type(e).__name__}: {e}"))
            now = time.monotonic()
            seen = set()
            for out in outputs:
                seen.add(out.request_id)
                stream = self._streams.get(out.request_id)
                if stream is None:
                    # Registered before its add, so released since: closed by its reader (or failed by a
                    # shutdown); its abort is queued.
                    continue
                if stream.prompt_only:
                    self.metrics.on_prompt_only(out, stream.scored_token)
                    out = _prompt_only_output(out, stream.scored_token)
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


def _prompt_only_output(out: RequestOutput, scored: int | None) -> RequestOutput:
    """The output of a prompt-only request as its client sees it: the whole prompt (with the scored last
    token, whose logprobs are the engine's sampled-token logprobs) and an empty completion."""
    comp = out.outputs[0]
    prompt_ids = list(out.prompt_token_ids)
    prompt_logprobs = out.prompt_logprobs
    if scored is not None:
        prompt_ids.append(scored)
        if prompt_logprobs is not None:
            prompt_logprobs = list(prompt_logprobs) + [comp.logprobs[0] if comp.logprobs else None]
    empty = CompletionOutput(0, "", [], "length" if out.finished else None, None,
                             [] if comp.logprobs is not None else None)
    return RequestOutput(out.request_id, out.prompt, prompt_ids, [empty], out.finished, out.num_cached_tokens,
                         prompt_logprobs, out.speculative, out.first_scheduled_time)


@contextlib.contextmanager
def _naming_prompt(index: int, prompts: int):
    """With several prompts, an InvalidRequestError raised inside names the prompt's place as the parser
    does: ``'prompt[i]'``."""
    try:
        yield
    except InvalidRequestError as e:
        if prompts == 1 or e.field == "priority":  # the request's priority is no one prompt's
            raise
        field = f"prompt[{index}]"
        message = str(e)
        if message.startswith("'prompt'"):
            message = f"'{field}'" + message[len("'prompt'"):]
        else:
            message = f"'{field}': {message}"
        raise InvalidRequestError(message, field=field) from e


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _ranked(priority: int) -> dict:
    """``add_request``'s keyword for ``priority``: none at 0, so engines without priorities take the call."""
    return {"priority": priority} if priority else {}


def _same_but_seed(params: SamplingParams, sample0: SamplingParams) -> bool:
    return dataclasses.replace(params, seed=sample0.seed) == sample0


def _vocab_size(engine) -> int | None:
    spec = getattr(engine, "spec", None)
    size = getattr(spec, "vocab_size", None) if spec is not None else getattr(engine, "vocab_size", None)
    return size if isinstance(size, int) else None

"""The OpenAI-compatible HTTP app (aiohttp).

``create_app(engine, ...)`` returns an ``aiohttp.web.Application`` serving
``/v1/completions``, ``/v1/chat/completions`` (both streaming), ``/v1/models``,
``/v1/models/{id}``, ``/tokenize``, ``/detokenize``, ``/tokenizer_info``,
``/health`` and ``/metrics``. ``serve(app, ...)`` runs it until SIGTERM/SIGINT
and drains; ``ServerThread`` runs it on a background thread (tests, notebooks).

Run it with an ``AppRunner(app, handler_cancellation=True)`` (as ``serve`` and
``ServerThread`` do) so that a client that disconnects while its request waits
cancels the handler and aborts the request; a disconnect during streaming is
caught on the next write either way.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import signal
import socket
import threading
import time
import uuid

from aiohttp import web

import kvforge
from kvforge.engine.outputs import logprobs_between, num_prompt_token_ids, num_token_ids, token_ids_since
from kvforge.errors import InvalidRequestError
from kvforge.server import protocol, responses, tokenization
from kvforge.server.async_engine import (
    SERVER_FAILURES,
    AsyncEngine,
    EngineDeadError,
    InternalServerError,
    QueueFullError,
    RequestStream,
    ServerShuttingDownError,
)
from kvforge.server.cli import DEFAULT_MAX_REQUEST_BYTES
from kvforge.server.cors import ALLOW_ALL, CorsPolicy, add_origin_headers_on_prepare, preflight_middleware
from kvforge.server.event_stream import event_stream
from kvforge.server.http_log import http_logger
from kvforge.server.metrics import CONTENT_TYPE, ServerMetrics
from kvforge.server.reasoning_split import reasoning_stream, split_reasoning
from kvforge.server.request_defaults import RequestDefaults
from kvforge.server.responses_output import collect_response, stream_response
from kvforge.server.responses_store import ResponsesStore
from kvforge.server.tool_calls import ToolCallStream, call_object
from kvforge.server.tool_parsers import parse_calls, stream_calls

logger = logging.getLogger("kvforge.server")
#: What a client may call, named by the 404 of any other path.
ROUTES = ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses",
          "GET|DELETE /v1/responses/{id}", "GET /v1/responses/{id}/input_items", "GET /v1/models",
          "GET /v1/models/{id}",
          "POST /tokenize", "POST /detokenize", "GET /tokenizer_info", "GET /health", "GET|POST /ping", "GET /version",
          "GET /metrics", "GET /debug/steps")

ASYNC_ENGINE = web.AppKey("async_engine", AsyncEngine)
CONFIG = web.AppKey("config", dict)

#: The fixed paths of ROUTES (those without a path parameter).
SERVED_PATHS = frozenset(r.split(" ", 1)[1] for r in ROUTES if "{" not in r)

TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")
DEFAULT_MAX_QUEUED_REQUESTS = 1024
#: Seconds a connection may sit without a request (idle between requests, or holding part of a request's
#: headers) before the server closes it, so stalled clients cannot hold connections forever.
KEEP_ALIVE_TIMEOUT_S = 75.0
#: Seconds a request's body may take to arrive; then 408 and the connection is closed.
BODY_READ_TIMEOUT_S = 120.0
#: Seconds the server gives the streams a failed engine cut to write their error events before it exits.
ENGINE_DEATH_FLUSH_S = 5.0
#: Content-Encoding values aiohttp decodes (br and zstd where their packages are installed; it answers 400
#: itself where not); any other coding would reach the JSON parser still encoded.
DECODED_CONTENT_ENCODINGS = frozenset({"identity", "gzip", "deflate", "br", "zstd"})


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.code, self.param, self.headers = status, type_, code, param, headers or {}


def _json_error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                headers=None) -> web.Response:
    return web.json_response(protocol.error_body(message, type_, param, code), status=status, headers=headers)


def create_app(
    engine,
    *,
    api_key: str | None = None,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    served_model_name: str | None = None,
    shutdown_grace_s: float = 30.0,
    log_requests: bool = False,
    log_outputs: bool = False,
    max_log_len: int | None = None,
    tool_parser: str | None = None,
    prompt_tokens_details: bool = False,
    request_defaults: RequestDefaults | None = None,
    request_id_headers: bool = False,
    responses_store_size: int = 0,
    cors: CorsPolicy | None = ALLOW_ALL,
) -> web.Application:
    """Build the app around a synchronous engine (docs/ENGINE_API.md); ``tool_parser``: the parser of tool calls
    the model chooses to make (kvforge/server/tool_parsers.py; None: ``tool_choice`` ``"auto"`` is refused);
    ``log_outputs``: each choice's output text is logged when it ends (its first ``max_log_len`` characters);
    ``prompt_tokens_details``: usage counts the prompt tokens read from the prefix cache; ``request_defaults``:
    server-wide defaults of request fields (kvforge/server/request_defaults.py); ``request_id_headers``: each
    response carries an ``X-Request-Id`` header (the request's own, or a new one); ``responses_store_size``: the
    responses kept for ``previous_response_id`` (0: none; kvforge/server/responses_store.py); ``cors``: which
    browser origins may call it (kvforge/server/cors.py; the default allows every origin, as vLLM's; None: no
    CORS headers, and preflights are 405)."""
    defaults = request_defaults or RequestDefaults()
    store = ResponsesStore(responses_store_size) if responses_store_size else None
    model_name = served_model_name or engine.model_name
    names = (model_name, *getattr(engine, "model_aliases", ()))  # the first is reported in responses
    metrics = ServerMetrics(model_name)
    aengine = AsyncEngine(engine, max_queued_requests=max_queued_requests, metrics=metrics)
    config = {
        "api_key": api_key,
        "max_request_bytes": max_request_bytes,
        "model_name": model_name,
        "shutdown_grace_s": shutdown_grace_s,
    }

    @web.middleware
    async def middleware(request: web.Request, handler):
        resource = request.match_info.route.resource
        # a known path with a method it does not serve (405) keeps its own label
        path = resource.canonical if resource else request.path if request.path in SERVED_PATHS else "other"
        try:
            if api_key is not None and (request.path.startswith("/v1") or request.path in TOKENIZER_PATHS):
                scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
                # the scheme's name is case-insensitive (RFC 9110); the key is compared in constant time
                if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
                    metrics.on_reject("unauthorized")
                    raise _HTTPError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                     "invalid_request_error", "invalid_api_key")
            response = await handler(request)
        except protocol.ModelNotFoundError as e:
            metrics.on_reject("model_not_found")
            response = _json_error(404, str(e), param=e.field, code="model_not_found")
        except InvalidRequestError as e:
            metrics.on_reject("invalid")
            msg = str(e)
            response = _json_error(400, msg, param=e.field)
        except _HTTPError as e:
            response = _json_error(e.status, str(e), e.type, e.param, e.code, e.headers)
        except QueueFullError as e:
            metrics.on_reject("queue_full")
            response = _json_error(503, str(e), "server_overloaded", code="queue_full",
                                   headers={"Retry-After": str(e.retry_after)})
        except (ServerShuttingDownError, EngineDeadError, InternalServerError) as e:
            status, type_, code = SERVER_FAILURES[type(e)]
            if code == "shutting_down":
                metrics.on_reject(code)
            response = _json_error(status, str(e), type_, code=code,
                                   headers={"Retry-After": "5"} if code == "shutting_down" else None)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            message = e.reason or "error"
            if e.status == 404:
                message = f"no route {request.method} {request.path}: this server serves {', '.join(ROUTES)}"
            elif e.status == 405:
                message = f"{request.method} is not allowed on {request.path}"
            allow = e.headers.get("Allow")  # a 405 names the methods the route serves
            response = _json_error(e.status, message, "invalid_request_error",
                                   code="not_found" if e.status == 404 else None,
                                   headers={"Allow": allow} if allow else None)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:
            logger.exception("unhandled error on %s", request.path)
            response = _json_error(500, f"internal server error: {type(e).__name__}: {e}", "server_error")
        metrics.on_http(path, response.status)
        return response

    middlewares = [middleware] if cors is None else [preflight_middleware(cors), middleware]
    app = web.Application(middlewares=middlewares, client_max_size=max_request_bytes)
    if cors is not None:
        add_origin_headers_on_prepare(app, cors)
    if request_id_headers:
        async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
            response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex

        app.on_response_prepare.append(add_request_id)  # before the headers go out: streams too
    app[ASYNC_ENGINE] = aengine
    app[CONFIG] = config

    async def read_json(request: web.Request):
        if request.content_length is not None and request.content_length > max_request_bytes:
            metrics.on_reject("too_large")
            raise _HTTPError(413, f"request body is {request.content_length} bytes; the limit "
                             f"(--max-request-bytes) is {max_request_bytes}", "invalid_request_error",
                             "request_too_large")
        encoding = request.headers.get("Content-Encoding")
        if encoding is not None and encoding.strip().lower() not in DECODED_CONTENT_ENCODINGS:
            raise _HTTPError(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed, or "
                             f"as gzip or deflate (one coding)", "invalid_request_error", param="body",
                             headers={"Connection": "close"})  # the unread body stays on the connection
        try:
            async with asyncio.timeout(BODY_READ_TIMEOUT_S):
                raw = await request.read()
        except TimeoutError as e:
            raise _HTTPError(408, f"the request body did not arrive within {BODY_READ_TIMEOUT_S:.0f} s "
                             f"(Content-Length {request.content_length}); send the whole body", "invalid_request_error",
                             param="body", headers={"Connection": "close"}) from e
        except web.HTTPRequestEntityTooLarge as e:
            metrics.on_reject("too_large")
            raise _HTTPError(413, f"request body exceeds the limit (--max-request-bytes) of "
                             f"{max_request_bytes} bytes", "invalid_request_error", "request_too_large") from e
        except web.RequestPayloadError as e:  # a body its Content-Encoding does not decode, a broken chunk
            encoding = request.headers.get("Content-Encoding")
            what = f"is not valid {encoding!r} data" if encoding else "could not be read"
            detail = " ".join(str(e).split()).removeprefix("400, message: ")
            raise _HTTPError(400, f"the request body {what} ({detail}); send the body as the Content-Encoding "
                             f"header says, or drop the header", "invalid_request_error", param="body",
                             headers={"Connection": "close"}) from e  # the connection's stream is spent
        return protocol.decode_json_body(raw)

    async def health(request):
        if aengine.healthy and aengine.accepting:
            return web.json_response({"status": "ok"})
        state = "shutting_down" if not aengine.accepting else "engine_dead"
        return web.json_response({"status": state}, status=503)

    async def metrics_endpoint(request):
        stats = await aengine.stats()
        body = metrics.render(stats, in_flight=aengine.num_in_flight)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def debug_steps(request):
        log = aengine.step_log
        if log is None:
            raise web.HTTPNotFound(reason="this engine keeps no step record")
        raw = request.query.get("last")
        try:
            last = None if raw is None else int(raw)
        except ValueError:
            last = 0
        if last is not None and last < 1:
            raise InvalidRequestError(f"'last' must be a positive integer, got {raw!r}", field="last")
        steps = [r.as_dict() for r in log.last(last)]
        return web.json_response({"capacity": log.capacity, "total_steps": log.total, "steps": steps})

    def model_object(name: str) -> dict:
        return protocol.model_object(name, int(aengine.started), engine.max_model_len, root=model_name)

    async def models(request):
        return web.json_response({"object": "list", "data": [model_object(n) for n in names]})

    async def model(request):
        return web.json_response(model_object(protocol.check_model(request.match_info["model_id"], names)))

    async def add_choices(req: protocol.ParsedRequest) -> list[RequestStream]:
        """One engine request per choice, in choice order (prompt position * n + sample number), all queued
        before the next engine step (``AsyncEngine.add_requests``)."""
        prompts = req.prompts if req.kind == "completion" else [None]
        aengine.admit(len(prompts) * req.n, req.n)
        return await aengine.add_requests(
            prompts, [req.params.sample_params(j) for j in range(req.n)], messages=req.messages,
            max_tokens_explicit=req.max_tokens_explicit, max_tokens_field=req.max_tokens_field,
            chat_options=req.chat_options, prompt_only=req.prompt_only, admitted=True, priority=req.priority)

    sampling_defaults = getattr(engine, "sampling_defaults", {})  # the model's generation config

    async def explain_tool_error(choice, error: InvalidRequestError) -> InvalidRequestError:
        """A forced call's refused constraint told by the function at fault: a ``"required"`` array's first
        function the compiler refuses alone, where the array's error does not point into one."""
        explained = choice.explain(error)
        if explained.field == "tools":  # a "required" array's error that points into no function
            for index, params in enumerate(choice.functions()):
                try:
                    await aengine.check_constraint(params, "tools")
                except InvalidRequestError as alone:
                    return choice.explain(alone, index)
        return explained

    async def run(request, req, write):
        """Queue ``req``'s choices and answer with ``write(streams)``; the streams close when it returns."""
        try:
            await aengine.check_constraint(req.params.structured_outputs, req.constraint_field)
        except InvalidRequestError as e:
            if req.tool_choice is None:
                raise
            raise await explain_tool_error(req.tool_choice, e) from None
        streams = await add_choices(req)
        if log_requests:  # once the engine took it: a refused request is not logged as served
            logger.info("request %s: %d prompt(s) x n=%d, max_tokens %s, stream %s", request.path,
                        len(req.prompts) if req.prompts is not None else 1, req.n, req.params.max_tokens, req.stream)
        try:
            return await write(streams)
        finally:
            for stream in streams:
                if log_outputs and stream.final is not None:
                    comp = stream.final.outputs[0]
                    text = comp.text if max_log_len is None else comp.text[:max_log_len]
                    logger.info("output of %s %s: %r (finish %s, %d tokens)", request.path, stream.request_id, text,
                                comp.finish_reason, len(comp.token_ids))
                stream.close()

    async def generate(request, parse, chat: bool):
        req = parse(defaults.apply(await read_json(request), chat), names, sampling_defaults)

        async def write(streams):
            if req.stream:
                return await _stream(request, req, streams, engine.tokenizer, model_name, prompt_tokens_details)
            return await _collect(req, streams, engine.tokenizer, model_name, prompt_tokens_details)

        return await run(request, req, write)

    async def responses_route(request):
        body = await read_json(request)
        try:
            chat_body, meta, history = responses.chat_body(body, store)
            protocol.log_ignored_fields(body, responses.RESPONSES_FIELDS)
            chat_body = defaults.apply(chat_body, chat=True)
            req = protocol.parse_chat(chat_body, names, sampling_defaults, tool_parser=tool_parser,
                                      reasoning=getattr(engine, "reasoning", None))
            meta = responses.with_template_effort(meta, req.chat_options)
        except protocol.ModelNotFoundError:
            raise
        except InvalidRequestError as e:
            raise responses.responses_field(e) from None

        def keep(response: dict) -> None:
            if meta.store:  # the conversation so far, this response's output last
                store.put(response, [*history, *responses.input_messages(response["output"], "output")],
                          responses.input_items(body["input"]))

        async def write(streams):
            (stream,) = streams
            if req.stream:
                return await stream_response(request, req, meta, stream, model_name, keep)
            return await collect_response(req, meta, stream, model_name, keep)

        try:
            return await run(request, req, write)
        except protocol.ModelNotFoundError:
            raise
        except InvalidRequestError as e:  # refused when queued (a length, a constraint): named as Responses name it
            raise responses.responses_field(e) from None

    def stored(request) -> tuple[str, object]:
        response_id = request.match_info["response_id"]
        found = store.get(response_id) if store is not None else None
        if found is None:
            why = "responses are not stored on this server (--responses-store-size)" if store is None else \
                f"no stored response has the id {response_id!r:.80}"
            raise _HTTPError(404, why, "invalid_request_error", "not_found")
        return response_id, found

    async def get_response(request):
        return web.json_response(stored(request)[1].response)

    async def response_input_items(request):
        """OpenAI's list of a stored response's input items: ``limit`` (1-100, default 20), ``order`` (``desc``,
        the default, or ``asc``) and ``after`` (an item id: the page starts after it)."""
        items = list(stored(request)[1].input_items)
        query = request.rel_url.query
        try:
            limit = int(query.get("limit", 20))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise InvalidRequestError(f"'limit' must be an integer from 1 to 100, got {query['limit']!r:.40}",
                                      field="limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequestError(f"'order' must be asc or desc, got {order!r:.40}", field="order")
        if order == "desc":
            items.reverse()
        if "after" in query:
            ids = [item["id"] for item in items]
            if query["after"] not in ids:
                raise InvalidRequestError(f"'after': no input item of this response has the id {query['after']!r:.80}",
                                          field="after")
            items = items[ids.index(query["after"]) + 1:]
        page = items[:limit]
        return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                                  "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    async def delete_response(request):
        response_id, _ = stored(request)
        store.delete(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def completions(request):
        return await generate(request, protocol.parse_completion, chat=False)

    async def chat(request):
        return await generate(request, functools.partial(protocol.parse_chat, tool_parser=tool_parser,
                                                         reasoning=getattr(engine, "reasoning", None)), chat=True)

    async def tokenize(request):
        req = tokenization.parse_tokenize(defaults.apply(await read_json(request), chat=True, generates=False), names)
        return web.json_response(await asyncio.to_thread(tokenization.tokenize, engine.tokenizer, req,
                                                         engine.max_model_len))

    async def detokenize(request):
        ids = tokenization.parse_detokenize(await read_json(request), names)
        return web.json_response(await asyncio.to_thread(tokenization.detokenize, engine.tokenizer, ids))

    async def tokenizer_info(request):
        return web.json_response(tokenization.tokenizer_info(engine.tokenizer, engine.max_model_len))

    async def version(request):
        return web.json_response({"version": kvforge.__version__})

    async def ping(request):  # vLLM's liveness probe, as /health
        return web.Response(status=200)

    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/ping", ping)
    async def expect_continue(request):
        """``Expect: 100-continue``: a body the size limit refuses is answered 413 before the client sends it
        (the default handler invites every body first)."""
        if request.content_length is not None and request.content_length > max_request_bytes:
            metrics.on_reject("too_large")
            return _json_error(413, f"request body is {request.content_length} bytes; the limit "
                               f"(--max-request-bytes) is {max_request_bytes}", code="request_too_large",
                               headers={"Connection": "close"})
        if request.headers.get("Expect", "").lower() != "100-continue":
            return _json_error(417, f"Expect: {request.headers.get('Expect')!r} is not supported; send "
                               f"100-continue or no Expect header", param="Expect")
        if request.version >= (1, 1):  # HTTP/1.0 has no interim responses: the client sends the body anyway
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    def add_post(path, handler):
        app.router.add_post(path, handler, expect_handler=expect_continue)

    add_post("/ping", ping)
    add_post("/tokenize", tokenize)
    add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_get("/debug/steps", debug_steps)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", model)
    add_post("/v1/completions", completions)
    add_post("/v1/chat/completions", chat)
    add_post("/v1/responses", responses_route)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", response_input_items)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)

    async def on_startup(app):
        await aengine.start()

    async def on_shutdown(app):
        # Sites are stopped (no new connections) before this runs; drain the engine.
        await aengine.shutdown(shutdown_grace_s)

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    return app


# -- response builders ------------------------------------------------------------------


class _Choice:
    """What one choice has to say: the generated tokens (none for a prompt-only echo), led by the
    prompt and its logprobs under ``echo``. ``prompt`` is the request's prompt (text or ids)."""

    def __init__(self, req, tokenizer, prompt):
        self.req, self.tokenizer, self.prompt = req, tokenizer, prompt
        # A text prompt is echoed as sent, unless truncate_prompt_tokens cut it: then, as a prompt of ids, the
        # text of the tokens the request ran on.
        self.echo_as_sent = isinstance(prompt, str) and req.params.truncate_prompt_tokens is None

    def generated(self, comp):
        """(text, token ids, logprobs) of ``comp`` as the client sees them."""
        if self.req.prompt_only:
            return "", [], []
        return comp.text, comp.token_ids, comp.logprobs or []

    def text_and_count(self, comp) -> tuple[str, int]:
        """(text, number of token ids) of ``comp`` as :meth:`generated` gives them, without copying the ids."""
        return ("", 0) if self.req.prompt_only else (comp.text, num_token_ids(comp))

    def ids_since(self, comp, start: int) -> list[int]:
        """The token ids of :meth:`generated` from ``start`` on."""
        return [] if self.req.prompt_only else token_ids_since(comp, start)

    def finish_reason(self, comp):
        return "length" if self.req.prompt_only else comp.finish_reason

    def stop_reason(self, comp):
        """vLLM's ``stop_reason``: the stop string or stop token id that ended the choice; None for EOS,
        a length limit or a choice still running."""
        return None if self.req.prompt_only else comp.stop_reason

    def echo_text(self, out) -> str:
        if self.echo_as_sent:
            return self.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer is not None else ""

    def logprobs(self, out, start: int, end: int, echo: bool, offsets: protocol.TextOffsets | None = None):
        """The logprobs object for generated tokens ``start:end``, led by the prompt's when ``echo``."""
        req = self.req
        if req.logprobs is None:
            return None
        comp = out.outputs[0]
        if self.req.prompt_only:
            ids, lps = [], []
        else:  # only the entries asked for: a stream asks for each step's new ones
            ids, lps = token_ids_since(comp, start)[:end - start], logprobs_between(comp, start, end)
        if req.kind == "chat":
            return protocol.chat_logprobs(self.tokenizer, ids, lps, req.logprobs, req.tokens_as_ids)
        offsets = offsets or protocol.TextOffsets()
        parts = []
        if echo:
            # Offsets index the choice's text: a text prompt is echoed as sent (its special tokens written
            # out), a prompt of token ids decoded without its special tokens.
            prompt_ids = list(out.prompt_token_ids)
            parts.append(protocol.completion_logprobs(
                self.tokenizer, prompt_ids, list(out.prompt_logprobs or [None] * len(prompt_ids)), req.logprobs,
                offsets, skip_special_tokens=not self.echo_as_sent, as_ids=req.tokens_as_ids))
        parts.append(protocol.completion_logprobs(self.tokenizer, ids, lps, req.logprobs, offsets,
                                                  skip_special_tokens=req.params.skip_special_tokens,
                                                  as_ids=req.tokens_as_ids))
        return protocol.join_logprobs(parts)


def reasoning_fields(reasoning: str) -> dict:
    """A message's (or delta's) reasoning: ``reasoning``, vLLM's field, and ``reasoning_content``, its earlier
    name, which other servers still use."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def _parsed_delta(parser, text: str, finished: bool) -> dict:
    """The delta of a streamed choice whose calls the model chooses (``parser``: a tool parser's stream,
    kvforge/server/tool_parsers.py): new content, and each call found since, whole, at the next index."""
    first = parser.calls
    content, calls = parser.finish(text) if finished else parser.feed(text)
    delta = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = [{"index": first + k, **call_object(name, args)} for k, (name, args) in enumerate(calls)]
    return delta


def _prompt_of(req, choice: int):
    """The request's prompt (text or ids) behind choice ``choice``; None for chat."""
    return req.prompts[choice // req.n] if req.prompts else None


async def _collect(req, streams: list[RequestStream], tokenizer, model_name: str,
                   prompt_tokens_details: bool = False) -> web.Response:
    finals = await asyncio.gather(*(s.final_output() for s in streams))
    choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
    for i, final in enumerate(finals):
        comp = final.outputs[0]
        view = _Choice(req, tokenizer, _prompt_of(req, i))
        text, ids, _ = view.generated(comp)
        choice = {"index": i, "logprobs": view.logprobs(final, 0, len(ids), req.echo),
                  "finish_reason": view.finish_reason(comp), "stop_reason": view.stop_reason(comp)}
        if req.kind == "chat":
            reasoning = None
            if req.reasoning is not None:
                reasoning, text = split_reasoning(req.reasoning.parser, text,
                                                  req.reasoning.opening_phase(final.prompt_token_ids))
            choice["message"] = {"role": "assistant", "content": text if text or reasoning is None else None}
            calls = req.tool_choice.calls(text) if req.tool_choice is not None else None
            if calls is not None:
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
                choice["finish_reason"] = req.tool_choice.finish_reason(choice["finish_reason"], text)
            elif req.tool_parser is not None:
                content, chosen = parse_calls(req.tool_parser, text, req.parallel_tool_calls)
                if chosen:
                    choice["message"] = {"role": "assistant", "content": content or None,
                                         "tool_calls": [call_object(name, args) for name, args in chosen]}
                    if choice["finish_reason"] == "stop":
                        choice["finish_reason"] = "tool_calls"
            if reasoning and req.include_reasoning:  # an empty think block says nothing (nor does its stream)
                choice["message"].update(reasoning_fields(reasoning))
        else:
            choice["text"] = (view.echo_text(final) if req.echo else "") + text
        if req.return_token_ids:  # vLLM's: the ids behind the text (a chat's prompt ids are the response's)
            if req.kind != "chat":
                choice["prompt_token_ids"] = list(final.prompt_token_ids)
            choice["token_ids"] = list(ids)
        if req.kind != "chat":  # vLLM's: per choice of completions, null unless asked for
            choice["prompt_logprobs"] = (None if req.prompt_logprobs is None
                                         else protocol.prompt_logprobs_object(tokenizer, final.prompt_logprobs))
        choices.append(choice)
        if i % req.n == 0:  # a prompt counts once, however many choices it has
            prompt_tokens += len(final.prompt_token_ids)
            cached_tokens += final.num_cached_tokens
        completion_tokens += len(ids)
    prefix, obj = ("chatcmpl", "chat.completion") if req.kind == "chat" else ("cmpl", "text_completion")
    body = {
        "id": protocol.random_id(prefix),
        "object": obj,
        "created": protocol.now(),
        "model": model_name,
        "system_fingerprint": None,
        "choices": choices,
        "usage": protocol.usage(prompt_tokens, completion_tokens, cached_tokens if prompt_tokens_details else None),
    }
    if req.return_token_ids and req.kind == "chat":
        body["prompt_token_ids"] = list(finals[0].prompt_token_ids)
    if req.kind == "chat":  # vLLM's: once for the chat's one prompt, null unless asked for
        body["prompt_logprobs"] = (None if req.prompt_logprobs is None
                                   else protocol.prompt_logprobs_object(tokenizer, finals[0].prompt_logprobs))
    return web.json_response(body)



async def _merge(streams: list[RequestStream]):
    """Yield ``(index, output)`` from several streams as they produce (one task per stream)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, done))
        except Exception as e:  # handed to the reader, which re-raises it
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _stream(request: web.Request, req, streams: list[RequestStream], tokenizer, model_name: str,
                  prompt_tokens_details: bool = False):
    return await event_stream(
        request, lambda resp: _stream_events(resp, req, streams, tokenizer, model_name, prompt_tokens_details))


async def _stream_events(resp: web.StreamResponse, req, streams: list[RequestStream], tokenizer, model_name: str,
                         prompt_tokens_details: bool):
    """Write ``streams`` to the prepared ``resp`` as server-sent events, then ``data: [DONE]``; raises
    ConnectionResetError once the client is gone."""
    chat = req.kind == "chat"
    rid = protocol.random_id("chatcmpl" if chat else "cmpl")
    created = protocol.now()
    obj = "chat.completion.chunk" if chat else "text_completion"

    def usage_so_far(last: bool = False) -> dict:
        # the cached count is known once the requests were scheduled: only the last usage carries it
        cached = sum(cached_tokens[::req.n]) if prompt_tokens_details and last else None
        return protocol.usage(sum(prompt_tokens[::req.n]), sum(sent_tokens), cached)

    def chunk(choices: list, usage=None, **extra) -> bytes:
        body = {"id": rid, "object": obj, "created": created, "model": model_name, "system_fingerprint": None,
                "choices": choices, **extra}
        if req.include_usage:
            if usage is None and req.continuous_usage:  # a choice's chunk: its own prompt and tokens so far
                i = choices[0]["index"]
                usage = protocol.usage(prompt_tokens[i], sent_tokens[i])
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    n = len(streams)
    views = [_Choice(req, tokenizer, _prompt_of(req, i)) for i in range(n)]
    sent_text, sent_tokens = [""] * n, [0] * n
    offsets = [protocol.TextOffsets() for _ in range(n)]
    echoed = [not req.echo] * n
    ids_sent = [False] * n
    prompt_tokens = [s.prompt_tokens for s in streams]
    cached_tokens = [0] * n
    tool_streams = [ToolCallStream(req.tool_choice) for _ in range(n)] if chat and req.tool_choice else None
    parsers = ([stream_calls(req.tool_parser, req.parallel_tool_calls) for _ in range(n)]
               if chat and req.tool_parser is not None else None)
    thinking: list = [None] * n  # per choice, under a reasoning parser
    try:
        if chat:
            opening = {"role": "assistant", "content": None if tool_streams is not None else ""}
            for i in range(n):
                await resp.write(chunk([{"index": i, "delta": opening, "logprobs": None, "finish_reason": None}]))
        async for i, out in _merge(streams):
            view = views[i]
            comp = out.outputs[0]
            prompt_tokens[i] = num_prompt_token_ids(out)
            cached_tokens[i] = out.num_cached_tokens
            text, num_ids = view.text_and_count(comp)
            reasoning = ""
            if chat and req.reasoning is not None:  # the answer so far goes on as the text
                if thinking[i] is None:
                    thinking[i] = reasoning_stream(req.reasoning.parser,
                                                  req.reasoning.opening_phase(out.prompt_token_ids))
                reasoning, text = (thinking[i].finish if out.finished else thinking[i].feed)(text)
                reasoning = reasoning if req.include_reasoning else ""
            delta = text[len(sent_text[i]):]
            lead = ""
            if not echoed[i]:
                lead = view.echo_text(out)
            if not delta and not lead and not out.finished and num_ids == sent_tokens[i]:
                continue  # nothing new: no token, no text
            # A step's new tokens go out at once even when they add no text yet (part of a character, a
            # held-back stop string): the client sees every token's arrival, as vLLM streams them.
            lp = view.logprobs(out, sent_tokens[i], num_ids, not echoed[i], offsets[i])
            new_ids = view.ids_since(comp, sent_tokens[i])
            sent_tokens[i] = num_ids  # counted before any chunk of this step goes out (continuous usage)
            echoed[i] = True
            finish = view.finish_reason(comp) if out.finished else None
            if reasoning and out.finished:  # the last reasoning before the last answer, calls and finish
                await resp.write(chunk([{"index": i, "delta": reasoning_fields(reasoning), "logprobs": None,
                                         "finish_reason": None}]))
                reasoning = ""
            if tool_streams is not None:
                calls = tool_streams[i].delta(delta, text, out.finished)
                if out.finished and calls:
                    # The calls in a chunk of their own, then the finish: OpenAI's order, which clients that
                    # close a call when the finish arrives (the openai SDK's stream events) rely on.
                    await resp.write(chunk([{"index": i, "delta": calls, "logprobs": lp, "finish_reason": None}]))
                    calls, lp = {}, None
                choice = {"index": i, "delta": calls, "logprobs": lp,
                          "finish_reason": req.tool_choice.finish_reason(finish, text)}
            elif parsers is not None:
                choice = {"index": i, "delta": _parsed_delta(parsers[i], text, out.finished), "logprobs": lp,
                          "finish_reason": finish}
                if out.finished and parsers[i].calls:
                    if choice["delta"]:  # the last content or calls first, then the finish (OpenAI's order)
                        await resp.write(chunk([{**choice, "finish_reason": None}]))
                        choice["delta"], choice["logprobs"] = {}, None
                    if finish == "stop":
                        choice["finish_reason"] = "tool_calls"
            elif chat:
                choice = {"index": i, "delta": {"content": delta} if delta else {}, "logprobs": lp,
                          "finish_reason": finish}
            else:
                choice = {"index": i, "text": lead + delta, "logprobs": lp, "finish_reason": finish}
            if reasoning:
                choice["delta"] = {**reasoning_fields(reasoning), **choice["delta"]}
            if (tool_streams is not None or parsers is not None) and not choice["delta"] and not out.finished \
                    and lp is None and not req.return_token_ids and not req.continuous_usage:
                sent_text[i] = text  # call syntax the client does not see: no chunk
                continue
            if out.finished:  # as vLLM streams it: only the choice's last chunk carries stop_reason
                choice["stop_reason"] = view.stop_reason(comp)
            extra = {}
            if req.return_token_ids:  # new ids; the prompt's in a choice's first chunk (a chat's: once, top level)
                choice["token_ids"] = new_ids
                if not ids_sent[i]:
                    if not chat:
                        choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    elif not any(ids_sent):  # a chat's one prompt: once per response
                        extra["prompt_token_ids"] = list(out.prompt_token_ids)
                    ids_sent[i] = True
            sent_text[i] = text
            await resp.write(chunk([choice], **extra))
        if req.include_usage:
            await resp.write(chunk([], usage_so_far(last=True)))
    except (ServerShuttingDownError, EngineDeadError, InternalServerError) as e:
        _, type_, code = SERVER_FAILURES[type(e)]
        err = protocol.error_body(str(e), type_, code=code)
        await resp.write(f"data: {json.dumps(err)}\n\n".encode())
    except ConnectionResetError:
        raise
    except Exception as e:  # the response has begun: the error goes out as an event, then the stream ends
        logger.exception("stream of request %s failed", rid)
        err = protocol.error_body(f"internal server error: {type(e).__name__}: {e}", "server_error",
                                  code="internal_error")
        await resp.write(f"data: {json.dumps(err)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


# -- running it ---------------------------------------------------------------------------


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0 picks a free one); raises OSError when the address
    cannot be resolved or is in use. ``kvforge serve`` binds before it loads any weight; the socket
    listens only once the app serves, so until then a client's connection is refused, not left waiting."""
    family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


async def start_site(app: web.Application, host: str, port: int, shutdown_timeout: float = 10.0,
                     sock: socket.socket | None = None):
    """Set up a runner (with handler cancellation on disconnect) and listen, on ``sock`` when given
    (from :func:`bind_socket`) else on ``host:port``; returns (runner, port)."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout,
                           keepalive_timeout=KEEP_ALIVE_TIMEOUT_S, logger=http_logger())
    await runner.setup()
    site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    return runner, bound


def serve(app: web.Application, host: str = "127.0.0.1", port: int = 8000, sock: socket.socket | None = None) -> int:
    """Serve until SIGTERM/SIGINT, then stop accepting, drain in-flight requests and return 0: the listener
    closes at once, connections already open are still answered while the engine drains (a new request
    gets 503 ``shutting_down``), and only then are they closed. A second signal cuts the drain short
    (requests still running are aborted). Where the engine fails instead, the server exits with 1
    (:func:`exit_on_engine_death`). ``sock`` is an already bound listening socket (:func:`bind_socket`);
    without it ``host:port`` is bound."""

    async def main() -> int:
        runner, bound = await start_site(app, host, port, sock=sock)
        local = host in ("localhost", "::1") or host.startswith("127.")
        logger.info("kvforge server listening on http://%s:%d%s", host, bound,
                    " (this machine only; --host 0.0.0.0 serves other machines and containers' port maps)"
                    if local else "")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread / platform
                pass
        aengine = app[ASYNC_ENGINE]
        stopped, died = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(aengine.wait_until_dead())
        await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.is_set() and died.done() and died.result() is not None:
            stopped.cancel()
            return await exit_on_engine_death(runner, aengine, died.result())
        await stopped
        died.cancel()
        logger.info("shutting down: no new requests; draining %d choice(s) in flight (a second signal aborts "
                    "them)", aengine.num_in_flight)
        t0 = time.monotonic()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, aengine.end_grace)
            except (NotImplementedError, RuntimeError):
                pass
        for site in list(runner.sites):  # the listener closes; open connections are still served
            await site.stop()
        await aengine.shutdown(app[CONFIG]["shutdown_grace_s"])
        await runner.cleanup()  # closes the connections (on_shutdown finds the engine drained)
        logger.info("shutdown complete in %.1fs", time.monotonic() - t0)
        return 0

    return asyncio.run(main())


async def exit_on_engine_death(runner: web.AppRunner, aengine: AsyncEngine, error: BaseException) -> int:
    """The engine failed: its requests already got ``engine_dead``. Stop listening, give their streams up
    to ``ENGINE_DEATH_FLUSH_S`` to write the error, close and return 1, so a supervisor (systemd, a
    container runtime) restarts the server instead of it answering 503 forever (vLLM's server exits too)."""
    logger.error("the engine failed (%s: %s): the server exits so that it can be restarted",
                 type(error).__name__, error)
    for site in list(runner.sites):
        await site.stop()
    deadline = time.monotonic() + ENGINE_DEATH_FLUSH_S
    while aengine.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await runner.cleanup()
    return 1


class ServerThread:
    """Run an app on a background event loop thread: ``with ServerThread(app) as srv: srv.url``."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host, self.port = app, host, port
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvforge-server", daemon=True)
        self._runner = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def async_engine(self) -> AsyncEngine:
        return self.app[ASYNC_ENGINE]

    def start(self) -> ServerThread:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(start_site(self.app, self.host, self.port), self.loop)
        self._runner, self.port = fut.result(timeout=60)
        return self

    def stop(self, timeout: float = 60) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout=timeout)
            self._runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

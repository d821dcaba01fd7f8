"""The output of a ``/v1/responses`` request (kvforge/server/responses.py): one chat choice read as the
Responses API's output items, whole (:func:`collect_response`) or as its server-sent event stream
(:func:`stream_response`).

A stream goes ``response.created``, ``response.in_progress``, then per output item ``output_item.added``,
its content part or arguments opening, its deltas (``reasoning_text.delta``, ``output_text.delta``,
``function_call_arguments.delta``), their ``.done`` and ``output_item.done``, and last
``response.completed`` with the whole Response, whose items are those the stream sent, ids included (its
``status`` says ``incomplete`` where ``max_output_tokens`` cut the output: the openai SDK's stream helpers
wait for ``response.completed``, so it ends every stream, as vLLM ends them). A forced call (named, or each
of a ``"required"`` array's as its name is written) streams its arguments as they are generated; calls the
model chooses (a tool-call parser) go out whole after the message, so the items come in the whole
response's order. An item the limit cut closes
``incomplete``. Each event has a ``sequence_number``, counting from 0.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

from kvforge.reasoning import ANSWER
from kvforge.server import protocol
from kvforge.server.async_engine import SERVER_FAILURES
from kvforge.server.event_stream import event_stream
from kvforge.server.reasoning_split import reasoning_stream, split_reasoning
from kvforge.server.responses import (
    ResponseParts,
    call_item,
    final_status,
    item_id,
    message_item,
    output_items,
    output_text,
    response_object,
    response_usage,
)
from kvforge.server.tool_calls import array_calls
from kvforge.server.tool_parsers import parse_calls, stream_calls

logger = logging.getLogger(__name__)


def _calls(req, answer: str) -> tuple[str, list[tuple[str, str]]]:
    """(the text left as the message, the calls) of a whole answer."""
    if req.tool_choice is not None:
        calls = req.tool_choice.calls(answer)
        if calls is None:  # a "required" array cut before its first call's name: the text stays
            return answer, []
        return "", [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    if req.tool_parser is not None:
        return parse_calls(req.tool_parser, answer, req.parallel_tool_calls)
    return answer, []


def _reasoning_tokens(req, final) -> int:
    if req.reasoning is None:
        return 0
    return req.reasoning.reasoning_token_count(final.prompt_token_ids, final.outputs[0].token_ids)


def _parts(req, final) -> ResponseParts:
    comp = final.outputs[0]
    reasoning, answer = None, comp.text
    if req.reasoning is not None:
        reasoning, answer = split_reasoning(req.reasoning.parser, comp.text,
                                            req.reasoning.opening_phase(final.prompt_token_ids))
    text, calls = _calls(req, answer)
    # whether the reasoning ended before the output did: its closing tag, or (harmony) an answer message
    closed = reasoning is not None and (bool(answer) if req.reasoning.parser.harmony
                                        else req.reasoning.parser.end in comp.text)
    if not req.include_reasoning:
        reasoning = None
    last_open = req.tool_choice is not None and req.tool_choice.last_call_open(answer)
    return ResponseParts(reasoning or None, closed, text, calls, last_open, comp.finish_reason == "length")


def _usage(req, final) -> dict:
    comp = final.outputs[0]
    return response_usage(len(final.prompt_token_ids), len(comp.token_ids), final.num_cached_tokens,
                          _reasoning_tokens(req, final))


async def collect_response(req, meta, stream, model_name: str, on_done=None) -> web.Response:
    """The whole Response of ``stream``; ``on_done`` (if given) gets it before it is sent."""
    final = await stream.final_output()
    parts = _parts(req, final)
    status = final_status(final.outputs[0].finish_reason)
    body = response_object(item_id("resp"), protocol.now(), model_name, meta, req.params, status,
                           output_items(parts), _usage(req, final))
    if on_done is not None:
        on_done(body)
    return web.json_response(body)


class _EventWriter:
    """Numbered server-sent events of one response."""

    def __init__(self, resp: web.StreamResponse):
        self.resp = resp
        self.number = 0

    async def send(self, kind: str, **fields) -> None:
        event = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        await self.resp.write(f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode())


class _StreamedItems:
    """The output items a stream has opened, in order, and the open one's text."""

    def __init__(self, events: _EventWriter):
        self.events = events
        self.items: list[dict] = []
        self.open: dict | None = None
        self.text = ""

    @property
    def index(self) -> int:
        return len(self.items) - 1

    async def close(self, status: str = "completed") -> None:
        """Close the open item with ``status`` (``incomplete`` where the limit cut it)."""
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": self.index}
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            await self.events.send("response.reasoning_text.done", **where, content_index=0, text=self.text)
            await self.events.send("response.content_part.done", **where, content_index=0, part=part)
            item.update(content=[part], status=status)
        elif item["type"] == "message":
            await self.events.send("response.output_text.done", **where, content_index=0, text=self.text,
                                   logprobs=[])
            await self.events.send("response.content_part.done", **where, content_index=0,
                                   part=output_text(self.text))
            item.update(content=[output_text(self.text)], status=status)
        else:
            await self.events.send("response.function_call_arguments.done", **where, arguments=self.text)
            item.update(arguments=self.text, status=status)
        await self.events.send("response.output_item.done", output_index=self.index, item=item)

    async def add(self, kind: str, delta: str, name: str | None = None) -> None:
        """``delta`` of an item of ``kind`` (reasoning, message or function_call), opening it when the open
        item is another (a new call always opens its own)."""
        if self.open is None or self.open["type"] != kind or (kind == "function_call" and name is not None):
            await self.close()
            if kind == "reasoning":
                item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                        "status": "in_progress"}
            elif kind == "message":
                item = message_item(item_id("msg"), "", "in_progress")
            else:
                item = call_item(item_id("fc"), item_id("call"), name or "", "", "in_progress")
            self.items.append(item)
            self.open, self.text = item, ""
            await self.events.send("response.output_item.added", output_index=self.index, item=dict(item))
            where = {"item_id": item["id"], "output_index": self.index, "content_index": 0}
            if kind == "reasoning":
                await self.events.send("response.content_part.added", **where,
                                       part={"type": "reasoning_text", "text": ""})
            elif kind == "message":
                await self.events.send("response.content_part.added", **where, part=output_text(""))
        if not delta:
            return
        self.text += delta
        where = {"item_id": self.open["id"], "output_index": self.index}
        if kind == "reasoning":
            await self.events.send("response.reasoning_text.delta", **where, content_index=0, delta=delta)
        elif kind == "message":
            await self.events.send("response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[])
        else:
            await self.events.send("response.function_call_arguments.delta", **where, delta=delta)


async def stream_response(request: web.Request, req, meta, stream, model_name: str,
                          on_done=None) -> web.StreamResponse:
    """The event stream of ``stream``; ``on_done`` (if given) gets the whole Response before its last event."""
    return await event_stream(request, lambda resp: _stream_events(resp, req, meta, stream, model_name, on_done))


async def _stream_events(resp: web.StreamResponse, req, meta, stream, model_name: str, on_done) -> None:
    """Write the events of ``stream`` to the prepared ``resp`` and end it; raises ConnectionResetError once
    the client is gone."""
    events = _EventWriter(resp)
    response_id, created = item_id("resp"), protocol.now()
    shell = response_object(response_id, created, model_name, meta, req.params, "in_progress", [], None)
    items = _StreamedItems(events)
    try:
        await events.send("response.created", response=shell)
        await events.send("response.in_progress", response=shell)
        thinking = None
        parser = stream_calls(req.tool_parser, req.parallel_tool_calls) if req.tool_parser is not None else None
        named = req.tool_choice is not None and req.tool_choice.name is not None
        answer_sent = 0
        args_sent: list[int] = []  # "required": per call begun, characters of its arguments sent
        final = None
        found: list[tuple[str, str]] = []  # calls a parser found, sent after the message
        async for out in stream:
            final = out
            text = out.outputs[0].text
            if req.reasoning is not None:
                if thinking is None:
                    thinking = reasoning_stream(req.reasoning.parser, req.reasoning.opening_phase(out.prompt_token_ids))
                reasoning, text = (thinking.finish if out.finished else thinking.feed)(text)
                if reasoning and req.include_reasoning:
                    await items.add("reasoning", reasoning)
            if req.tool_choice is not None and req.tool_choice.harmony:  # gpt-oss: its one call, once addressed
                call = req.tool_choice.harmony_call(text)
                if call is not None and not args_sent:
                    await items.add("function_call", call[1], call[0])
                    args_sent.append(len(call[1]))
                elif call is not None and len(call[1]) > args_sent[0]:
                    await items.add("function_call", call[1][args_sent[0]:])
                    args_sent[0] = len(call[1])
            elif named:  # the answer is the call's arguments, streamed as they come
                called = any(i["type"] == "function_call" for i in items.items)
                if len(text) > answer_sent or (out.finished and not called):
                    await items.add("function_call", text[answer_sent:], None if called else req.tool_choice.name)
                    answer_sent = len(text)
            elif req.tool_choice is not None:  # "required": each call as its name is written
                calls = array_calls(text)
                for k, (name, arguments, _) in enumerate(calls):
                    if k == len(args_sent):  # the calls before it are whole: their last pieces went out
                        await items.add("function_call", arguments, name)
                        args_sent.append(len(arguments))
                    elif len(arguments) > args_sent[k]:  # the open call (only the last can grow)
                        await items.add("function_call", arguments[args_sent[k]:])
                        args_sent[k] = len(arguments)
                if out.finished and not calls and text:
                    await items.add("message", text)
            elif parser is not None:
                content, calls = parser.finish(text) if out.finished else parser.feed(text)
                if content:
                    await items.add("message", content)
                found += calls
            elif len(text) > answer_sent:
                await items.add("message", text[answer_sent:])
                answer_sent = len(text)
        cut = "incomplete" if final.outputs[0].finish_reason == "length" else "completed"
        if req.tool_choice is not None and items.open is not None and items.open["type"] == "function_call":
            # a forced call is incomplete exactly where its arguments are (the limit or a stop string)
            await items.close("incomplete" if req.tool_choice.last_call_open(text) else "completed")
        if found:  # the message (what the parser left as content) first, then the calls, each whole
            if items.open is not None:
                await items.close(cut)
            for name, arguments in found:
                await items.add("function_call", arguments, name)
                await items.close()
        if not any(i["type"] in ("message", "function_call") for i in items.items):
            if items.open is not None:  # a think block the limit cut (or one that closed on an empty answer)
                await items.close(cut if thinking is None or thinking.phase != ANSWER else "completed")
            await items.add("message", "")  # an output with no answer still has its (empty) message
        await items.close(cut)
        status = final_status(final.outputs[0].finish_reason)
        whole = response_object(response_id, created, model_name, meta, req.params, status, items.items,
                                _usage(req, final))
        if on_done is not None:
            on_done(whole)
        # response.completed even when the status is incomplete: the openai SDK's stream helpers end on it
        await events.send("response.completed", response=whole)
    except tuple(SERVER_FAILURES) as e:  # shutdown, a dead engine, a refused sample: as the other routes answer
        _, _, code = SERVER_FAILURES[type(e)]
        await events.send("error", code=code, message=str(e), param=None)
    except ConnectionResetError:
        raise
    except Exception as e:  # the stream has begun: the error goes out as an event
        logger.exception("response stream %s failed", response_id)
        await events.send("error", code="internal_error", message=f"{type(e).__name__}: {e}", param=None)
    await resp.write_eof()

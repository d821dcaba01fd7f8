"""OpenAI's Responses API, ``POST /v1/responses``, served as a chat completion: a request is translated into
a chat body (:func:`chat_body`), parsed and run as the chat route runs it, and its one choice is written
as a Response object (:func:`response_object`) or as the API's event stream
(kvforge/server/responses_output.py).

The request: ``input`` (a string, or a list of items: messages with ``input_text`` / ``output_text`` parts
or string content, ``function_call`` items and the ``function_call_output`` answering each, ``reasoning`` items, handed
to the template with the assistant turn that follows them, as chat messages' ``reasoning_content``); ``instructions`` (a system message before the input); ``max_output_tokens``; the sampling
fields; ``text.format`` (``text``, ``json_object``, ``json_schema``); function ``tools`` (flat, as the API
declares them) with ``tool_choice``; ``previous_response_id`` where the server keeps responses
(kvforge/server/responses_store.py). ``conversation``, a stored ``prompt`` and ``background`` are refused. Fields that would change the
output and are not served (``include`` of logprobs or encrypted reasoning, ``top_logprobs``,
``max_tool_calls``, ``n`` other than 1, the chat name ``max_tokens``) are refused naming them.

The response's ``output`` holds, in order: a ``reasoning`` item (under ``--reasoning-parser``, where the
model reasoned), a ``message`` item with the answer as one ``output_text`` part (left out when the model
called tools and said nothing else), and a ``function_call`` item per call. ``status`` is
``incomplete`` (``incomplete_details.reason`` ``max_output_tokens``) where the output was cut by the limit,
and so is each item the cut left unfinished: the message, a named call's arguments, a think block that
never closed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvforge.errors import InvalidRequestError
from kvforge.server.protocol import (
    REASONING_EFFORTS,
    NeutralOnly,
    check_passthrough_fields,
    get_int,
    now,
    refuse_unless_neutral,
)
from kvforge.server.request_fields import (
    bad_field,
    check_body,
    get_array,
    get_bool,
    get_object,
    get_string,
    get_typed,
    shown,
    type_name,
)
from kvforge.server.responses_store import ResponsesStore

#: Fields a Responses body may carry (others are logged as ignored by the chat parser's check).
RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "text", "tools",
    "tool_choice", "parallel_tool_calls", "store", "metadata", "user", "previous_response_id", "background",
    "truncation", "include", "service_tier", "safety_identifier", "prompt_cache_key", "conversation", "prompt",
    "top_logprobs", "max_tool_calls", "n", "max_tokens",
    # vLLM's extra sampling fields, as on the chat route
    "seed", "top_k", "min_p", "stop", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "logit_bias", "min_tokens", "skip_special_tokens", "priority", "chat_template_kwargs", "include_reasoning",
    "reasoning",
})
#: Chat field names as a Responses client knows them, for errors the chat parser raises.
_FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format.json_schema": "text.format",
                "response_format": "text.format", "messages": "input"}


@dataclass(frozen=True)
class ResponsesRequest:
    """What the Response object repeats of its request."""

    instructions: str | None
    max_output_tokens: int | None
    text_format: dict
    tools: list
    tool_choice: Any
    parallel_tool_calls: bool
    metadata: dict
    user: str | None
    previous_response_id: str | None = None
    store: bool = False  # the response is stored (the server keeps responses, and the request did not say no)
    reasoning_effort: str | None = None


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        bad_field(where, f"expected a string or an array of content parts, got {type_name(content)}")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict):
            bad_field(f"{where}[{k}]", f"expected a content part (an object), got {type_name(part)}")
        kind = part.get("type")
        if kind not in ("input_text", "output_text", "text", "refusal"):
            bad_field(f"{where}[{k}].type", f"only text parts (input_text, output_text, refusal) are supported, got "
                                            f"{shown(kind)}")
        key = "refusal" if kind == "refusal" else "text"  # a replayed assistant refusal: its text
        if not isinstance(part.get(key), str):
            bad_field(f"{where}[{k}].{key}", f"expected a string, got {type_name(part.get(key))}")
        texts.append(part[key])
    return "\n".join(texts)


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's text: its ``content`` (reasoning_text parts), else its ``summary``."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if not parts:
            continue
        if not isinstance(parts, list) or not all(isinstance(part, dict) and part.get("type") == part_type
                                                  and isinstance(part.get("text"), str) for part in parts):
            bad_field(f"{where}.{key}", f"expected an array of {part_type} parts")
        return "\n".join(part["text"] for part in parts)
    return ""


def input_messages(items: Any, where: str = "input", earlier: Iterable[dict] = ()) -> list[dict]:
    """The chat messages of a Responses ``input`` (or of a stored response's ``output``, whose items have the
    same shapes): a string is one user message. A reasoning item goes with the assistant turn that follows it
    (its text as the message's ``reasoning_content``, which templates may show again); one that no assistant
    turn follows is dropped. Each call id comes once, and each ``function_call_output`` answers a call made
    before it and not yet answered, here or in ``earlier`` (the chat messages of the conversation this input
    continues)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        bad_field(where, "is required: a string, or a non-empty array of input items")
    messages: list[dict] = []
    earlier = list(earlier)
    calls = {call["id"] for message in earlier for call in message.get("tool_calls") or ()}
    answered = {message.get("tool_call_id") for message in earlier if message["role"] == "tool"}
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they lead to

    def assistant_turn(message: dict) -> dict:
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        messages.append(message)
        return message

    for i, item in enumerate(items):
        if not isinstance(item, dict):
            bad_field(f"{where}[{i}]", f"expected an object, got {type_name(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                bad_field(f"{where}[{i}].role", f"must be user, assistant, system or developer, got {shown(role)}")
            message = {"role": role, "content": _content_text(item.get("content"), f"{where}[{i}].content")}
            if role == "assistant":
                assistant_turn(message)
            else:
                reasoning.clear()
                messages.append(message)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    bad_field(f"{where}[{i}].{key}", "must be a string")
            if item["call_id"] in calls:
                bad_field(f"{where}[{i}].call_id", f"a function_call with call_id {shown(item['call_id'])} is in "
                                                   f"the conversation already (a chained response holds its own "
                                                   f"calls): send each call once")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            calls.add(item["call_id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:  # one turn: one message
                last.setdefault("tool_calls", []).append(call)
            else:
                assistant_turn({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                bad_field(f"{where}[{i}].call_id", "must be a string")
            if item["call_id"] not in calls:
                bad_field(f"{where}[{i}].call_id", f"no function_call with call_id {shown(item['call_id'])} comes "
                                                   f"before this output: send the call item first")
            if item["call_id"] in answered:
                bad_field(f"{where}[{i}].call_id", f"the call {shown(item['call_id'])} has its output already: "
                                                   f"send one function_call_output a call")
            answered.add(item["call_id"])
            reasoning.clear()
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _content_text(item.get("output"), f"{where}[{i}].output")})
        elif kind == "reasoning":
            text = _reasoning_text(item, f"{where}[{i}]")
            if text:
                reasoning.append(text)
        else:
            bad_field(f"{where}[{i}].type", f"items of type {shown(kind)} are not supported (message, function_call, "
                                            f"function_call_output and reasoning are)")
    return messages


def with_template_effort(meta: ResponsesRequest, options) -> ResponsesRequest:
    """``meta`` repeating the reasoning effort the template gets (``options``: the parsed chat's
    ChatTemplateOptions), which ``chat_template_kwargs`` or the server's default template variables may set
    where ``reasoning.effort`` does not."""
    effort = dict(options.template_kwargs).get("reasoning_effort")
    if effort in REASONING_EFFORTS and effort != meta.reasoning_effort:
        return dataclasses.replace(meta, reasoning_effort=effort)
    return meta


def _reasoning_effort(body: dict) -> str | None:
    """``reasoning.effort``, which runs as the chat route's ``reasoning_effort``. ``reasoning.summary`` is
    accepted and has no effect: a reasoning item carries the reasoning itself, with an empty summary."""
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        bad_field("reasoning", f"expected an object ({{\"effort\": ...}}), got {type_name(reasoning)}")
    unknown = sorted(set(reasoning) - {"effort", "summary", "generate_summary"})
    if unknown:
        bad_field(f"reasoning.{unknown[0]}", "is not a reasoning option (effort and summary are)")
    if reasoning.get("effort") is not None and reasoning["effort"] not in REASONING_EFFORTS:
        bad_field("reasoning.effort", f"must be one of {', '.join(REASONING_EFFORTS)}, got {shown(reasoning['effort'])}")
    return reasoning.get("effort")


def _system(body: dict) -> list[dict]:
    instructions = body.get("instructions")
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        bad_field("instructions", f"expected a string, got {type_name(instructions)}")
    return [{"role": "system", "content": instructions}]


def _tools(body: dict) -> list[dict] | None:
    """The API's flat function tools as chat tools."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        bad_field("tools", f"expected an array of tools, got {type_name(tools)}")
    chat = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type_name(tool)
            bad_field(f"tools[{i}]", f"only function tools are served, got {shown(kind)}")
        if isinstance(tool.get("function"), dict):
            bad_field(f"tools[{i}]", 'Responses tools are flat: {"type": "function", "name": ..., "parameters": '
                                     '{...}}, not the chat route\'s {"type": "function", "function": {...}}')
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        chat.append({"type": "function", "function": function})
    return chat


def _tool_choice(body: dict) -> Any:
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            bad_field("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...}')
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _text_format(body: dict) -> dict:
    text = body.get("text")
    if text is None:
        return {"type": "text"}
    if not isinstance(text, dict):
        bad_field("text", f"expected an object, got {type_name(text)}")
    fmt = text.get("format", {"type": "text"})
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        bad_field("text.format", 'must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                                 '"name": ..., "schema": {...}}')
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            bad_field("text.format.name", "is required: the schema's name, a string")
        if not isinstance(fmt.get("schema"), dict):
            bad_field("text.format.schema", "is required: a JSON schema object")
    return fmt


#: Fields whose request the server cannot honour, each accepted only at the value that asks nothing.
_UNSERVED = {
    "conversation": NeutralOnly(lambda body, name, default: get_typed(body, name, default, "string", "object"),
                                None, "conversations are not stored: send the whole conversation as 'input' (or "
                                      "chain responses with previous_response_id on a server with "
                                      "--responses-store-size)"),
    "prompt": NeutralOnly(get_object, None, "stored prompts are not served: send the instructions and input "
                                            "themselves"),
    "background": NeutralOnly(get_bool, False, "background responses are not served: leave it false"),
    "max_tool_calls": NeutralOnly(get_int, None, "is not served: the model calls as many tools as it writes "
                                                 "(parallel_tool_calls false keeps one)"),
    "top_logprobs": NeutralOnly(get_int, 0, "logprobs are not returned by /v1/responses: use "
                                            "/v1/chat/completions"),
    "max_tokens": NeutralOnly(get_int, None, "is the chat route's name: send max_output_tokens"),
    "n": NeutralOnly(get_int, 1, "a response has one output: send n requests, or use /v1/chat/completions"),
    "include": NeutralOnly(get_array, [], "nothing extra is returned (no logprobs, no encrypted reasoning): "
                                          "leave it unset"),
    "truncation": NeutralOnly(get_string, "disabled", "only disabled is served: a prompt longer than the context "
                                                      "is refused"),
}


def _refuse_unserved(body: dict) -> None:
    """Fields whose request the server cannot honour, each refused naming it (:data:`_UNSERVED`)."""
    refuse_unless_neutral(body, _UNSERVED)
    check_passthrough_fields(body)


def chat_body(body: Any, store: ResponsesStore | None = None) -> tuple[dict, ResponsesRequest, list[dict]]:
    """The chat completion body that runs a Responses ``body``, what the response repeats of it, and the
    conversation it continues (without the instructions: those of a previous response are not carried
    over, as OpenAI's API has it); InvalidRequestError naming the Responses field at fault. ``store``: the
    stored responses ``previous_response_id`` may name (None: none are stored)."""
    check_body(body)
    _refuse_unserved(body)
    prior: list[dict] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if store is None:
            bad_field("previous_response_id", "responses are not stored on this server: send the whole "
                                              "conversation as 'input', or start it with --responses-store-size N")
        stored = store.get(previous) if isinstance(previous, str) else None
        if stored is None:
            bad_field("previous_response_id", f"no stored response has the id {shown(previous)} (the store keeps "
                                              f"the last {store.capacity}; a deleted one is gone)")
        prior = list(stored.history)
    chat = {key: body[key] for key in ("model", "temperature", "top_p", "stream", "seed", "top_k", "min_p", "stop",
                                       "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
                                       "min_tokens", "skip_special_tokens", "priority", "chat_template_kwargs",
                                       "include_reasoning", "parallel_tool_calls") if key in body}
    history = [*prior, *input_messages(body.get("input"), earlier=prior)]
    if not history:
        bad_field("input", "holds no message to answer")
    chat["messages"] = [*_system(body), *history]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    fmt = _text_format(body)
    if fmt["type"] == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt["type"] == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    effort = _reasoning_effort(body)
    if effort is not None:
        chat["reasoning_effort"] = effort
    tools = _tools(body)
    if tools is not None:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body)
    meta = ResponsesRequest(body.get("instructions"), body.get("max_output_tokens"), fmt,
                            list(body.get("tools") or []), body.get("tool_choice", "auto"),
                            body.get("parallel_tool_calls", True) is not False, body.get("metadata") or {},
                            body.get("user"), previous, store is not None and body.get("store") is not False,
                            effort)
    return chat, meta, history


def responses_field(error: InvalidRequestError) -> InvalidRequestError:
    """``error`` from the chat parser with its field named as the Responses body names it."""
    field = error.field
    if field is None:
        return error
    for chat_name, name in _FIELD_NAMES.items():  # the longest names first
        if field == chat_name or field.startswith((chat_name + ".", chat_name + "[")):
            field = name + field[len(chat_name):]
            break
    field = field.replace(".function.", ".")
    message = str(error).replace(error.field, field) if error.field != field else str(error)
    for chat_name in ("response_format.json_schema", "response_format", "max_completion_tokens"):
        message = message.replace(chat_name, _FIELD_NAMES[chat_name])  # the chat names a message may give
    message = message.replace('{"type": "function", "function": {"name": ...}}', '{"type": "function", "name": ...}')
    if error.field == "messages":  # the whole prompt (its length): the instructions are part of it
        message = message.replace("the prompt has", "the prompt (the instructions, any earlier turns and the input "
                                                     "together) has", 1)
    return InvalidRequestError(message, field=field)


@dataclass
class ResponseParts:
    """One response's output: reasoning (and whether its think block closed), the answer text, calls (name,
    arguments; ``last_call_open``: the last call's arguments are unfinished, as a forced call's are where the
    limit or a stop string ends the output inside them: that item is ``incomplete``), and whether the limit
    cut the output."""

    reasoning: str | None
    reasoning_closed: bool
    text: str
    calls: list[tuple[str, str]]
    last_call_open: bool
    cut: bool


def output_items(parts: ResponseParts) -> list[dict]:
    """The ``output`` array of ``parts``; an item the cut left unfinished is ``incomplete``."""
    def status(finished: bool) -> str:
        return "completed" if finished or not parts.cut else "incomplete"

    items = []
    if parts.reasoning:
        items.append({"id": item_id("rs"), "type": "reasoning", "summary": [],
                      "content": [{"type": "reasoning_text", "text": parts.reasoning}],
                      "status": status(parts.reasoning_closed)})
    if parts.text or not parts.calls:
        items.append(message_item(item_id("msg"), parts.text, status(False)))
    for k, (name, arguments) in enumerate(parts.calls):
        last = k == len(parts.calls) - 1
        items.append(call_item(item_id("fc"), item_id("call"), name, arguments,
                               "incomplete" if last and parts.last_call_open else "completed"))
    return items


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)] if status != "in_progress" else []}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def input_items(items: Any) -> list[dict]:
    """A checked Responses ``input`` as the API lists it back (``GET /v1/responses/{id}/input_items``): items
    with ids (the client's, else new ones) and ``completed`` status, a string as one user message."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    listed = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            parts = item.get("content")
            if isinstance(parts, str):
                parts = [{"type": "text", "text": parts}]
            content = [_listed_part(part, item["role"]) for part in parts]
            listed.append({"id": item.get("id") or item_id("msg"), "type": "message", "role": item["role"],
                           "content": content, "status": "completed"})
        elif kind == "function_call":
            listed.append(call_item(item.get("id") or item_id("fc"), item["call_id"], item["name"],
                                    item["arguments"], "completed"))
        elif kind == "function_call_output":
            listed.append({"id": item.get("id") or item_id("fco"), "type": "function_call_output",
                           "call_id": item["call_id"], "output": _content_text(item.get("output"), "input"),
                           "status": "completed"})
        else:  # reasoning, as sent
            listed.append({**item, "id": item.get("id") or item_id("rs")})
    return listed


def _listed_part(part: dict, role: str) -> dict:
    """One checked content part as the API lists it: an assistant's as output (text or refusal), others as
    input text."""
    if part["type"] == "refusal":
        return {"type": "refusal", "refusal": part["refusal"]}
    return output_text(part["text"]) if role == "assistant" else {"type": "input_text", "text": part["text"]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def item_id(prefix: str) -> str:
    """A new id of an output item (or of a response: ``resp``), as the API spells them: ``msg_<hex>``."""
    import uuid

    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(response_id: str, created: int, model: str, meta: ResponsesRequest, params, status: str,
                    output: list[dict], usage: dict | None) -> dict:
    """A Response object: its request's settings, ``status`` (in_progress, completed, incomplete) and
    ``output``."""
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": meta.instructions, "max_output_tokens": meta.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": meta.parallel_tool_calls,
        "previous_response_id": meta.previous_response_id, "store": meta.store,
        "reasoning": None if meta.reasoning_effort is None else {"effort": meta.reasoning_effort, "summary": None},
        "temperature": params.temperature, "text": {"format": meta.text_format},
        "tool_choice": meta.tool_choice, "tools": meta.tools, "top_p": params.top_p, "truncation": "disabled",
        "usage": usage, "user": meta.user, "metadata": meta.metadata,
        "completed_at": now() if status in ("completed", "incomplete") else None,
    }


def response_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def final_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"

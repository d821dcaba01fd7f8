"""OpenAI request parsing and response shapes for the HTTP server.

Every parse error is an ``InvalidRequestError`` whose ``field`` names the
request field at fault; ``error_body`` renders it as OpenAI's error JSON.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvforge.engine.logprob import Logprob, token_text
from kvforge.engine.sampling_params import MAX_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParams, is_decimal_id
from kvforge.errors import InvalidRequestError
from kvforge.reasoning import ReasoningTokens
from kvforge.server.request_fields import (
    bad_field,
    check_body,
    get_array,
    get_bool,
    get_string,
    get_typed,
    shown,
    type_name,
)
from kvforge.server.tool_calls import ToolChoice, parse_tools, template_message, with_tools
from kvforge.server.tool_parsers import KEEPS_SPECIAL_TOKENS
from kvforge.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_STOP_SEQUENCES = 16
MAX_PROMPTS_PER_REQUEST = 1024
MAX_N = 128  # choices per prompt (OpenAI's limit for ``n``)
MAX_SEQUENCES_PER_REQUEST = 1024  # prompts x n


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this server does not serve (HTTP 404, code ``model_not_found``)."""

    def __init__(self, model: str, served: str | tuple[str, ...]):
        listed = ", ".join(json.dumps(n) for n in served_names(served))
        super().__init__(f"the model {shown(model)} does not exist; this server serves {listed}", field="model")
        self.model = model


def served_names(served: str | tuple[str, ...]) -> tuple[str, ...]:
    """The names a server answers to (``--served-model-name A B``: both), the one it reports first."""
    return (served,) if isinstance(served, str) else tuple(served)


def check_model(model: Any, served: str | tuple[str, ...]) -> str:
    """A request's ``model`` (absent or null: the reported name) if this server serves it, else 404."""
    names = served_names(served)
    if model is None:
        return names[0]
    if not isinstance(model, str):
        bad_field("model", f"expected a string, got {type_name(model)}")
    if model not in names:
        raise ModelNotFoundError(model, names)
    return model


def model_object(model_name: str, created: int, max_model_len: int, root: str | None = None) -> dict:
    """OpenAI's model object (``GET /v1/models`` lists it, ``GET /v1/models/{id}`` returns it), with vLLM's
    ``root`` (the served model every name stands for), ``parent`` and ``permission``."""
    return {"id": model_name, "object": "model", "created": created, "owned_by": "kvforge",
            "root": root or model_name, "parent": None, "max_model_len": max_model_len, "permission": []}


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# -- typed field access ---------------------------------------------------------

_MISSING = object()


def decode_json_body(raw: bytes) -> Any:
    """The request body as JSON. Malformed JSON, nesting too deep for the parser, and strings holding
    a lone UTF-16 surrogate (``"\\ud800"``: valid JSON, but no text a tokenizer can take) are
    InvalidRequestErrors; the last names where the string is."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidRequestError(f"malformed JSON body: {e}", field="body") from e
    except RecursionError as e:
        raise InvalidRequestError("malformed JSON body: nested too deeply", field="body") from e
    where = _lone_surrogate_path(body)
    if where is not None:
        bad_field(where, "holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); send valid Unicode text")
    return body


def _lone_surrogate_path(value: Any) -> str | None:
    """The path (``prompt[1]``, ``messages[0].content``) of a string value, or of the object holding a
    key, that is not encodable as UTF-8, else None. Iterative, so any nesting the parser accepted is
    walked."""
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:
        path, v = pending.pop()
        if isinstance(v, str) and not _is_utf8_text(v):
            return path or "body"
        if isinstance(v, dict):
            for k, item in v.items():
                if not _is_utf8_text(k):
                    return path or "body"
                pending.append((f"{path}.{k}" if path else k, item))
        elif isinstance(v, list):
            # Only strings and containers can hold text: a long token-id array costs no path strings.
            pending.extend((f"{path}[{i}]", item) for i, item in enumerate(v) if isinstance(item, (str, list, dict)))
    return None


def _is_utf8_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def get_number(body: dict, name: str, default, *, allow_null: bool = True):
    value = body.get(name, _MISSING)
    if value is _MISSING or (value is None and allow_null):
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        bad_field(name, f"expected a number, got {type_name(value)}")
    try:
        number = float(value)  # an integer literal past float's range overflows here
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        bad_field(name, "expected a finite number")
    return number


#: Every integer field of a request (counts, token ids, seeds) fits a signed 64-bit integer.
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1


def get_int(body: dict, name: str, default):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        bad_field(name, f"expected an integer, got {type_name(value)}")
    if not INT_MIN <= value <= INT_MAX:
        shown = str(value) if len(str(value)) <= 24 else f"an integer of {len(str(abs(value)))} digits"
        bad_field(name, f"expected a signed 64-bit integer (in [{INT_MIN}, {INT_MAX}]), got {shown}")
    return value


def get_int_list(body: dict, name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad_field(name, "expected an array of integers")
    return value


def get_stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        bad_field("stop", "expected a string or an array of strings")
    if len(value) > MAX_STOP_SEQUENCES:
        bad_field("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences are supported")
    if any(not s for s in value):
        bad_field("stop", "stop sequences must be non-empty")
    return value


def get_string_list(body: dict, name: str) -> list[str]:
    value = get_array(body, name, [])
    for item in value:
        if not isinstance(item, str):
            bad_field(name, f"expected an array of strings, got an entry of type {type_name(item)}")
    return value


# -- requests -------------------------------------------------------------------


#: Template variables a request's ``chat_template_kwargs`` may not set (the request's own fields do).
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt"})
#: OpenAI's ``reasoning_effort`` values; the request's value reaches the chat template as the variable
#: ``reasoning_effort`` (gpt-oss's template writes it into its system message; templates that do not read it
#: render as without it).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a conversation is rendered, from vLLM's chat request fields: ``add_generation_prompt`` (open an
    assistant turn after the messages), ``continue_final_message`` (the prompt ends inside the final
    assistant message, which the model continues; needs ``add_generation_prompt`` false) and
    ``chat_template_kwargs`` (extra template variables, e.g. ``enable_thinking``), as sorted pairs;
    ``content_format``: how message text reaches the template, ``"string"`` or ``"openai"`` (a list of one
    text part), None for the tokenizer's (``--chat-template-content-format``)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    content_format: str | None = None


def parse_chat_template_options(body: dict, messages: list[dict]) -> ChatTemplateOptions:
    """The rendering fields of a chat or ``/tokenize`` body, checked against its ``messages``. A
    request-level ``chat_template`` is refused: the server renders with the model's own template."""
    if body.get("chat_template") is not None:
        bad_field("chat_template", "per-request chat templates are not accepted: the server renders with the "
                                   "model's template (leave it unset)")
    add_generation_prompt = get_bool(body, "add_generation_prompt", True)
    continue_final = get_bool(body, "continue_final_message", False)
    if continue_final:
        if add_generation_prompt:
            bad_field("continue_final_message", "cannot be combined with add_generation_prompt true: send "
                                                "add_generation_prompt false to continue the final message")
        if messages[-1]["role"] != "assistant":
            bad_field("continue_final_message", f"needs an assistant message last, got a {messages[-1]['role']} "
                                                f"message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        bad_field("chat_template_kwargs", f"expected an object, got {type_name(kwargs)}")
    reserved = sorted(_RESERVED_TEMPLATE_VARS & set(kwargs))
    if reserved:
        bad_field("chat_template_kwargs", f"may not set {', '.join(reserved)} (the request's own fields set it)")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            bad_field("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}, got {shown(effort)}")
        kwargs = {"reasoning_effort": effort, **kwargs}  # chat_template_kwargs, where it sets one, wins
    return ChatTemplateOptions(add_generation_prompt, continue_final, tuple(sorted(kwargs.items())))


@dataclass
class ParsedRequest:
    """What the handlers need from a validated completion or chat request."""

    kind: str  # "completion" | "chat"
    model: str
    prompts: list[str | list[int]] | None  # completion prompts (text or token ids), n choices each
    messages: list[dict] | None  # chat messages
    params: SamplingParams
    max_tokens_explicit: bool  # False: the server fills in the remaining context
    stream: bool
    include_usage: bool
    logprobs: int | None  # completions: top-N; chat: top_logprobs when logprobs=true
    chat_logprobs: bool
    max_tokens_field: str = "max_tokens"
    echo: bool = False  # completions: the prompt (and its logprobs) leads each choice
    # completions with echo and max_tokens=0: nothing is generated (the engine scores the prompt's last token
    # as its one sampled token, kvforge/server/async_engine.py), so the prompt may fill the context.
    prompt_only: bool = False
    chat_options: ChatTemplateOptions | None = None  # chat: how the messages are rendered
    tool_choice: ToolChoice | None = None  # chat: a forced tool call (kvforge/server/tool_calls.py)
    constraint_field: str | None = None  # the field an error about params.structured_outputs names
    tool_parser: str | None = None  # chat: the parser of the calls the model may make (tool_choice "auto")
    parallel_tool_calls: bool = True  # chat, OpenAI's field: False keeps only the first call the parser finds
    continuous_usage: bool = False  # streams: usage so far in every chunk (stream_options.continuous_usage_stats)
    # vLLM's ``return_tokens_as_token_ids``: logprobs name tokens as "token_id:N" (always so without a tokenizer)
    tokens_as_ids: bool = False
    # vLLM's ``return_token_ids``: choices carry their generated ``token_ids`` (and the prompt's ids)
    return_token_ids: bool = False
    # chat under --reasoning-parser: the think-block tags (kvforge/reasoning.py), None otherwise
    reasoning: ReasoningTokens | None = None
    include_reasoning: bool = True  # vLLM's field: False drops the reasoning from the response
    priority: int = 0  # vLLM's field: the order under --scheduling-policy priority (lower first)
    # vLLM's ``prompt_logprobs``: the alternatives each prompt token's entry holds (None: no entries)
    prompt_logprobs: int | None = None

    @property
    def n(self) -> int:
        """Independent choices per prompt (``params.n``); choice index = prompt position * n + sample number."""
        return self.params.n


#: Fields both generation routes read (or refuse), the sampling fields among them.
_COMMON_FIELDS = frozenset({
    "model", "n", "best_of", "seed", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "stop",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "min_tokens", "response_format",
    "tools", "functions", "tool_choice", "length_penalty", "use_beam_search", "bad_words", "prompt_logprobs",
    "truncate_prompt_tokens", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    "guided_whitespace_pattern", "guided_decoding_backend",
    "return_tokens_as_token_ids", "return_token_ids", "logits_processors", "add_special_tokens", "priority",
    # OpenAI's fields that do not change the output: accepted and not read.
    "user", "metadata", "store", "service_tier", "parallel_tool_calls",
})
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "max_tokens", "logprobs", "echo", "suffix"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "echo",
                                "add_generation_prompt", "continue_final_message", "chat_template", "function_call",
                                "chat_template_kwargs", "include_reasoning", "reasoning_effort"}


#: The ``stream_options`` fields the server reads.
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


#: At most this many ignored field names are logged per request, each cut to :data:`LOGGED_NAME_CHARS`.
LOGGED_NAMES, LOGGED_NAME_CHARS = 20, 64


def logged_names(names) -> str:
    """Client-chosen field names for one log line: escaped (a newline cannot forge a line), each cut short,
    and at most :data:`LOGGED_NAMES` of them."""
    names = sorted(str(n) for n in names)
    shown = [ascii(n[:LOGGED_NAME_CHARS])[1:-1] + ("..." if len(n) > LOGGED_NAME_CHARS else "")
             for n in names[:LOGGED_NAMES]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" (and {more} more)" if more else "")


def log_ignored_fields(body: dict, known: frozenset[str]) -> None:
    """Log the fields of ``body`` this route does not know as a warning (as vLLM logs them): a misspelt or
    unsupported field is then visible in the server log instead of silently without effect."""
    ignored = [k for k in body if k not in known]
    if ignored:
        logger.warning("fields present in the request but ignored: %s", logged_names(ignored))


@dataclass(frozen=True)
class NeutralOnly:
    """A request field served only at the value that changes nothing: ``read(body, name, default)``
    (get_bool, get_int, get_array, ...) checks its type and gives ``neutral`` for absent or null; any other
    value is refused with ``why``."""

    read: Callable[[dict, str, Any], Any]
    neutral: Any = None
    why: str = "is not supported (leave it unset)"


def refuse_unless_neutral(body: dict, fields: dict[str, NeutralOnly]) -> None:
    """Each of ``fields`` in ``body`` type-checked, and refused (400 naming it) at any value but its neutral one:
    a field that would change the output is never silently ignored."""
    for name, field in fields.items():
        if field.read(body, name, field.neutral) != field.neutral:
            bad_field(name, field.why)


#: vLLM's extra request fields that change the output, each at the value that leaves it unchanged; any other
#: value is refused like the OpenAI fields below.
_VLLM_EXTRAS_NEUTRAL = {
    "length_penalty": NeutralOnly(get_number, 1.0),
    "use_beam_search": NeutralOnly(get_bool, False),
    "logits_processors": NeutralOnly(get_array, []),
}
_NOT_ON_COMPLETIONS = "tool calls are a chat feature: send the request to /v1/chat/completions"
#: OpenAI's completion fields this server does not serve, each at the value that changes nothing.
_COMPLETION_NEUTRAL = {
    "suffix": NeutralOnly(get_string, ""),
    "tools": NeutralOnly(get_array, [], _NOT_ON_COMPLETIONS),
    "functions": NeutralOnly(get_array, [], _NOT_ON_COMPLETIONS),
}


#: vLLM's older request fields, each one constraint of StructuredOutputsParams.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def constraint_field(source: str, kind: str) -> str:
    """The request field to name in an error about its constraint of ``kind``, spelt as ``source``."""
    if source == "structured_outputs":
        return f"structured_outputs.{kind}"
    if source == "response_format":
        return "response_format.json_schema.schema" if kind == "json" else "response_format"
    return source


def parse_structured_outputs(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint from whichever of its three spellings it uses: OpenAI's
    ``response_format`` (``json_object``, or ``json_schema`` with its ``schema``), vLLM's ``structured_outputs``
    object, or vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, with
    the field an error about it names (:func:`constraint_field`). Two constraints at once are refused (400),
    as is a field xgrammar cannot honour."""
    found: list[tuple[str, dict]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            bad_field("response_format", 'must be an object with a "type": "text", "json_object" or "json_schema"')
        kind = fmt["type"]
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not (isinstance(spec.get("schema"), dict) or spec.get("schema") is True):
                bad_field("response_format.json_schema", 'must be an object holding the JSON schema as "schema" '
                                                         '(with "name" and "strict" as OpenAI spells them)')
            found.append(("response_format", {"json": spec["schema"]}))
        elif kind != "text":
            bad_field("response_format.type", f'must be "text", "json_object" or "json_schema", got {shown(kind)}')
    given = body.get("structured_outputs")
    if given is not None:
        if not isinstance(given, dict):
            bad_field("structured_outputs", f"expected an object, got {type_name(given)}")
        found.append(("structured_outputs", given))
    for name, constraint in _GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((name, {constraint: body[name]}))
    if body.get("guided_whitespace_pattern") is not None:
        bad_field("guided_whitespace_pattern", "is not supported: JSON outputs take any whitespace, or none but "
                                               "json.dumps's separators with structured_outputs.disable_any_whitespace")
    backend = get_string(body, "guided_decoding_backend", "auto")
    if backend not in ("auto", "xgrammar"):
        bad_field("guided_decoding_backend", f'only "xgrammar" (or "auto") is served here, got {shown(backend)}')
    if not found:
        return None, None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        bad_field(found[1][0], f"a request takes one output constraint, but {names} both give one: send one "
                               "of them")
    source, value = found[0]
    try:
        params = StructuredOutputsParams.from_value(value)
    except InvalidRequestError as e:
        if source == "structured_outputs":
            raise
        field = constraint_field(source, next(iter(value)))
        raise InvalidRequestError(str(e).replace(e.field or "", field, 1), field=field) from None
    return params, constraint_field(source, params.kind)


def _refuse_special_tokens_change(body: dict, route_default: bool) -> None:
    """``add_special_tokens`` only at the route's own rule (completions add the tokenizer's special tokens to
    a text prompt, chat renders them through its template): any other value would change the prompt."""
    refuse_unless_neutral(body, {"add_special_tokens": NeutralOnly(
        get_bool, route_default, f"only {shown(route_default)} (this route's rule) is supported")})


#: OpenAI's string fields that change no output: accepted and not read, but a string when given.
PASSTHROUGH_STRINGS: tuple[str, ...] = ("user", "safety_identifier", "prompt_cache_key", "service_tier")


def check_passthrough_fields(body: dict) -> None:
    """OpenAI's fields that change no output still have their types: :data:`PASSTHROUGH_STRINGS` strings,
    ``store`` a bool, ``metadata`` an object of string values (a 400 naming the field otherwise, as OpenAI's
    API answers)."""
    for name in PASSTHROUGH_STRINGS:
        get_string(body, name, None)
    get_bool(body, "store", None)
    for key, value in get_typed(body, "metadata", {}, "object").items():
        if not isinstance(value, str):
            bad_field(f"metadata.{key}", f"values are strings, got {type_name(value)}")


def _common(body: dict, served_model: str | tuple[str, ...], defaults: dict | None = None) -> dict:
    """The fields both routes read; ``defaults``: the model's default sampling fields (its generation config)
    for those the request does not set."""
    defaults = defaults or {}
    check_body(body)
    model = check_model(body.get("model"), served_model)
    check_passthrough_fields(body)
    n = get_int(body, "n", 1)
    if not 1 <= n <= MAX_N:
        bad_field("n", f"must be an integer in [1, {MAX_N}], got {n}")
    best_of = get_int(body, "best_of", None)
    if best_of is not None and best_of != n:
        bad_field("best_of", f"only best_of equal to n ({n}) is supported, got {best_of}: this server does not "
                             f"rank candidates; drop best_of"
                             + (f", or send n={best_of} and pick among the choices" if 1 <= best_of <= MAX_N else ""))
    seed = get_int(body, "seed", None)
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        bad_field("seed", f"must be a signed 64-bit integer, got {seed}")
    refuse_unless_neutral(body, _VLLM_EXTRAS_NEUTRAL)
    constraint, constraint_at = parse_structured_outputs(body)
    stream = get_bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = continuous_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            bad_field("stream_options", f"expected an object, got {type_name(stream_options)}")
        if not stream:
            bad_field("stream_options", "is only allowed when 'stream' is true")
        include_usage = get_bool(stream_options, "include_usage", False, where="stream_options.")
        # vLLM's: usage in every chunk too (with include_usage)
        continuous_usage = include_usage and get_bool(stream_options, "continuous_usage_stats", False,
                                                      where="stream_options.")
        ignored = [k for k in stream_options if k not in STREAM_OPTIONS]
        if ignored:
            logger.warning("stream_options fields present in the request but ignored: %s", logged_names(ignored))
    # The SamplingParams fields the request sets, by their names (max_tokens and logprobs differ between the
    # two endpoints and are added by each).
    sampling = {
        "n": n,
        "temperature": get_number(body, "temperature", defaults.get("temperature", 1.0)),
        "top_p": get_number(body, "top_p", defaults.get("top_p", 1.0)),
        "top_k": get_int(body, "top_k", defaults.get("top_k", -1)),
        "min_p": get_number(body, "min_p", defaults.get("min_p", 0.0)),
        "seed": seed,
        "stop": get_stop(body),
        "stop_token_ids": get_int_list(body, "stop_token_ids"),
        "ignore_eos": get_bool(body, "ignore_eos", False),
        "skip_special_tokens": get_bool(body, "skip_special_tokens", True),
        "include_stop_str_in_output": get_bool(body, "include_stop_str_in_output", False),
        "presence_penalty": get_number(body, "presence_penalty", 0.0),
        "frequency_penalty": get_number(body, "frequency_penalty", 0.0),
        "repetition_penalty": get_number(body, "repetition_penalty", defaults.get("repetition_penalty", 1.0)),
        "logit_bias": _logit_bias(body),
        "allowed_token_ids": get_int_list(body, "allowed_token_ids"),
        "min_tokens": get_int(body, "min_tokens", 0),
        "bad_words": get_string_list(body, "bad_words"),
        "truncate_prompt_tokens": get_int(body, "truncate_prompt_tokens", None),
        "structured_outputs": constraint,
    }
    return {"model": model, "n": n, "stream": stream, "include_usage": include_usage,
            "continuous_usage": continuous_usage, "sampling": sampling,
            "prompt_logprobs": _prompt_logprobs(body, stream),
            "tokens_as_ids": get_bool(body, "return_tokens_as_token_ids", False),
            "return_token_ids": get_bool(body, "return_token_ids", False), "constraint_field": constraint_at,
            "priority": get_int(body, "priority", 0),
            # OpenAI's field; read on /v1/completions too, where it changes nothing
            "parallel_tool_calls": get_bool(body, "parallel_tool_calls", True)}


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs``: the logprob of every prompt token and its ``k`` most likely alternatives
    (0-20), in a non-streamed response only (a stream has no place for them; 0 there is accepted and has
    no effect, as in vLLM)."""
    k = get_int(body, "prompt_logprobs", None)
    if k is None:
        return None
    if k == -1:
        bad_field("prompt_logprobs", "-1 (every token of the vocabulary) is not supported: send at most "
                                     f"{MAX_LOGPROBS}")
    if not 0 <= k <= MAX_LOGPROBS:
        bad_field("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {k}")
    if stream:
        if k:
            bad_field("prompt_logprobs", "is not available when 'stream' is true: send the request unstreamed")
        return None
    return k


def prompt_logprobs_object(tokenizer, entries: list[dict[int, Logprob] | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of one prompt: per prompt token null (the first) or an object from token
    ids (decimal strings) to ``{logprob, rank, decoded_token}``, in the engine entry's order (the prompt token
    first, then the top tokens, as vLLM orders them: kvforge/engine/logprob.py). A token's text is its
    :func:`token_text` (``return_tokens_as_token_ids`` names the tokens of ``logprobs`` only, as in vLLM;
    ``"token_id:N"`` without a tokenizer)."""
    return [None if entry is None else
            {str(t): {"logprob": _finite(v), "rank": v.rank, "decoded_token": token_label(tokenizer, t)}
             for t, v in entry.items()}
            for entry in entries]


def _logit_bias(body: dict) -> dict:
    """OpenAI's ``logit_bias``: an object from token ids (ASCII decimal strings, nothing around the digits) to
    numbers (null: none)."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        bad_field("logit_bias", f"expected an object from token ids to biases, got {type_name(value)}")
    for key, bias in value.items():
        if not is_decimal_id(key) or key != key.strip():
            bad_field("logit_bias", f"keys must be token ids (non-negative integers), got {shown(key)}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            bad_field("logit_bias", f"biases must be numbers in [-100, 100], got {shown(bias)} for token {key}")
    return value


def _params(common: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if max_tokens is not None and max_tokens < 1:
        # SamplingParams would say the same, but name the OpenAI field the client sent.
        bad_field("max_tokens", f"must be an integer >= 1, got {max_tokens}")
    return SamplingParams(**common["sampling"], max_tokens=max_tokens, logprobs=logprobs,
                          prompt_logprobs=common["prompt_logprobs"])


def _completion_prompt(value: Any, name: str) -> str | list[int]:
    """One prompt: a non-empty string or a non-empty array of non-negative token ids."""
    if isinstance(value, str):
        if not value:
            bad_field(name, "must not be empty")
        return value
    if isinstance(value, list):
        if not value:
            bad_field(name, "must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            bad_field(name, "expected a string, an array of token ids, or an array of those")
        if any(t < 0 for t in value):
            bad_field(name, "token ids must be non-negative")
        return value
    bad_field(name, f"expected a string or an array of token ids, got {type_name(value)}")
    return value


def parse_completion(body: Any, served_model: str | tuple[str, ...], defaults: dict | None = None) -> ParsedRequest:
    """A ``/v1/completions`` body; ``defaults``: the model's default sampling fields (``max_tokens`` stays
    OpenAI's 16 when not sent)."""
    common = _common(body, served_model, defaults)
    refuse_unless_neutral(body, _COMPLETION_NEUTRAL)
    if body.get("tool_choice") not in (None, "none", "auto"):
        bad_field("tool_choice", _NOT_ON_COMPLETIONS)
    if "prompt" not in body or body["prompt"] is None:
        bad_field("prompt", "is required")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        # A batch: strings or token-id arrays, one choice each (in this order).
        if len(prompt) > MAX_PROMPTS_PER_REQUEST:
            bad_field("prompt", f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(prompt)}")
        if len({type(p) for p in prompt}) > 1:  # OpenAI's four forms: one kind of prompt per batch
            bad_field("prompt", "mixes strings and token-id arrays; send an array of strings or an array of "
                                "token-id arrays")
        prompts = [_completion_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        prompts = [_completion_prompt(prompt, "prompt")]
    if len(prompts) * common["n"] > MAX_SEQUENCES_PER_REQUEST:
        bad_field("n", f"{len(prompts)} prompts x n={common['n']} is {len(prompts) * common['n']} sequences; at most "
                       f"{MAX_SEQUENCES_PER_REQUEST} per request: split the batch")
    echo = get_bool(body, "echo", False)
    max_tokens = get_int(body, "max_tokens", 16)
    prompt_only = echo and max_tokens == 0
    logprobs = get_int(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        bad_field("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {logprobs}")
    if max_tokens is not None and max_tokens < 0:
        bad_field("max_tokens", f"must be an integer >= 1 (0 only with 'echo': true), got {max_tokens}")
    if max_tokens == 0 and not echo:
        bad_field("max_tokens", "must be >= 1 (0 is allowed only with 'echo': true, which returns the prompt)")
    min_tokens = common["sampling"]["min_tokens"]
    if prompt_only and min_tokens > 0:
        # The engine runs a prompt-only request with max_tokens 1; the client's limit is 0.
        bad_field("min_tokens", f"{min_tokens} is above max_tokens 0 (with 'echo' and max_tokens 0 nothing is "
                                "generated)")
    if echo and common["prompt_logprobs"] is not None:
        bad_field("prompt_logprobs", "cannot be combined with 'echo', whose choice 'logprobs' already hold the "
                                     "prompt's: send one of them")
    params = _params(common, 1 if prompt_only else max_tokens, logprobs)
    if echo and logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=logprobs)
    _refuse_special_tokens_change(body, True)
    log_ignored_fields(body, COMPLETION_FIELDS)
    return ParsedRequest(
        "completion", common["model"], prompts, None, params,
        "max_tokens" in body and body["max_tokens"] is not None, common["stream"], common["include_usage"],
        logprobs, False, echo=echo, prompt_only=prompt_only, continuous_usage=common["continuous_usage"],
        tokens_as_ids=common["tokens_as_ids"], return_token_ids=common["return_token_ids"],
        constraint_field=common["constraint_field"], priority=common["priority"],
        prompt_logprobs=common["prompt_logprobs"],
    )


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text, joined by newlines as vLLM joins them
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{index}].content[{j}]"
            if not isinstance(part, dict):
                bad_field(where, f"expected a content part (an object), got {type_name(part)}")
            if part.get("type") != "text":
                bad_field(f"{where}.type", f"only text content parts are supported, got {shown(part.get('type'))}")
            if not isinstance(part.get("text"), str):
                bad_field(f"{where}.text", f"expected a string, got {type_name(part.get('text'))}")
            parts.append(part["text"])
        return "\n".join(parts)
    if content is None:
        return ""
    bad_field(f"messages[{index}].content", f"expected a string, got {type_name(content)}")
    return ""


def parse_messages(messages: Any) -> list[dict]:
    """Chat messages as ``{"role", "content"}`` dicts with text content (``developer`` is ``system``)."""
    if not isinstance(messages, list) or not messages:
        bad_field("messages", "expected a non-empty array of messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            bad_field(f"messages[{i}]", f"expected an object, got {type_name(m)}")
        role = m.get("role")
        if role is None:
            bad_field(f"messages[{i}].role", "is required (system, developer, user, assistant or tool)")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            bad_field(f"messages[{i}].role", f"unknown role {shown(role)}")
        if role != "assistant" and m.get("content") is None:  # only an assistant turn may come without text
            bad_field(f"messages[{i}].content", f"is required for a {role} message (a string or text parts)")
        clean.append({"role": "system" if role == "developer" else role,
                      "content": _message_text(m.get("content"), i), **template_message(m, i),
                      **_replayed_reasoning(m, i)})
    return clean


def _replayed_reasoning(message: dict, index: int) -> dict:
    """An assistant turn's earlier reasoning sent back (``reasoning``, or ``reasoning_content``), handed to
    the template under both names; templates that read ``reasoning_content`` (Qwen3's, GLM-4.5's) show it
    where they choose to, typically for the turns after the last user message. {} where none is sent."""
    if message.get("role") != "assistant":
        return {}
    for key in ("reasoning", "reasoning_content"):
        if message.get(key) is not None and not isinstance(message[key], str):
            bad_field(f"messages[{index}].{key}", f"expected a string, got {type_name(message[key])}")
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    return {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning else {}


def parse_chat(body: Any, served_model: str | tuple[str, ...], defaults: dict | None = None,
               tool_parser: str | None = None, reasoning: ReasoningTokens | None = None) -> ParsedRequest:
    """A ``/v1/chat/completions`` body; ``defaults``: the model's default sampling fields (a ``max_tokens``
    among them stands for a request that sends none, within the context); ``tool_parser``: the server's
    parser of tool calls the model chooses to make (``tool_choice`` ``"auto"``; None: refused);
    ``reasoning``: the served reasoning model's think-block tags (None: the output is all answer)."""
    common = _common(body, served_model, defaults)
    messages = body.get("messages")
    if messages is None:
        bad_field("messages", "is required")
    clean = parse_messages(messages)
    max_tokens = get_int(body, "max_completion_tokens", None)
    field_name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None)
        field_name = "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        bad_field(field_name, f"must be an integer >= 1, got {max_tokens}")
    want_logprobs = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None)
    if top is not None:
        if not want_logprobs:
            bad_field("top_logprobs", "requires 'logprobs' to be true")
        if not 0 <= top <= MAX_LOGPROBS:
            bad_field("top_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {top}")
    logprobs = (top or 0) if want_logprobs else None
    explicit = max_tokens is not None
    if not explicit:  # the model's default, still capped by the room the prompt leaves
        max_tokens = (defaults or {}).get("max_tokens")
    tools, forced, auto = parse_tools(body, tool_parser, harmony=reasoning is not None and reasoning.parser.harmony)
    if auto and tool_parser in KEEPS_SPECIAL_TOKENS and body.get("skip_special_tokens") is None:
        common["sampling"]["skip_special_tokens"] = False  # the parser reads its call syntax's special tokens
    if reasoning is not None and reasoning.tags_special:  # the split reads the think tags in the text
        if body.get("skip_special_tokens") is True:
            bad_field("skip_special_tokens", "true would drop this model's think tags, which are special tokens, "
                                             "and the reasoning could not be told from the answer; leave it unset")
        common["sampling"]["skip_special_tokens"] = False
    if forced is not None:
        if common["sampling"]["structured_outputs"] is not None:
            bad_field("tool_choice", "forces a tool call, whose arguments are the output's constraint, and the "
                                     "request constrains its output too (response_format or structured_outputs): "
                                     "send one of them")
        # gpt-oss writes a call as a commentary message addressed to the function: the constraint holds the
        # whole harmony output to one (ToolChoice.harmony reads it back).
        common["sampling"]["structured_outputs"] = forced.harmony_constraint() if forced.harmony else forced.constraint()
        common["constraint_field"] = "tools"
    params = _params(common, max_tokens, logprobs)
    if get_bool(body, "echo", False):
        bad_field("echo", "is not supported on chat completions (it is on /v1/completions); leave it unset")
    _refuse_special_tokens_change(body, False)
    log_ignored_fields(body, CHAT_FIELDS)
    options = with_tools(parse_chat_template_options(body, clean), tools)
    return ParsedRequest(
        "chat", common["model"], None, clean, params, explicit,
        common["stream"], common["include_usage"], logprobs, want_logprobs, field_name,
        chat_options=options, continuous_usage=common["continuous_usage"],
        tokens_as_ids=common["tokens_as_ids"], return_token_ids=common["return_token_ids"], tool_choice=forced,
        constraint_field=common["constraint_field"], tool_parser=tool_parser if auto else None,
        parallel_tool_calls=common["parallel_tool_calls"],
        reasoning=reasoning, include_reasoning=get_bool(body, "include_reasoning", True),
        priority=common["priority"], prompt_logprobs=common["prompt_logprobs"],
    )


# -- responses --------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's ``usage``; with ``cached_tokens`` (``--enable-prompt-tokens-details``) its
    ``prompt_tokens_details``: the prompt tokens read from the prefix cache instead of computed (else null,
    as vLLM sends it)."""
    counts = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens} if cached_tokens is not None else None
    return counts


class TextOffsets:
    """The character offset of each token in a choice's text, carried from one stream chunk to the next: a
    token ending inside a multi-byte character adds no character, the token completing it adds one."""

    def __init__(self):
        self.next = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, token: bytes) -> int:
        """The offset at which ``token`` (its bytes) starts; moves past it."""
        at = self.next
        self.next += len(self._utf8.decode(token))
        return at


def token_label(tokenizer, token_id: int, as_ids: bool = False) -> str:
    """How logprobs name a token: its :func:`token_text`, or ``"token_id:N"`` (vLLM's
    ``return_tokens_as_token_ids``, and always without a tokenizer). Ids keep tokens apart whose texts are
    alike (every piece of a multi-byte character reads U+FFFD), so a top-logprobs object keyed by them
    holds every alternative."""
    if as_ids or tokenizer is None:
        return f"token_id:{token_id}"
    return token_text(tokenizer, token_id)


def _is_special(tokenizer, token_id: int) -> bool:
    """Whether ``skip_special_tokens`` drops ``token_id`` (by id where the tokenizer knows, else by decoding)."""
    by_id = getattr(tokenizer, "is_special", None)
    return by_id(token_id) if by_id is not None else tokenizer.decode([token_id], skip_special_tokens=True) == ""


def completion_logprobs(tokenizer, token_ids: list[int], lps: list[dict[int, float] | None], top: int,
                        offsets: TextOffsets | None = None, skip_special_tokens: bool = True,
                        as_ids: bool = False) -> dict:
    """The legacy completions ``logprobs`` object. Each ``top_logprobs`` entry holds the ``top`` most
    likely tokens and the chosen token (so ``top`` = 0 gives the chosen token alone, and an entry has
    ``top`` or ``top + 1`` keys), as vLLM does. An entry of ``lps`` that is None (the first prompt
    token under ``echo``) gives a null logprob and null alternatives. Tokens show as :func:`token_label`;
    ``text_offset`` indexes the text they make, which omits special tokens when ``skip_special_tokens``
    (no text without a tokenizer: every offset 0)."""
    tokens, token_logprobs, top_logprobs, starts = [], [], [], []
    offsets = offsets or TextOffsets()
    for tid, d in zip(token_ids, lps):
        tokens.append(token_label(tokenizer, tid, as_ids))
        if tokenizer is None:
            starts.append(offsets.advance(b""))
        else:
            piece = token_text(tokenizer, tid)
            shown = "" if skip_special_tokens and _is_special(tokenizer, tid) else piece  # the choice's text holds it
            starts.append(offsets.advance(token_bytes(tokenizer, tid, piece) if shown == piece else shown.encode()))
        if d is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(d.get(tid)))
        ranked = sorted(d.items(), key=lambda kv: -kv[1])[:top]
        if tid in d and all(t != tid for t, _ in ranked):
            ranked.append((tid, d[tid]))
        top_logprobs.append({token_label(tokenizer, t, as_ids): _finite(v) for t, v in ranked})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": starts}


def join_logprobs(parts: list[dict]) -> dict:
    """Completions ``logprobs`` objects of consecutive tokens as one."""
    return {key: [v for part in parts for v in part[key]] for key in parts[0]}


def token_bytes(tokenizer, token_id: int, piece: str) -> bytes:
    """The bytes of token ``token_id`` whose text alone is ``piece``: the tokenizer's own record when the
    piece is part of a multi-byte character (U+FFFD alone), else the piece's UTF-8."""
    if "\ufffd" in piece and hasattr(tokenizer, "token_bytes"):
        return tokenizer.token_bytes(token_id)
    return piece.encode("utf8")


def chat_logprobs(tokenizer, token_ids: list[int], lps: list[dict[int, float]], top: int,
                  as_ids: bool = False) -> dict:
    """The chat ``logprobs`` object: each token's logprob and its ``top`` most likely alternatives
    (OpenAI's shape: ``top_logprobs`` = 0 gives an empty list). Tokens show as :func:`token_label`, with
    their text's bytes (null without a tokenizer)."""

    def entry(tid: int, logprob) -> dict:
        piece = token_text(tokenizer, tid) if tokenizer is not None else None
        return {"token": token_label(tokenizer, tid, as_ids), "logprob": _finite(logprob),
                "bytes": list(token_bytes(tokenizer, tid, piece)) if piece is not None else None}

    content = []
    for tid, d in zip(token_ids, lps):
        ranked = sorted(d.items(), key=lambda kv: -kv[1])[:top]
        content.append({**entry(tid, d.get(tid)), "top_logprobs": [entry(t, v) for t, v in ranked]})
    return {"content": content, "refusal": None}


def _finite(v):
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else -9999.0

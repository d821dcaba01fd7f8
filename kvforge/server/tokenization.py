"""The served model's tokenizer over HTTP, in vLLM's shapes: ``POST /tokenize``, ``POST /detokenize``
and ``GET /tokenizer_info``. Clients that count or split tokens themselves (lm-evaluation-harness's
remote tokenizer, load generators) use these instead of loading the tokenizer locally.

``chat_prompt_ids`` is the one place a chat conversation becomes prompt token ids: the chat route
and ``/tokenize`` with ``messages`` both call it. The rendered template already holds the special
tokens it wants (a ``{{ bos_token }}`` at its start, for instance), so the text is encoded without
adding the tokenizer's own (as transformers' ``apply_chat_template(tokenize=True)`` does); adding
them would put a second BOS before every Llama 3, Gemma or Mistral conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvforge.errors import InvalidRequestError
from kvforge.server import protocol
from kvforge.server.protocol import ChatTemplateOptions, parse_chat_template_options
from kvforge.server.tool_calls import with_tools

NO_TOKENIZER = ("this server has no tokenizer (started with --skip-tokenizer-init, or the model has no tokenizer "
                "files and no --tokenizer was given)")
#: What a request without a tokenizer can do instead, by the field that needed one.
NO_TOKENIZER_HINTS = {"prompt": "send 'prompt' as an array of token ids",
                      "messages": "chat messages need one; /v1/completions takes 'prompt' as an array of token ids",
                      "tokens": "detokenizing needs one"}


def no_tokenizer(field: str | None) -> InvalidRequestError:
    """The error of a request that needs the tokenizer this server lacks, naming ``field``."""
    hint = NO_TOKENIZER_HINTS.get(field)
    return InvalidRequestError(NO_TOKENIZER + (f": {hint}" if hint else ""), field=field)


#: Marks the end of the final message's text in a rendering for ``continue_final_message``: the prompt is
#: cut there, so the template's end-of-turn after the message never reaches the model.
_CONTINUE_MARK = "\u0000kvforge-continue\u0000"


def as_text_parts(message: dict) -> dict:
    """``message`` with its text content as OpenAI's content parts, ``[{"type": "text", "text": ...}]`` (vLLM's
    "openai" content format); content that is not text (None: an assistant turn of tool calls) as it is."""
    content = message.get("content")
    return dict(message, content=[{"type": "text", "text": content}]) if isinstance(content, str) else message


def render_chat(tokenizer, messages: list[dict], options: ChatTemplateOptions | None = None) -> str:
    """``messages`` rendered by the chat template as ``options`` ask (cut inside the final message for
    ``continue_final_message``); InvalidRequestError when the template refuses them."""
    options = options or ChatTemplateOptions()
    if options.continue_final_message:
        last = dict(messages[-1], content=messages[-1]["content"] + _CONTINUE_MARK)
        messages = [*messages[:-1], last]
    engine_parts = options.content_format is None and getattr(tokenizer, "chat_content_format", "string") == "openai"
    if options.content_format == "openai" or engine_parts:
        messages = [as_text_parts(m) for m in messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=options.add_generation_prompt,
                                             **dict(options.template_kwargs))
    except Exception as e:  # a template that rejects the conversation, or no template at all
        hint = (" (message text reached the template as content parts, the engine's --chat-template-content-format; "
                "a template that reads a string needs it at string)") if engine_parts else ""
        raise InvalidRequestError(f"'messages': cannot apply the chat template: {e}{hint}", field="messages") from e
    if options.continue_final_message:
        end = text.find(_CONTINUE_MARK)
        if end < 0:
            raise InvalidRequestError("'continue_final_message': the chat template does not render the final "
                                      "message's text, so there is nothing to continue", field="continue_final_message")
        text = text[:end]
    return text


def chat_prompt_ids(tokenizer, messages: list[dict], options: ChatTemplateOptions | None = None,
                    add_special_tokens: bool = False) -> list[int]:
    """Render ``messages`` with the chat template as ``options`` ask and encode the text as it stands (the
    tokenizer's special tokens only with ``add_special_tokens``, which ``/tokenize`` may ask for)."""
    return tokenizer.encode(render_chat(tokenizer, messages, options), add_special_tokens=add_special_tokens)


@dataclass(frozen=True)
class TokenizeRequest:
    """A validated ``/tokenize`` body: ``prompt`` text or chat ``messages`` (exactly one)."""

    prompt: str | None
    messages: list[dict] | None
    add_special_tokens: bool
    chat_options: ChatTemplateOptions
    return_token_strs: bool


def _is_chat(value: Any) -> bool:
    """A non-empty list of objects with a ``role``: chat messages."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def parse_tokenize(body: Any, served_model: str | tuple[str, ...]) -> TokenizeRequest:
    _check_body_and_model(body, served_model)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise InvalidRequestError("send exactly one of 'prompt' (text) and 'messages' (a chat)", field="prompt")
    if has_prompt and _is_chat(body["prompt"]):
        # A chat sent as `prompt` (lm-evaluation-harness's remote tokenizer does, with a chat template applied):
        # tokenized as `messages`, where vLLM refuses it.
        body = {**{k: v for k, v in body.items() if k != "prompt"}, "messages": body["prompt"]}
        has_prompt, has_messages = False, True
    prompt = body.get("prompt")
    if has_prompt and not isinstance(prompt, str):
        protocol.bad_field("prompt", f"expected a string (or a chat, as `messages`), got {protocol.type_name(prompt)}")
    messages = protocol.parse_messages(body["messages"]) if has_messages else None
    return TokenizeRequest(
        prompt=prompt if has_prompt else None,
        messages=messages,
        # vLLM's defaults: a plain prompt gets the tokenizer's special tokens, a chat has its own.
        add_special_tokens=protocol.get_bool(body, "add_special_tokens", has_prompt),
        chat_options=(with_tools(parse_chat_template_options(body, messages), body.get("tools")) if has_messages
                      else ChatTemplateOptions()),
        return_token_strs=protocol.get_bool(body, "return_token_strs", False),
    )


def tokenize(tokenizer, req: TokenizeRequest, max_model_len: int) -> dict:
    if tokenizer is None:
        raise no_tokenizer("messages" if req.messages is not None else "prompt")
    if req.messages is not None:
        ids = chat_prompt_ids(tokenizer, req.messages, req.chat_options, req.add_special_tokens)
    else:
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def parse_detokenize(body: Any, served_model: str | tuple[str, ...]) -> list[int]:
    _check_body_and_model(body, served_model)
    if body.get("tokens") is None:
        protocol.bad_field("tokens", "is required (an array of token ids)")
    return protocol.get_int_list(body, "tokens")


def detokenize(tokenizer, ids: list[int]) -> dict:
    if tokenizer is None:
        raise no_tokenizer("tokens")
    vocab = tokenizer.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        protocol.bad_field("tokens", f"token ids must be integers in [0, {vocab}); got {bad[0]}")
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """The tokenizer's special tokens and chat template (``eos_token`` is what clients probe for)."""
    if tokenizer is None:
        raise no_tokenizer(None)
    return {
        "tokenizer_class": "kvforge.tokenizer.Tokenizer",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "chat_template": tokenizer.chat_template,
        "model_max_length": max_model_len,
        "vocab_size": tokenizer.vocab_size,
    }


def _check_body_and_model(body: Any, served_model: str | tuple[str, ...]) -> None:
    protocol.check_body(body)
    protocol.check_model(body.get("model"), served_model)

"""Server-wide defaults of request fields, from ``kvforge serve`` flags (vLLM's): applied to each request body
before it is parsed, so a field the request sends itself always wins.

- ``--default-chat-template-kwargs JSON``: template variables under each chat's ``chat_template_kwargs``
  (``{"enable_thinking": false}`` turns Qwen3's thinking off unless a request turns it on).
- ``--return-tokens-as-token-ids``: ``return_tokens_as_token_ids`` true unless a request says false.
- ``--exclude-tools-when-tool-choice-none``: a chat with ``tool_choice`` ``"none"`` renders without its
  ``tools`` (some templates describe tools at length even when none may be called).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvforge.errors import ConfigError
from kvforge.server.request_fields import type_name


@dataclass(frozen=True)
class RequestDefaults:
    chat_template_kwargs: dict = field(default_factory=dict)
    tokens_as_ids: bool = False
    exclude_tools_when_none: bool = False

    def apply(self, body: Any, chat: bool, generates: bool = True) -> Any:
        """``body`` with the defaults its own fields leave open (anything but an object as it is, for the
        parser to refuse); ``chat``: a body with messages; ``generates``: a generation route (not /tokenize)."""
        if not isinstance(body, dict):
            return body
        body = dict(body)
        if generates and self.tokens_as_ids and body.get("return_tokens_as_token_ids") is None:
            body["return_tokens_as_token_ids"] = True
        if chat and self.chat_template_kwargs:
            own = body.get("chat_template_kwargs")
            if own is None or isinstance(own, dict):
                defaults = dict(self.chat_template_kwargs)
                if body.get("reasoning_effort") is not None:  # the request's own field over the server's default
                    defaults.pop("reasoning_effort", None)
                body["chat_template_kwargs"] = {**defaults, **(own or {})}
        if chat and self.exclude_tools_when_none and body.get("tool_choice") == "none":
            body.pop("tools", None)
        return body


def parse_template_kwargs(text: str | None) -> dict:
    """``--default-chat-template-kwargs``: a JSON object; ConfigError naming the flag otherwise."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--default-chat-template-kwargs must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--default-chat-template-kwargs must be a JSON object, got {type_name(value)}")
    reserved = sorted({"messages", "add_generation_prompt"} & set(value))
    if reserved:
        raise ConfigError(f"--default-chat-template-kwargs may not set {', '.join(reserved)} (the request's own "
                          f"fields do)")
    return value

"""Which shape of message text a chat template reads: ``"string"`` (``message['content']`` is the text) or
``"openai"`` (``message['content']`` is a list of ``{"type": "text", "text": ...}`` parts).

``--chat-template-content-format auto`` decides in two ways:

1. The template's syntax tree: a ``for`` loop over a message's content reads parts. The loop may iterate
   ``message['content']`` or ``message.content`` directly, through filters (``selectattr``), through a
   variable set from the content (``{% set c = message['content'] %}``, a namespace attribute set from it),
   or through a macro parameter that a call passes the content to.
2. Where the tree shows no such loop and the engine can render, one probe message: a template that drops
   the text of a message given as a string but shows it given as parts reads parts (a loop the tree does
   not show).

Any other template reads a string. Templates written for parts usually accept a string as well (they test
``is string`` first), so parts are chosen only where the template iterates them or needs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jinja2 import nodes

#: The text of the probe message of step 2.
PROBE_TEXT = "kvforge-content-format-probe"


@dataclass(frozen=True)
class ContentFormatChoice:
    """The content format a chat template is rendered with, and why (for the startup log)."""

    content_format: str
    reason: str


def _strip_filters(node: nodes.Node) -> nodes.Node:
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    return node


@dataclass
class _ContentRefs:
    """What holds a message's content in a template: variable names, namespace attributes, macro parameters."""

    names: set[str]
    attributes: set[tuple[str, str]]

    def reads(self, node: nodes.Node) -> bool:
        """Whether ``node`` (filters stripped) is a message's content, or something set from it."""
        node = _strip_filters(node)
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        if isinstance(node, nodes.Getattr):
            if node.attr == "content":
                return True
            return isinstance(node.node, nodes.Name) and (node.node.name, node.attr) in self.attributes
        return isinstance(node, nodes.Name) and node.name in self.names


def _content_refs(tree: nodes.Template) -> _ContentRefs:
    """Follow assignments, namespaces and macro calls until no new holder of a message's content appears."""
    refs = _ContentRefs(set(), set())
    macros = {m.name: m for m in tree.find_all(nodes.Macro)}
    while True:
        before = (len(refs.names), len(refs.attributes))
        for assign in tree.find_all(nodes.Assign):
            target, value = assign.target, assign.node
            if isinstance(target, nodes.Name) and refs.reads(value):
                refs.names.add(target.name)
            elif isinstance(target, nodes.NSRef) and refs.reads(value):
                refs.attributes.add((target.name, target.attr))
            elif (isinstance(target, nodes.Name) and isinstance(value, nodes.Call)
                  and isinstance(value.node, nodes.Name) and value.node.name == "namespace"):
                refs.attributes.update((target.name, kw.key) for kw in value.kwargs if refs.reads(kw.value))
        for call in tree.find_all(nodes.Call):
            macro = macros.get(call.node.name) if isinstance(call.node, nodes.Name) else None
            if macro is None:
                continue
            params = [arg.name for arg in macro.args]
            refs.names.update(params[k] for k, arg in enumerate(call.args) if k < len(params) and refs.reads(arg))
            refs.names.update(kw.key for kw in call.kwargs if kw.key in params and refs.reads(kw.value))
        if (len(refs.names), len(refs.attributes)) == before:
            return refs


def detect_content_format(source: str | None,
                          render: Callable[[list[dict]], str] | None = None) -> ContentFormatChoice:
    """The format ``auto`` picks for the template ``source`` (None: no template, so string); ``render``
    renders a conversation with it (step 2 of the module docstring; None: the syntax tree alone)."""
    if not source:
        return ContentFormatChoice("string", "no chat template")
    from jinja2 import Environment
    from jinja2.exceptions import TemplateSyntaxError

    from kvforge.tokenizer import template_extensions

    try:
        tree = Environment(extensions=template_extensions()).parse(source)
    except TemplateSyntaxError:
        return ContentFormatChoice("string", "the chat template does not parse")
    refs = _content_refs(tree)
    for loop in tree.find_all(nodes.For):
        if refs.reads(loop.iter):
            return ContentFormatChoice("openai", f"the chat template loops over a message's content "
                                                 f"(line {loop.lineno})")
    if render is not None and _drops_string_text(render):
        return ContentFormatChoice("openai", "the chat template drops a message's text given as a string and "
                                             "shows it given as parts")
    return ContentFormatChoice("string", "the chat template never loops over a message's content")


def _drops_string_text(render: Callable[[list[dict]], str]) -> bool:
    def shows(content) -> bool | None:
        try:
            return PROBE_TEXT in render([{"role": "user", "content": content}])
        except Exception:  # a template that refuses the probe says nothing either way
            return None

    return shows(PROBE_TEXT) is False and shows([{"type": "text", "text": PROBE_TEXT}]) is True


def resolve_content_format(flag: str, source: str | None,
                           render: Callable[[list[dict]], str] | None = None) -> ContentFormatChoice:
    """``--chat-template-content-format`` ``flag`` (auto, string or openai) for the template ``source``."""
    if flag != "auto":
        return ContentFormatChoice(flag, f"--chat-template-content-format {flag}")
    choice = detect_content_format(source, render)
    return ContentFormatChoice(choice.content_format, f"auto: {choice.reason}")


def mismatch_warning(flag: str, source: str | None) -> str | None:
    """A warning for an explicit ``flag`` the template's syntax tree contradicts: ``openai`` for a template
    that never loops over content (it may concatenate the list as a string and fail every chat)."""
    if flag != "openai" or not source:
        return None
    if detect_content_format(source).content_format == "string":
        return ("--chat-template-content-format openai, but the chat template never loops over a message's "
                "content: it may fail on, or print, the list of parts; leave the flag at auto unless it needs them")
    return None

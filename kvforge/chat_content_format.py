"""Which shape of message text a chat template reads: ``"string"`` (``message['content']`` is the text) or
``"openai"`` (``message['content']`` is a list of ``{"type": "text", "text": ...}`` parts).

``--chat-template-content-format auto`` takes the answer from the template's syntax tree: a template
that loops over a message's content (``{% for part in message['content'] %}``, through filters such as
``selectattr``, or through a variable set from the content) reads parts; any other template reads a
string. Templates written for parts usually accept a string as well (they test ``is string`` first),
so parts are chosen only where the template iterates them.
"""

from __future__ import annotations

from dataclasses import dataclass

from jinja2 import nodes


@dataclass(frozen=True)
class ContentFormatChoice:
    """The content format a chat template is rendered with, and why (for the startup log)."""

    content_format: str
    reason: str


def _strip_filters(node: nodes.Node) -> nodes.Node:
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    return node


def _reads_content(node: nodes.Node, content_names: frozenset[str]) -> bool:
    """Whether ``node`` (filters stripped) is ``x['content']``, ``x.content`` or a name set from one."""
    node = _strip_filters(node)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, nodes.Name) and node.name in content_names


def _content_names(tree: nodes.Template) -> frozenset[str]:
    """Names a ``{% set name = message['content'] %}`` binds to a message's content."""
    names = set()
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and _reads_content(assign.node, frozenset()):
            names.add(assign.target.name)
    return frozenset(names)


def detect_content_format(source: str | None) -> ContentFormatChoice:
    """The format ``auto`` picks for the template ``source`` (None: no template, so string)."""
    if not source:
        return ContentFormatChoice("string", "no chat template")
    from jinja2 import Environment
    from jinja2.exceptions import TemplateSyntaxError
    from jinja2.ext import loopcontrols

    try:
        tree = Environment(extensions=[loopcontrols]).parse(source)
    except TemplateSyntaxError:
        return ContentFormatChoice("string", "the chat template does not parse")
    names = _content_names(tree)
    for loop in tree.find_all(nodes.For):
        if _reads_content(loop.iter, names):
            return ContentFormatChoice("openai", f"the chat template loops over a message's content "
                                                 f"(line {loop.lineno})")
    return ContentFormatChoice("string", "the chat template never loops over a message's content")


def resolve_content_format(flag: str, source: str | None) -> ContentFormatChoice:
    """``--chat-template-content-format`` ``flag`` (auto, string or openai) for the template ``source``."""
    if flag != "auto":
        return ContentFormatChoice(flag, f"--chat-template-content-format {flag}")
    choice = detect_content_format(source)
    return ContentFormatChoice(choice.content_format, f"auto: {choice.reason}")

"""How message text reaches the chat template (``--chat-template-content-format``, kvforge/server/tokenization.py,
kvforge/chat_content_format.py): a string, or OpenAI's list of text parts for templates that loop over parts
(``auto`` reads the template to choose); continuing the final message works in both; the engine flag is checked
before anything loads."""

from __future__ import annotations

import jinja2
import pytest

from kvforge.config import EngineArgs
from kvforge.errors import ConfigError, InvalidRequestError
from kvforge.server.protocol import ChatTemplateOptions
from kvforge.server.tokenization import render_chat

PARTS = "{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
STRING = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


class TemplateOnly:
    """A tokenizer that only renders ``template`` (jinja2 itself, not the tokenizer under test)."""

    def __init__(self, template: str, content_format: str | None = None):
        self.template = jinja2.Template(template)
        if content_format is not None:
            self.chat_content_format = content_format

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)


MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_parts_for_templates_that_loop_over_them():
    assert render_chat(TemplateOnly(PARTS), MESSAGES, ChatTemplateOptions(content_format="openai")) == \
        "<user>[Hi]<assistant>[Hello]"
    assert render_chat(TemplateOnly(PARTS, "openai"), MESSAGES) == "<user>[Hi]<assistant>[Hello]"  # the engine's
    assert render_chat(TemplateOnly(STRING), MESSAGES) == "<user>Hi<assistant>Hello"  # string by default
    assert render_chat(TemplateOnly(STRING, "openai"), MESSAGES, ChatTemplateOptions(content_format="string")) == \
        "<user>Hi<assistant>Hello"  # a request's own choice wins


def test_continue_the_final_message_as_a_part():
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True, content_format="openai")
    assert render_chat(TemplateOnly(PARTS), MESSAGES, options) == "<user>[Hi]<assistant>[Hello"


def test_assistant_turn_without_text_stays_none():
    calls = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]
    template = "{% for m in messages %}{{ m['content'] is none }}{% endfor %}"
    assert render_chat(TemplateOnly(template), calls, ChatTemplateOptions(content_format="openai")) == "FalseTrue"


def test_engine_flag_is_checked():
    assert EngineArgs(model="m", chat_template_content_format="openai").chat_template_content_format == "openai"
    with pytest.raises(ConfigError, match="--chat-template-content-format must be one of auto, string, openai"):
        EngineArgs(model="m", chat_template_content_format="parts")


@pytest.mark.parametrize("template, expected", [
    (STRING, "string"),
    (PARTS, "openai"),
    # parts when content is not a string: the loop decides
    ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
     "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}{{ c.text }}"
     "{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% set body = m['content'] %}{% for c in body %}{{ c.text }}{% endfor %}{% endfor %}",
     "openai"),
    # loops over other fields, or over a string method's result, read a string
    ("{% for m in messages %}{{ m['content'] }}{% for t in m.tool_calls %}{{ t.function.name }}{% endfor %}"
     "{% endfor %}", "string"),
    ("{% for m in messages %}{% for line in m['content'].split('\\n') %}{{ line }}{% endfor %}{% endfor %}",
     "string"),
    ("{% for m in messages %}{% set body = m['role'] %}{% for c in body %}{{ c }}{% endfor %}{% endfor %}",
     "string"),
    (None, "string"),
    ("{% for %}", "string"),  # refused when it is rendered, not here
])
def test_auto_reads_the_template(template, expected):
    from kvforge.chat_content_format import detect_content_format, resolve_content_format

    assert detect_content_format(template).content_format == expected
    assert resolve_content_format("auto", template).content_format == expected
    for flag in ("string", "openai"):  # a named format is taken as it is
        assert resolve_content_format(flag, template).content_format == flag


def test_auto_names_the_deciding_line():
    from kvforge.chat_content_format import detect_content_format

    choice = detect_content_format("{% for m in messages %}\n{{ m['role'] }}\n{% for p in m['content'] %}"
                                   "{{ p.text }}{% endfor %}{% endfor %}")
    assert choice.content_format == "openai" and "line 3" in choice.reason


def test_engine_renders_a_parts_template_with_parts_by_default():
    """The embedded model under a template that loops over content parts: ``auto`` hands it parts."""
    from kvforge import SamplingParams
    from kvforge.llm import LLM

    llm = LLM(device="cpu", chat_template=PARTS, max_model_len=256, kv_cache_memory=64 << 20)
    try:
        assert llm.engine.tokenizer.chat_content_format == "openai"
        out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert out.prompt == "<user>[Hi]"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("template", [
    # a macro given the content
    "{% macro show(body) %}{% for p in body %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
    "{% macro show(role, body) %}{% for p in body %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m.role, body=m['content']) }}{% endfor %}",
    # a namespace attribute set from it
    "{% for m in messages %}{% set ns = namespace(c=m['content']) %}{% for p in ns.c %}{{ p.text }}{% endfor %}"
    "{% endfor %}",
    "{% set ns = namespace(c=none) %}{% for m in messages %}{% set ns.c = m.content %}{% for p in ns.c %}"
    "{{ p.text }}{% endfor %}{% endfor %}",
])
def test_auto_follows_macros_and_namespaces(template):
    from kvforge.chat_content_format import detect_content_format

    assert detect_content_format(template).content_format == "openai"


def test_auto_probes_what_the_tree_does_not_show():
    """A template that reads parts through a map the tree cannot follow: the probe message shows it drops
    string text and shows parts."""
    from kvforge.chat_content_format import detect_content_format

    template = "{% for m in messages %}{{ m['content'] | map(attribute='text') | join('') }}{% endfor %}"
    render = TemplateOnly(template).apply_chat_template
    assert detect_content_format(template).content_format == "string"
    assert detect_content_format(template, render).content_format == "openai"
    assert detect_content_format(STRING, TemplateOnly(STRING).apply_chat_template).content_format == "string"


def test_openai_for_a_string_template_is_warned_and_explained():
    from kvforge.chat_content_format import mismatch_warning

    assert "never loops over a message's content" in mismatch_warning("openai", STRING)
    assert mismatch_warning("openai", PARTS) is None and mismatch_warning("string", STRING) is None
    concat = "{% for m in messages %}{{ '<' + m['content'] + '>' }}{% endfor %}"
    with pytest.raises(InvalidRequestError, match="--chat-template-content-format; a template that reads a string"):
        render_chat(TemplateOnly(concat, "openai"), MESSAGES)


def test_generation_blocks_render_their_body_as_transformers_does():
    """transformers' ``{% generation %}`` tag (assistant masks for training) renders its body; the
    reference is transformers' own rendering of the template."""
    transformers = pytest.importorskip("transformers")
    from kvforge.spec.embedded import embedded_model_path
    from kvforge.tokenizer import Tokenizer

    template = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>"
                "{% endgeneration %}{% else %}<u>{{ m.content }}</u>{% endif %}{% endfor %}")
    ours = Tokenizer.from_gguf(embedded_model_path())
    ours.use_chat_template(template)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=ours.backend)
    expected = ref.apply_chat_template(MESSAGES, chat_template=template, tokenize=False)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=False) == expected == "<u>Hi</u><a>Hello</a>"
    broken = Tokenizer.from_gguf(embedded_model_path())
    broken.chat_template = "{% for m in messages %}{{ m.content }}"
    assert "does not compile" in broken.chat_template_problem()
    with pytest.raises(ConfigError, match="give the engine a working one with --chat-template"):
        broken.apply_chat_template(MESSAGES)

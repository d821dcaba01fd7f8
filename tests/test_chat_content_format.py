"""How message text reaches the chat template (``--chat-template-content-format``, kvforge/server/tokenization.py,
kvforge/chat_content_format.py): a string, or OpenAI's list of text parts for templates that loop over parts
(``auto`` reads the template to choose); continuing the final message works in both; the engine flag is checked
before anything loads."""

from __future__ import annotations

import jinja2
import pytest

from kvforge.config import EngineArgs
from kvforge.errors import ConfigError
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

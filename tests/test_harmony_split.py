"""gpt-oss's harmony channels split into reasoning and answer (kvforge/server/harmony_split.py): whole splits
against hand-written expectations, every streamed chunking joining to the whole split, and the server's chat
and Responses routes over a scripted harmony output."""

from __future__ import annotations

import itertools
import json
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from kvforge.server.harmony_split import HarmonyStream, split_harmony  # noqa: E402

ANALYSIS = "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 4."
CALL = '<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 2}'


@pytest.mark.parametrize("text, expected", [
    (ANALYSIS + FINAL, ("User asks 2+2. Easy.", "It is 4.")),
    (ANALYSIS + FINAL + "<|end|>", ("User asks 2+2. Easy.", "It is 4.")),
    (ANALYSIS, ("User asks 2+2. Easy.", "")),
    ("<|channel|>analysis<|message|>cut mid-thou", ("cut mid-thou", "")),  # stopped while thinking
    ("<|channel|>final<|message|>Just 4.", (None, "Just 4.")),
    (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + FINAL,
     ("User asks 2+2. Easy.", "Checking.\nIt is 4.")),  # a preamble is shown to the user, messages joined
    (ANALYSIS + "<|start|>assistant<|channel|>analysis<|message|>Sure.<|end|>", ("User asks 2+2. Easy.\nSure.", "")),
    ("<|channel|>analysis to=browser.search code<|message|>{\"q\": 1}<|call|>", ('{"q": 1}', "")),  # not served
    ("<|channel|>final<|message|>done<|return|>", (None, "done")),  # a stop token read as text adds none
    (ANALYSIS + CALL, ("User asks 2+2. Easy.", CALL)),  # a tool call stays as written, for a tool-call parser
    ("Plain text, no channels.", (None, "Plain text, no channels.")),
    (ANALYSIS + "<|start|>assistant<|channel|>fin", ("User asks 2+2. Easy.", "")),  # a cut header adds nothing
])
def test_whole_split(text, expected):
    assert split_harmony(text) == expected


def _chunkings(text: str):
    yield [text]
    yield list(text)
    for i, j in itertools.combinations(range(1, len(text), 7), 2):
        yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("text", [ANALYSIS + FINAL, ANALYSIS + CALL, "<|channel|>final<|message|>x<|e",
                                  "Plain.", ANALYSIS + "<|start|>assist", ANALYSIS + ANALYSIS + FINAL,
                                  "<|channel|>analysis<|message|>cut mid-thou"])
def test_stream_joins_to_the_whole_split(text):
    reasoning, answer = split_harmony(text)
    for chunks in _chunkings(text):
        stream, so_far, pieces, answers = HarmonyStream(), "", [], []
        for k, chunk in enumerate(chunks):
            so_far += chunk
            piece, answer_so_far = (stream.finish if k == len(chunks) - 1 else stream.feed)(so_far)
            assert not answers or answer_so_far.startswith(answers[-1]), chunks
            pieces.append(piece)
            answers.append(answer_so_far)
        assert ("".join(pieces), answers[-1]) == (reasoning or "", answer), chunks
        assert stream.thought == (reasoning is not None)


@pytest.mark.parametrize("text", [ANALYSIS + FINAL + "<|end|>", ANALYSIS + CALL + "<|call|>", "Plain.<|channel|>fi",
                                  ANALYSIS + ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>pre<|end|>"
                                  + FINAL, "lead " + ANALYSIS + "<|start|>assistant<|channel|>final<|message|>a<|ret"])
def test_each_streamed_step_equals_a_fresh_read_of_its_text(text):
    """The stream reads only what its text grew by (settled messages are not read again, marker searches
    resume near the end); after every character its reasoning and answer so far equal a whole split of the
    text it was fed, read from the start. The hand-written splits above pin the whole split itself."""
    from kvforge.server.harmony_split import _Messages, _partial_marker

    reader = _Messages()  # any growing text, markers cut anywhere (the stream holds back a partial marker)
    for n in range(len(text) + 1):
        assert reader.read(text[:n]) == _Messages().read(text[:n]), text[:n]
    stream, pieces = HarmonyStream(), []
    for n in range(1, len(text) + 1):
        so_far = text[:n]
        piece, answer_so_far = stream.feed(so_far)
        pieces.append(piece)
        reasoning, answer = split_harmony(so_far[:len(so_far) - _partial_marker(so_far)])
        assert ("".join(pieces), answer_so_far) == (reasoning or "", answer), so_far


def test_the_parser_checks_the_markers_and_keeps_special_tokens(tmp_path):
    from think_tokenizer import write_think_tokenizer

    from kvforge.errors import ConfigError
    from kvforge.reasoning import reasoning_tokens
    from kvforge.tokenizer import Tokenizer

    with pytest.raises(ConfigError, match="'<\\\\|channel\\\\|>' is not one token"):
        reasoning_tokens("openai_gptoss", Tokenizer.from_hf_dir(write_think_tokenizer(tmp_path / "think")))
    tags = reasoning_tokens("openai_gptoss", Tokenizer.from_hf_dir(write_harmony_tokenizer(tmp_path / "harmony")))
    assert tags.parser.harmony and tags.tags_special and (tags.start_id, tags.end_id) == (5, 6)
    analysis = list(tags.reasoning_channel_ids)
    assert tags.answer_channel_ids and tags.reasoning_token_count([], [5, *analysis, 6, 9, 7, 8, 5, 12]) == 5 + len(
        analysis)  # up to the header of another channel
    assert tags.reasoning_token_count([], [5, *analysis, 6, 9]) == 3 + len(analysis)  # thinking to the end
    assert tags.reasoning_token_count([], [9, 9]) == 0


def write_harmony_tokenizer(directory: Path) -> Path:
    """The embedded tokenizer with six unused special tokens renamed as harmony's markers (special, as in
    gpt-oss's tokenizer)."""
    from think_tokenizer import rename_tokens

    return rename_tokens(directory, HARMONY_IDS, special=True)


#: The renamed tokens' ids.
HARMONY_IDS = {5: "<|channel|>", 6: "<|message|>", 7: "<|end|>", 8: "<|start|>", 9: "<|constrain|>", 10: "<|call|>"}


@pytest.fixture(scope="module")
def server():
    from fake_engine import ScriptedEngine

    from kvforge.reasoning import REASONING_PARSERS, ReasoningTokens
    from kvforge.server.app import ServerThread, create_app

    engine = ScriptedEngine(ANALYSIS + FINAL)
    engine.reasoning = ReasoningTokens(REASONING_PARSERS["openai_gptoss"], start_id=-1, end_id=-2, tags_special=True)
    with ServerThread(create_app(engine)) as srv:
        yield srv


def test_chat_and_responses_over_a_harmony_output(server):
    from fake_engine import openai_client

    client = openai_client(server)
    kw = dict(model="fake-model", messages=[{"role": "user", "content": "2+2?"}], max_tokens=200)
    message = client.chat.completions.create(**kw).choices[0].message
    assert (message.content, message.model_extra["reasoning"]) == ("It is 4.", "User asks 2+2. Easy.")
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(d.content or "" for d in deltas) == "It is 4."
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == "User asks 2+2. Easy."
    r = client.responses.create(model="fake-model", input="2+2?", max_output_tokens=200)
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "It is 4."
    assert r.output[0].content[0].text == "User asks 2+2. Easy."
    body = json.dumps({"model": "fake-model", "messages": kw["messages"], "skip_special_tokens": True}).encode()
    req = urllib.request.Request(server.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:  # the markers are special tokens: skipping them is refused
        urllib.request.urlopen(req, timeout=30)
    assert json.loads(err.value.read())["error"]["param"] == "skip_special_tokens"


def test_gpt_oss_tool_calls_with_the_openai_parser():
    """A scripted gpt-oss output that thinks and then calls a function: reasoning apart, the call parsed, whole
    and streamed, on the chat and Responses routes."""
    from fake_engine import ScriptedEngine, openai_client

    from kvforge.reasoning import REASONING_PARSERS, ReasoningTokens
    from kvforge.server.app import ServerThread, create_app

    engine = ScriptedEngine(ANALYSIS + CALL)
    engine.reasoning = ReasoningTokens(REASONING_PARSERS["openai_gptoss"], start_id=-1, end_id=-2, tags_special=True)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with ServerThread(create_app(engine, tool_parser="openai")) as srv:
        client = openai_client(srv)
        kw = dict(model="fake-model", messages=[{"role": "user", "content": "2+2?"}], tools=tools, max_tokens=300)
        choice = client.chat.completions.create(**kw).choices[0]
        chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        r = client.responses.create(model="fake-model", input="2+2?", max_output_tokens=300,
                                    tools=[{"type": "function", "name": "add", "parameters": {"type": "object"}}])
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments), choice.finish_reason) == ("add", {"a": 2, "b": 2},
                                                                                             "tool_calls")
    assert choice.message.content is None and choice.message.model_extra["reasoning"] == "User asks 2+2. Easy."
    streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [("add", call.function.arguments)]
    assert [(o.type, getattr(o, "name", None)) for o in r.output] == [("reasoning", None), ("function_call", "add")]
    engine = ScriptedEngine(ANALYSIS + CALL)  # a forced call, held to its harmony form, is read by the same parser
    engine.reasoning = ReasoningTokens(REASONING_PARSERS["openai_gptoss"], start_id=-1, end_id=-2, tags_special=True)
    with ServerThread(create_app(engine)) as srv:
        forced = openai_client(srv).chat.completions.create(**{**kw, "tool_choice": "required"}).choices[0]
    assert [(c.function.name, c.function.arguments) for c in forced.message.tool_calls] == [("add", call.function.arguments)]
    assert forced.finish_reason == "tool_calls"
    from kvforge.server.protocol import parse_chat

    req = parse_chat({**kw, "tool_choice": {"type": "function", "function": {"name": "add"}}}, "fake-model",
                     reasoning=engine.reasoning)
    assert req.params.structured_outputs.harmony_call == (("add", '{"type":"object"}'),)
    assert req.tool_choice.harmony and req.tool_choice.name == "add" and req.tool_parser is None

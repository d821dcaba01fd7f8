"""A forced gpt-oss call (kvforge/structured/harmony_call.py): the gate's masks checked token by token on the
embedded vocabulary with harmony's markers, xgrammar's own matcher as the reference for the arguments; then the
embedded model held to a call through the engine and the server (the openai client reads the call)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")

from test_harmony_split import HARMONY_IDS, write_harmony_tokenizer  # noqa: E402

from kvforge.structured.params import StructuredOutputsParams  # noqa: E402

CHANNEL, MESSAGE, END, START, CONSTRAIN, CALL = HARMONY_IDS
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TWO = StructuredOutputsParams(harmony_call=[("weather", CITY), ("add", ADD)])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from kvforge.structured.backend import GrammarBackend
    from kvforge.tokenizer import Tokenizer

    directory = write_harmony_tokenizer(tmp_path_factory.mktemp("harmony"))
    tok = Tokenizer.from_hf_dir(directory)
    return tok, GrammarBackend(tok, tok.vocab_size, tok.eos_token_ids), directory


def _allowed(matcher, vocab_size) -> set[int]:
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    return {t for t in range(vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1}


def _gate(setup, constraint=TWO, prompt=()):
    from kvforge.structured.harmony_call import harmony_call_gate

    tok, backend, _ = setup
    return harmony_call_gate(backend, constraint, tok, list(prompt))


def _words(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _header(tok, name):
    return [CHANNEL, *_words(tok, f"commentary to=functions.{name} "), CONSTRAIN, *_words(tok, "json"), MESSAGE]


def test_a_call_after_reasoning_is_the_only_way_through(setup):
    tok, backend, _ = setup
    vocab = backend.vocab_size
    gate = _gate(setup, prompt=[1, START, *_words(tok, "assistant")])
    assert _allowed(gate, vocab) == {CHANNEL}  # the prompt opened the message: its channel comes first
    analysis = [CHANNEL, *_words(tok, "analysis"), MESSAGE]
    for t in analysis:
        assert gate.accept_token(t)
    # reasoning: anything but the special tokens that would end it otherwise than <|end|>
    special = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    assert {0, 2, *HARMONY_IDS} <= special
    assert _allowed(gate, vocab) == (set(range(vocab)) - special) | {END}
    for t in [*_words(tok, " The user wants the weather."), END]:
        assert t in _allowed(gate, vocab) and gate.accept_token(t)
    # a new message of the assistant's, whose header must address a function (a second analysis is refused)
    for t in [START, *_words(tok, "assistant")]:
        assert _allowed(gate, vocab) == {t} and gate.accept_token(t)
    assert gate.accept_token(CHANNEL)
    assert not gate.accept_token(_words(tok, "analysis")[0]) and not gate.accept_token(_words(tok, "final")[0])
    header = _header(tok, "weather")[1:]
    for t in header:
        assert t in _allowed(gate, vocab) and gate.accept_token(t)
    # the arguments: exactly what xgrammar allows for the function's schema, and <|call|> only once whole
    reference = backend.matcher(StructuredOutputsParams(json=CITY))
    arguments = _words(tok, '{"city": "Rome"}')
    for t in arguments:
        assert _allowed(gate, vocab) == _allowed(reference, vocab) and 2 not in _allowed(reference, vocab)
        assert not gate.accept_token(CALL) and gate.accept_token(t) and reference.accept_token(t)
    whole = _allowed(reference, vocab)
    assert 2 in whole and _allowed(gate, vocab) == (whole - {2}) | {CALL} and not gate.accept_token(2)
    assert not gate.is_terminated() and gate.accept_token(CALL) and gate.is_terminated()


def test_the_header_chooses_the_function_whose_schema_holds_the_arguments(setup):
    tok, backend, _ = setup
    vocab = backend.vocab_size
    gate = _gate(setup, prompt=[1])  # a prompt that does not open the message: the output opens it
    for t in [START, *_words(tok, "assistant")]:
        assert _allowed(gate, vocab) == {t} and gate.accept_token(t)
    for t in _header(tok, "add"):
        assert gate.accept_token(t)
    reference = backend.matcher(StructuredOutputsParams(json=ADD))
    assert _allowed(gate, vocab) == _allowed(reference, vocab)  # add's arguments, not the weather's
    for t in _words(tok, '{"a": 1'):
        assert gate.accept_token(t)
    assert not all(gate.accept_token(t) for t in _words(tok, ', "city"'))


def test_rollback_and_fork_cross_the_header(setup):
    tok, backend, _ = setup
    vocab = backend.vocab_size
    gate = _gate(setup, prompt=[START, *_words(tok, "assistant")])
    header = _header(tok, "weather")
    arguments = _words(tok, '{"city": "Pa')
    for t in [*header, *arguments]:
        assert gate.accept_token(t)
    after = _allowed(gate, vocab)
    child = gate.fork()
    gate.rollback(len(arguments) + 2)  # back inside the header: the function's matcher is dropped
    assert _allowed(gate, vocab) == {header[-2]}
    for t in [*header[-2:], *arguments]:
        assert gate.accept_token(t)
    assert _allowed(gate, vocab) == after == _allowed(child, vocab)
    child.rollback(3)  # within the arguments: the child's own matcher rolls back, the parent's stays
    assert _allowed(gate, vocab) == after and _allowed(child, vocab) != after
    for t in arguments[-3:]:
        assert child.accept_token(t)
    assert _allowed(child, vocab) == after


def test_a_named_call_and_bad_constraints(setup):
    from kvforge.errors import InvalidRequestError

    tok, backend, _ = setup
    named = StructuredOutputsParams(harmony_call={"add": ADD})
    gate = _gate(setup, named, prompt=[START, *_words(tok, "assistant")])
    for t in _header(tok, "add"):  # one header besides the analysis channel's: one token allowed at a time
        allowed = _allowed(gate, backend.vocab_size)
        assert t in allowed and len(allowed - {_words(tok, "analysis")[0]}) == 1 and gate.accept_token(t)
    gate = _gate(setup, named, prompt=[START, *_words(tok, "assistant")])
    assert not all(gate.accept_token(t) for t in _header(tok, "weather"))
    gate = _gate(setup, named, prompt=[START, *_words(tok, "assistant"), CHANNEL])  # the prompt opened the header
    assert all(gate.accept_token(t) for t in _header(tok, "add")[1:])
    for bad, why in (([], "non-empty list"), ([("a b", ADD)], "without spaces"), ([("f", ADD), ("f", ADD)], "twice"),
                     ("f", "non-empty list"), ([("f", [1])], "must describe an object"),
                     ([("f", {"type": "array"})], "must describe an object"), ([("f", True)], "must describe an object"),
                     ([("f", "{")], "not valid JSON")):
        with pytest.raises(InvalidRequestError, match=why):
            StructuredOutputsParams(harmony_call=bad)
    with pytest.raises(InvalidRequestError, match="function 'f'"):
        backend.compile(StructuredOutputsParams(harmony_call=[("f", {"type": "object", "minProperties": 3})]))


def test_the_engine_writes_a_call_the_parser_reads(setup):
    """The embedded model, reasoning cut short by a bias on <|end|>: the output is a harmony call to one of
    the functions with arguments its schema accepts, and a request for it on an engine without the harmony
    parser is refused."""
    from kvforge import LLM, SamplingParams
    from kvforge.errors import InvalidRequestError
    from kvforge.server.tool_parsers import parse_openai

    _, _, directory = setup
    common = dict(tokenizer=str(directory), max_model_len=256, kv_cache_memory=64 << 20, progress=False)
    prompt = "<|im_start|>user\nWhat is the weather in Rome?<|im_end|>\n<|im_start|>assistant"
    params = SamplingParams(temperature=0, max_tokens=60, logit_bias={END: 8.0}, skip_special_tokens=False,
                            structured_outputs=TWO)
    with LLM(**common, reasoning_parser="openai_gptoss") as llm:
        (out,) = llm.generate([prompt], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == CALL, completion.text
    _, calls = parse_openai(completion.text)
    (name, arguments), = calls
    assert name in ("weather", "add")
    value = json.loads(arguments)
    assert (value["city"] in ("Paris", "Rome")) if name == "weather" else isinstance(value["a"], int)
    with LLM(**common) as llm, pytest.raises(InvalidRequestError, match="--reasoning-parser openai_gptoss"):
        llm.generate([prompt], params, use_tqdm=False)


def test_the_server_answers_a_forced_call_to_gpt_oss(setup):
    """tool_choice "required" and named on a harmony model, whole and streamed, with the official client: the
    call's arguments as the schema holds them (as far as they go where max_tokens cuts them, streamed alike),
    OpenAI's finish reasons, and errors that name the function at fault."""
    import openai
    from fake_engine import openai_client, smollm2_server

    _, _, directory = setup
    tools = [{"type": "function", "function": {"name": "weather", "parameters": CITY}},
             {"type": "function", "function": {"name": "add", "parameters": ADD}}]
    with smollm2_server(extra_args=("--tokenizer", str(directory), "--reasoning-parser", "openai_gptoss")) as srv:
        client = openai_client(srv)
        kw = dict(model=client.models.list().data[0].id, tools=tools, max_tokens=60, temperature=0,
                  messages=[{"role": "user", "content": "What is the weather in Rome?"}], logit_bias={str(END): 8})
        choice = client.chat.completions.create(**kw, tool_choice="required").choices[0]
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.function.name in ("weather", "add")
        assert choice.message.content is None
        json.loads(call.function.arguments)
        named = client.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "add"}})
        (call,) = named.choices[0].message.tool_calls
        assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
        assert named.choices[0].finish_reason == "stop"  # a named call, as OpenAI answers it
        chunks = list(client.chat.completions.create(**kw, tool_choice="required", stream=True))
        streamed = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        assert [t.function.name for t in streamed if t.function.name] == [choice.message.tool_calls[0].function.name]
        assert "".join(t.function.arguments for t in streamed) == choice.message.tool_calls[0].function.arguments
        assert all((c.choices[0].delta.content or None) is None for c in chunks if c.choices)
        # cut inside the arguments: the call as far as it went, whole and streamed alike
        cut = {**kw, "max_tokens": 22, "tool_choice": {"type": "function", "function": {"name": "weather"}}}
        whole = client.chat.completions.create(**cut).choices[0]
        (call,) = whole.message.tool_calls
        assert whole.finish_reason == "length" and whole.message.content is None
        assert call.function.name == "weather" and call.function.arguments.startswith("{")
        parts = [t.function.arguments for c in client.chat.completions.create(**cut, stream=True) if c.choices
                 for t in c.choices[0].delta.tool_calls or []]
        assert "".join(parts) == call.function.arguments
        # a refused schema names its function; two functions may define one $defs name differently
        bad = [tools[0], {"type": "function", "function": {"name": "odd", "parameters": {
            "type": "object", "properties": {"x": {"type": "strin"}}}}}]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**{**kw, "tools": bad}, tool_choice="required")
        assert err.value.body["param"] == "tools[1].function.parameters"
        defs = [{"type": "function", "function": {"name": f, "parameters": {
            "type": "object", "properties": {"v": {"$ref": "#/$defs/X"}}, "required": ["v"],
            "$defs": {"X": {"enum": [value]}}}}} for f, value in (("f", "a"), ("g", "b"))]
        (call,) = client.chat.completions.create(**{**kw, "tools": defs}, tool_choice="required").choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"v": "a" if call.function.name == "f" else "b"}
        # the Responses route: the named call as a function_call item, streamed as its arguments come
        tool = {"type": "function", "name": "add", "parameters": ADD}
        events = list(client.responses.create(model=kw["model"], input="Add 2 and 2.", max_output_tokens=60,
                                              tools=[tool], tool_choice={"type": "function", "name": "add"},
                                              stream=True, temperature=0))
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert [i.type for i in done][-1] == "function_call" and set(json.loads(done[-1].arguments)) == {"a", "b"}


def test_speculative_and_overlapped_engines_equal_the_plain_one(setup):
    """Garbage proposals, verified against the gate and rolled back across its headers, and async scheduling
    (tokens fed to the gate while in flight) give the plain engine's forced calls."""
    from greedy_agreement import assert_speculative_and_async_agree

    from kvforge import LLM, SamplingParams

    tok, _, directory = setup
    common = dict(tokenizer=str(directory), reasoning_parser="openai_gptoss", max_model_len=256,
                  kv_cache_memory=64 << 20, progress=False, enable_prefix_caching=False)
    prompts = ["<|im_start|>user\nWhat is the weather in Rome?<|im_end|>\n<|im_start|>assistant",
               "<|im_start|>user\nAdd two and two.<|im_end|>\n<|im_start|>assistant"]
    bias = {_words(tok, "analysis")[0]: 5.0, END: 10.0}  # the second prompt reasons (briefly) first
    params = SamplingParams(temperature=0, max_tokens=60, logprobs=2, logit_bias=bias, skip_special_tokens=False,
                            structured_outputs=TWO)
    with LLM(**common) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.outputs[0].token_ids[-1] == CALL for o in plain)
    assert ["<|channel|>analysis" in o.outputs[0].text for o in plain] == [False, True]
    assert_speculative_and_async_agree(common, prompts, params, plain)

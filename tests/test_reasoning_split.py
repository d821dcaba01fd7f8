"""A reasoning model's text split into reasoning and answer (kvforge/server/reasoning_split.py, rules in
kvforge/reasoning.py): the whole split against hand-written expectations, and every streamed chunking of an
output joining to the whole split."""

from __future__ import annotations

import itertools

import pytest

from kvforge.reasoning import ANSWER, REASONING, REASONING_PARSERS, UNDECIDED, opening_phase
from kvforge.server.reasoning_split import ReasoningStream, split_reasoning

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
START, END = 7, 8  # the tags' ids in the prompts below


@pytest.mark.parametrize("phase, text, expected", [
    (REASONING, "Let me see.\n</think>\n\nYes.", ("Let me see.\n", "Yes.")),
    (REASONING, "<think>\nLet me see.</think>Yes.", ("\nLet me see.", "Yes.")),  # the opening tag is dropped
    (REASONING, "  <think>x</think> y", ("x", "y")),
    (REASONING, "still thinking", ("still thinking", "")),  # stopped while thinking: no answer
    (REASONING, "</think>", ("", "")),
    (REASONING, "a</think>b</think>c", ("a", "b</think>c")),  # only the first closing tag ends it
    (UNDECIDED, "<think>hm</think>\n\nNo.", ("hm", "No.")),
    (UNDECIDED, "\n<think>hm", ("hm", "")),
    (UNDECIDED, "Plain answer.", (None, "Plain answer.")),
    (UNDECIDED, "An answer that mentions </think> later", (None, "An answer that mentions </think> later")),
    (UNDECIDED, "", (None, "")),
    (ANSWER, "<think>x</think>y", (None, "<think>x</think>y")),
])
def test_whole_split(phase, text, expected):
    assert split_reasoning(QWEN3, text, phase) == expected


def test_opening_phase_follows_the_prompts_last_tag():
    assert opening_phase(QWEN3, [1, 2, START], START, END) == REASONING  # a template opened the block
    assert opening_phase(QWEN3, [1, START, 3, END, 4], START, END) == UNDECIDED  # closed: the model decides
    assert opening_phase(QWEN3, [1, 2], START, END) == UNDECIDED
    assert opening_phase(R1, [1, 2], START, END) == REASONING  # R1 always thinks
    assert opening_phase(R1, [START, 3, END, 9, START], START, END) == REASONING
    # a tag in an earlier turn (a user's message that mentions it) is followed by that turn's end marker
    turn_end = frozenset({99})
    assert opening_phase(QWEN3, [1, START, 2, 99, 5], START, END, turn_end) == UNDECIDED
    assert opening_phase(QWEN3, [1, 99, 5, START, 2, 3], START, END, turn_end) == REASONING


TEXTS = ["<think>\nLet me see.\n</think>\n\nYes, it is.", "Let me see.</think>  \n Yes", "Plain answer, no tags.",
         " <thi", "<think>no end", "\n\n<think>x</thi", "a</think>", "  \n", "</think>b</think>c", "<think></think>"]


def _chunkings(text: str):
    """Every split of ``text`` into 1-3 chunks, and the one-character stream."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(1, len(text)), 2):
        yield [text[:i], text[i:j], text[j:]]
    yield list(text)


@pytest.mark.parametrize("phase", [REASONING, UNDECIDED, ANSWER])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_joins_to_the_whole_split(phase, text):
    reasoning, answer = split_reasoning(QWEN3, text, phase)
    for chunks in _chunkings(text):
        stream, so_far, pieces, answers = ReasoningStream(QWEN3, phase), "", [], []
        for k, chunk in enumerate(chunks):
            so_far += chunk
            piece, answer_so_far = (stream.finish if k == len(chunks) - 1 else stream.feed)(so_far)
            assert not answers or answer_so_far.startswith(answers[-1]), chunks  # the answer only grows
            pieces.append(piece)
            answers.append(answer_so_far)
        assert "".join(pieces) == (reasoning or ""), chunks
        assert answers[-1] == answer, chunks
        assert stream.thought == (reasoning is not None), chunks


def test_stream_holds_a_partial_tag_until_decided():
    stream = ReasoningStream(QWEN3, REASONING)
    assert stream.feed("abc</th") == ("abc", "")  # "</th" may be the closing tag
    assert stream.feed("abc</thx") == ("</thx", "")  # it was not
    assert stream.feed("abc</thx</think>  ") == ("", "")  # whitespace before the answer waits
    assert stream.feed("abc</thx</think>  Yes") == ("", "Yes")
    undecided = ReasoningStream(QWEN3, UNDECIDED)
    assert undecided.feed("<th") == ("", "")  # may open the block
    assert undecided.feed("<to") == ("", "<to")  # the answer, from its first character

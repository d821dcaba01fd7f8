"""Reasoning models (``--reasoning-parser NAME``, vLLM's flag and names): a model that thinks before it answers
writes its reasoning inside a think block, ``<think> ... </think>``, then the answer.

The rules, in one place for the server's split of the text (kvforge/server/reasoning_split.py) and the
engine's structured outputs (kvforge/structured/reasoning_gate.py):

- Both tags are single tokens of the model's tokenizer (checked when the engine starts).
- Where an output starts (:func:`opening_phase`): inside the block when the prompt's last tag is an
  opening one with no special token after it (a template that opens the block for the model, or a
  continued final message that stops inside it; a tag in an earlier turn, a user's message that mentions
  ``<think>`` say, is followed by that turn's end marker); otherwise inside it as well for a parser whose
  models always think (``deepseek_r1``: R1 writes its reasoning first, with or without the opening tag);
  otherwise (``qwen3``, whose templates can turn thinking off) undecided: the output reasons only when it
  opens the block itself, first thing.
- The reasoning runs to the closing tag, or to the end of an output that stops while thinking (it then has
  no answer). An opening tag at the start of the reasoning is not part of it.
- The answer is the text after the closing tag, its leading whitespace dropped.
- A structured-output constraint holds the answer only: the reasoning is free.

``openai_gptoss`` reads gpt-oss's harmony channels instead of a think block (kvforge/server/harmony_split.py):
the reasoning is the ``analysis`` messages, the answer the ``final`` channel's (where the constraint holds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Where an output stands: inside the think block, past it (the answer), or not yet known (the first token
#: decides: an opening tag starts the block, anything else is the answer).
REASONING, ANSWER, UNDECIDED = "reasoning", "answer", "undecided"


@dataclass(frozen=True)
class ReasoningParser:
    """One ``--reasoning-parser``: its tags, and whether its models always think (an output without an
    opening tag is reasoning until the closing one). ``harmony``: gpt-oss's channels instead of a think
    block (kvforge/server/harmony_split.py): ``start`` and ``end`` are then the header's ``<|channel|>`` and
    ``<|message|>``, ``markers`` every marker the text split reads, and the answer's header names
    ``answer_channel``."""

    name: str
    always_thinks: bool
    start: str = "<think>"
    end: str = "</think>"
    harmony: bool = False
    markers: tuple[str, ...] = ("<think>", "</think>")
    answer_channel: str = ""
    reasoning_channel: str = ""


#: --reasoning-parser NAME -> its rules. DeepSeek-V3.1 and GLM-4.5 templates open the block for the model (or
#: close it, thinking off) as Qwen3's can, so their parsers read as ``qwen3``'s.
REASONING_PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", always_thinks=True),
    "deepseek_v3": ReasoningParser("deepseek_v3", always_thinks=False),
    "glm45": ReasoningParser("glm45", always_thinks=False),
    "qwen3": ReasoningParser("qwen3", always_thinks=False),
    "openai_gptoss": ReasoningParser("openai_gptoss", always_thinks=True, start="<|channel|>", end="<|message|>",
                                     harmony=True, markers=("<|channel|>", "<|message|>", "<|end|>", "<|start|>"),
                                     answer_channel="final", reasoning_channel="analysis"),
}


def _last(ids: Sequence[int], token: int) -> int:
    for at in range(len(ids) - 1, -1, -1):
        if ids[at] == token:
            return at
    return -1


def opening_phase(parser: ReasoningParser, prompt_ids: Sequence[int], start_id: int, end_id: int,
                  special_ids: frozenset[int] = frozenset()) -> str:
    """The phase an output of the prompt ``prompt_ids`` starts in (module docstring); ``special_ids``: the
    tokenizer's special tokens (turn markers), the tags excluded."""
    start = _last(prompt_ids, start_id)
    if start > _last(prompt_ids, end_id) and not any(t in special_ids for t in prompt_ids[start + 1:]):
        return REASONING
    return REASONING if parser.always_thinks else UNDECIDED


@dataclass(frozen=True)
class ReasoningTokens:
    """A parser with its tags' token ids in the served tokenizer, the tokenizer's other special tokens, and
    whether the tags are special tokens themselves (detokenizing then keeps special tokens, or the text
    would lose the tags)."""

    parser: ReasoningParser
    start_id: int
    end_id: int
    special_ids: frozenset[int] = frozenset()
    tags_special: bool = False
    answer_channel_ids: tuple[int, ...] = ()  # harmony: the answer channel's name as tokens
    reasoning_channel_ids: tuple[int, ...] = ()  # harmony: the reasoning channel's name as tokens
    marker_ids: frozenset[int] = frozenset()  # every marker of the parser's format (harmony's four)

    def opening_phase(self, prompt_ids: Sequence[int]) -> str:
        """Harmony: the answer where the prompt ends inside an answer-channel message (a continued final
        message: its last header names that channel and no marker follows its ``<|message|>``), else the
        reasoning. Otherwise :func:`opening_phase`."""
        if self.parser.harmony:
            header = _last(prompt_ids, self.start_id)
            opens = _last(prompt_ids, self.end_id)
            width = len(self.answer_channel_ids)
            inside = (0 <= header < opens and tuple(prompt_ids[header + 1:header + 1 + width]) == self.answer_channel_ids
                      and not any(t in self.special_ids or t in self.marker_ids for t in prompt_ids[opens + 1:]))
            return ANSWER if inside else REASONING
        return opening_phase(self.parser, prompt_ids, self.start_id, self.end_id, self.special_ids)

    def reasoning_token_count(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> int:
        """Output tokens spent thinking: up to and including the closing tag (all of them where it never
        came; none where the output did not think). Harmony: the tokens before the first header of another
        channel than the reasoning one (all of them where none came)."""
        ids = list(output_ids)
        if self.parser.harmony:
            width = len(self.reasoning_channel_ids)
            headers = [k for k, token in enumerate(ids) if token == self.start_id]
            for k in headers:
                if tuple(ids[k + 1:k + 1 + width]) != self.reasoning_channel_ids:
                    return k
            return len(ids) if headers else 0
        phase = self.opening_phase(prompt_ids)
        if phase == ANSWER or (phase == UNDECIDED and ids[:1] != [self.start_id]):
            return 0
        return ids.index(self.end_id) + 1 if self.end_id in ids else len(ids)


def reasoning_tokens(name: str, tokenizer) -> ReasoningTokens:
    """``--reasoning-parser name`` for ``tokenizer``; ConfigError naming the problem when a tag is not one
    token of it (the model was not trained to think in this format)."""
    from kvforge.errors import ConfigError

    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ConfigError(f"--reasoning-parser {name!r} is not known; choose one of "
                          f"{', '.join(sorted(REASONING_PARSERS))}")
    if tokenizer is None:
        raise ConfigError(f"--reasoning-parser {name} needs the tokenizer: drop --skip-tokenizer-init")
    ids = {}
    for tag in parser.markers:
        token = tokenizer.convert_tokens_to_ids(tag)
        if token is None or tokenizer.encode(tag, add_special_tokens=False) != [token]:
            raise ConfigError(f"--reasoning-parser {name}: {tag!r} is not one token of this model's tokenizer, "
                              f"so the model does not think in {name}'s format; leave --reasoning-parser unset")
        ids[tag] = token
    special = frozenset(i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special)
    def channel(name: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(name, add_special_tokens=False)) if parser.harmony else ()

    return ReasoningTokens(parser, ids[parser.start], ids[parser.end], special - set(ids.values()),
                           tags_special=bool(special & set(ids.values())),
                           answer_channel_ids=channel(parser.answer_channel),
                           reasoning_channel_ids=channel(parser.reasoning_channel),
                           marker_ids=frozenset(ids.values()))

"""Structured outputs of a reasoning model (kvforge/structured/reasoning_gate.py): the grammar holds the answer
only, checked on xgrammar's own masks for the embedded vocabulary with think tags."""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

from think_tokenizer import END_ID, START_ID, write_think_tokenizer  # noqa: E402

from kvforge.reasoning import ANSWER, REASONING, REASONING_PARSERS, UNDECIDED, ReasoningTokens  # noqa: E402
from kvforge.structured.params import StructuredOutputsParams  # noqa: E402
from kvforge.structured.reasoning_gate import ReasoningGate  # noqa: E402

TOKENS = ReasoningTokens(REASONING_PARSERS["qwen3"], START_ID, END_ID)
CHOICE = StructuredOutputsParams(choice=("yes", "no"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from kvforge.structured.backend import GrammarBackend
    from kvforge.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(write_think_tokenizer(tmp_path_factory.mktemp("think")))
    backend = GrammarBackend(tok, tok.vocab_size, tok.eos_token_ids)
    return tok, backend


def _allowed(gate, vocab_size) -> set[int]:
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(1, vocab_size)
    gate.fill_next_token_bitmask(mask, 0)
    return {t for t in range(vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1}


def _grammar_allowed(backend, tokens) -> set[int]:
    """What the bare grammar allows after ``tokens`` (the reference: xgrammar alone)."""
    matcher = backend.matcher(CHOICE)
    for t in tokens:
        assert matcher.accept_token(t)
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(1, backend.vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    return {t for t in range(backend.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1}


def test_reasoning_is_free_and_the_answer_is_held(setup):
    tok, backend = setup
    gate = ReasoningGate(backend.matcher(CHOICE), TOKENS, REASONING)
    everything = set(range(backend.vocab_size))
    for t in tok.encode(" The sky is blue, so", add_special_tokens=False):
        assert _allowed(gate, backend.vocab_size) == everything and gate.accept_token(t)
    assert gate.accept_token(END_ID) and gate.phase == ANSWER
    assert _allowed(gate, backend.vocab_size) == _grammar_allowed(backend, [])
    yes = tok.encode("yes", add_special_tokens=False)
    for t in yes:
        assert gate.accept_token(t)
    assert _allowed(gate, backend.vocab_size) == _grammar_allowed(backend, yes) and not gate.is_terminated()
    (eos,) = tok.eos_token_ids
    assert gate.accept_token(eos) and gate.is_terminated()


def test_undecided_start_opens_the_block_or_answers(setup):
    tok, backend = setup
    gate = ReasoningGate(backend.matcher(CHOICE), TOKENS, UNDECIDED)
    assert _allowed(gate, backend.vocab_size) == _grammar_allowed(backend, []) | {START_ID}
    child = gate.fork()
    assert gate.accept_token(START_ID) and gate.phase == REASONING
    (first, *_) = tok.encode("no", add_special_tokens=False)
    assert child.accept_token(first) and child.phase == ANSWER  # a fork keeps its own phase
    assert not child.accept_token(START_ID)  # the grammar refuses it once the answer has begun
    other = ReasoningGate(backend.matcher(CHOICE), TOKENS, UNDECIDED)
    (bad, *_) = tok.encode("maybe", add_special_tokens=False)
    assert not other.accept_token(bad) and other.phase == UNDECIDED


def test_rollback_crosses_the_closing_tag(setup):
    tok, backend = setup
    gate = ReasoningGate(backend.matcher(CHOICE), TOKENS, REASONING)
    think = tok.encode(" hmm", add_special_tokens=False)
    yes = tok.encode("yes", add_special_tokens=False)
    for t in [*think, END_ID, *yes]:
        assert gate.accept_token(t)
    gate.rollback(len(yes))
    assert gate.phase == ANSWER and _allowed(gate, backend.vocab_size) == _grammar_allowed(backend, [])
    gate.rollback(1)  # the closing tag
    assert gate.phase == REASONING and _allowed(gate, backend.vocab_size) == set(range(backend.vocab_size))
    for t in [END_ID, *yes]:  # the grammar takes the answer again from its start
        assert gate.accept_token(t)
    with pytest.raises(ValueError, match="cannot roll back"):
        gate.rollback(10_000)


def test_speculative_and_overlapped_engines_equal_the_plain_one(tmp_path):
    """The embedded model with think tags, prompts that end inside the think block, a bias that closes it
    after a token or two and a choice constraint on the answer: garbage proposals (verified against the gate,
    rolled back across its phases) and async scheduling (tokens fed to the gate while in flight) give the
    plain engine's outputs."""
    from greedy_agreement import assert_speculative_and_async_agree

    from kvforge import LLM, SamplingParams

    tok = str(write_think_tokenizer(tmp_path / "think"))
    common = dict(tokenizer=tok, reasoning_parser="qwen3", max_model_len=256, kv_cache_memory=64 << 20,
                  progress=False, enable_prefix_caching=False)
    prompts = ["<|im_start|>user\nIs the sky blue?<|im_end|>\n<|im_start|>assistant\n<think>",
               "<|im_start|>user\nIs grass red? Think first.<|im_end|>\n<|im_start|>assistant\n<think>"]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, logit_bias={END_ID: 10.0},
                            structured_outputs={"choice": ["yes", "no"]})
    with LLM(**common) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
    for text in (o.outputs[0].text for o in plain):  # some reasoning, the tag, an answer the grammar allows
        reasoning, _, answer = text.partition("</think>")
        assert reasoning and answer in ("yes", "no"), text
    assert_speculative_and_async_agree(common, prompts, params, plain)


def test_harmony_gate_holds_the_final_channel_only(tmp_path):
    """gpt-oss's channels: analysis and its headers are free; from the token after the final channel's
    ``<|message|>`` the grammar decides; a rollback back across that header frees the output again."""
    from test_harmony_split import write_harmony_tokenizer

    from kvforge.reasoning import reasoning_tokens
    from kvforge.structured.backend import GrammarBackend
    from kvforge.structured.reasoning_gate import HarmonyGate, gate_for
    from kvforge.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_dir(write_harmony_tokenizer(tmp_path / "harmony"))
    backend = GrammarBackend(tok, tok.vocab_size, tok.eos_token_ids)
    tags = reasoning_tokens("openai_gptoss", tok)
    gate = gate_for(backend.matcher(CHOICE), tags, tags.opening_phase([1, 2]))
    assert isinstance(gate, HarmonyGate) and gate.phase == REASONING
    channel, message, end, start = 5, 6, 7, 8
    words = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    thinking = [channel, *words("analysis"), message, *words(" it is blue"), end, start, *words("assistant")]
    everything = set(range(backend.vocab_size))
    for t in thinking:
        assert _allowed(gate, backend.vocab_size) == everything and gate.accept_token(t)
    header = [channel, *words("final"), message]
    for t in header:
        assert gate.accept_token(t)
    assert gate.phase == ANSWER and _allowed(gate, backend.vocab_size) == _grammar_allowed(backend, [])
    yes = words("yes")
    for t in yes:
        assert gate.accept_token(t)
    gate.rollback(len(yes) + 1)  # back into the header: free again, and the grammar back at its start
    assert gate.phase == REASONING and _allowed(gate, backend.vocab_size) == everything
    for t in [message, *yes]:
        assert gate.accept_token(t)
    assert gate.fork().phase == ANSWER
    # a prompt that ends inside a final message (continuing it): the output is answer from its first token
    assert tags.opening_phase([8, *words("assistant"), *header, *words("It is")]) == ANSWER
    assert tags.opening_phase([8, *words("assistant"), *header, *words("It is"), end, 8]) == REASONING
    assert tags.opening_phase([8, *words("assistant"), channel, *words("analysis"), message]) == REASONING

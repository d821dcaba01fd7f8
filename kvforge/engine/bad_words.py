"""vLLM's ``bad_words``: words a request's output must never spell in tokens.

Each word is encoded twice, as written (leading spaces dropped) and with one leading space, so it is banned
both where it starts the text and after a space; each distinct encoding is one banned token sequence
(vLLM keeps the spaced encoding only where it has as many tokens as the word as written, so a word that
is one token after a space, " Emma", is not banned there). At every sampled position, a sequence whose
tokens but its last are the output's last tokens (all of the sequence, for a one-token word) has that last
token banned: its logit becomes -inf. Only output tokens count; a word the prompt ends in the middle of is
not followed across into the output (vLLM's rule). The bans cover these encodings only: the same text
spelt in other tokens (" Em", "m", "a"), which a grammar or an unusual continuation can produce, is not
banned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvforge.errors import InvalidRequestError

BadWordIds = tuple[tuple[int, ...], ...]

#: The most tokens a request's bad words may encode to, both encodings of each word counted: each sampled
#: position compares the output's tail with every encoding on the host.
MAX_BAD_WORD_TOKENS = 2048


def encode_bad_words(words: Sequence[str], encode: Callable[[str], list[int]], vocab_size: int) -> BadWordIds:
    """The token sequences of ``words`` (module docstring), distinct, in first-seen order; ``encode`` maps a
    text to token ids without special tokens. A word that encodes to nothing, or to an id outside the
    vocabulary, is refused naming it."""
    found: dict[tuple[int, ...], None] = {}
    def no_tokens(word: str) -> InvalidRequestError:
        return InvalidRequestError(f"bad_words entry {word!r} encodes to no tokens: give words with at least one "
                                   f"character that is not a space", field="bad_words")

    for word in words:
        if not word.strip():
            raise no_tokens(word)
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(encode(text))
            if not ids:
                raise no_tokens(word)
            if max(ids) >= vocab_size:
                raise InvalidRequestError(
                    f"bad_words entry {word!r} encodes to token id {max(ids)}, outside the model's vocabulary of "
                    f"{vocab_size} tokens: the tokenizer does not match the model", field="bad_words")
            found[ids] = None
        total = sum(len(ids) for ids in found)
        if total > MAX_BAD_WORD_TOKENS:
            raise InvalidRequestError(f"bad_words encode to more than {MAX_BAD_WORD_TOKENS} tokens (both encodings "
                                      f"of each word counted): send fewer or shorter words", field="bad_words")
    return tuple(found)


def always_banned(word_ids: BadWordIds) -> set[int]:
    """The tokens banned at every position: those of the one-token words."""
    return {ids[0] for ids in word_ids if len(ids) == 1}


def longest_prefix(word_ids: BadWordIds) -> int:
    """How many of the output's last tokens :func:`banned_next_tokens` reads (0: only one-token words)."""
    return max((len(ids) - 1 for ids in word_ids), default=0)


def banned_next_tokens(word_ids: BadWordIds, output_ids: Sequence[int]) -> set[int]:
    """The tokens that would complete one of ``word_ids`` if sampled after ``output_ids`` (the output so far,
    or at least its last :func:`longest_prefix` tokens)."""
    banned = set()
    n = len(output_ids)
    for ids in word_ids:
        prefix = len(ids) - 1
        if prefix <= n and all(output_ids[n - prefix + i] == ids[i] for i in range(prefix)):
            banned.add(ids[-1])
    return banned

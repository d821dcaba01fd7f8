"""Incremental detokenization and stop-string detection for one sequence.

Works with any tokenizer object that has ``decode(ids, skip_special_tokens=...) -> str``.

Incremental decoding (the "prefix/read offset" scheme): to turn the newest
tokens into text we decode a short window that starts a few tokens earlier
(``prefix_offset``) twice, without and with the new tokens, and emit the
difference. Starting a few tokens back keeps tokenizers that strip or merge a
leading space (SentencePiece, byte-level BPE) consistent. When the window's
text ends in U+FFFD the last token(s) carry an incomplete UTF-8 character;
nothing is emitted until a later token completes it, so a partial U+FFFD is
never part of the output.

Stop strings may span several tokens: after each delta each stop string ``s``
is searched from ``len(old_text) - (len(s) - 1)``, so only a match that ends in
the new text counts. On a hit the text is truncated
right before the stop string (the stop string is not returned). For
streaming, ``output_text(finished=False)`` also withholds a trailing piece of
text that could still become a stop string. With ``min_tokens`` (vLLM's rule)
only text that arrives after more than that many output tokens is searched.
"""

from __future__ import annotations

# Tokens of context decoded before the new ones (vLLM uses 5 as well).
_INITIAL_CONTEXT = 5


class IncrementalDetokenizer:
    """Decodes one sequence's output tokens as they arrive.

    ``prompt_token_ids`` give leading context only; the text produced covers
    the output tokens.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] | list[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        min_tokens: int = 0,
    ):
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        # Stop strings are looked for only in text that arrives once more than min_tokens output tokens are in.
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._ids: list[int] = list(prompt_token_ids[-_INITIAL_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self.text = ""
        self.stopped_on: str | None = None

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids) -> str:
        """Append new token ids; return the text newly made final (may be "").

        After a stop string is found, further tokens are ignored.
        """
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if self.stopped_on is not None:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        self.num_output_tokens += len(token_ids)
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            # Incomplete character (or nothing visible yet): wait for more tokens.
            return ""
        # If more context made the tokenizer render the window's start differently,
        # the part already emitted is kept as is (same policy as vLLM).
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        old_len = len(self.text)
        self.text += delta
        if self.stop and delta and self.num_output_tokens > self.min_tokens:
            self._check_stop(old_len)
        return delta

    def _check_stop(self, old_len: int) -> None:
        # Only a match that ends in the new text counts: each stop string is searched from
        # ``len(s) - 1`` characters before it, so one that lies wholly in text that came before
        # (text not searched under min_tokens) is not matched (vLLM's rule).
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, max(0, old_len - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0] + (len(best[1]) if self.include_stop else 0)]
            self.stopped_on = best[1]

    def output_text(self, finished: bool = True) -> str:
        """The text so far. While unfinished, withhold a tail that may start a stop string."""
        if finished or not self.stop or self.stopped_on is not None:
            return self.text
        text = self.text
        hold = 0
        for k in range(min(len(text), self._max_stop_len - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                hold = k
                break
        return text[: len(text) - hold] if hold else text


def detokenize_incrementally(tokenizer, prompt_token_ids, output_token_ids, skip_special_tokens=True) -> str:
    """Decode ``output_token_ids`` one token at a time (test helper; same result as streaming)."""
    d = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens)
    for t in output_token_ids:
        d.add_tokens([t])
    return d.text

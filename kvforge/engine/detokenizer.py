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

A tokenizer backed by a ``tokenizers.Tokenizer`` (``tokenizer.backend``) decodes through the
library's ``DecodeStream``, the same scheme in Rust: one call a token where the scheme above makes
two. The window offsets are kept here as well, so the Python decode takes over for a token the stream
rejects (a window whose start renders differently with more context) and the stream restarts from the
window after it.
"""

from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers before 0.21
    DecodeStream = None

# Tokens of context decoded before the new ones (vLLM uses 5 as well).
_INITIAL_CONTEXT = 5


def _stream_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` a ``DecodeStream`` can step with, or None."""
    backend = getattr(tokenizer, "backend", None)
    if DecodeStream is None or backend is None or type(backend).__module__.split(".")[0] != "tokenizers":
        return None
    return backend


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
        self._backend = _stream_backend(tokenizer)
        self._stream = self._new_stream() if self._backend is not None else None

    def _new_stream(self):
        """A ``DecodeStream`` whose window is ``_ids[prefix_offset:]``, all of it read (the state at the
        start and right after an emit), or None: where the library's stream takes no prefill ids, and
        while the window's text is empty or ends inside a character, which the stream would not take as
        its prefix (the Python path then runs until its next emit)."""
        window = self._ids[self.prefix_offset :]
        if window:
            text = self._decode(window)
            if not text or text.endswith("\ufffd"):
                return None
        try:
            return DecodeStream(window, skip_special_tokens=self.skip_special_tokens)
        except TypeError:  # tokenizers before 0.22: no prefill ids
            self._backend = None
            return None

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
        if self._stream is not None:
            return self._add_streamed(token_ids)
        self._ids.extend(int(t) for t in token_ids)
        self.num_output_tokens += len(token_ids)
        delta = self._emit_window()
        if self._backend is not None and self.read_offset == len(self._ids):
            self._stream = self._new_stream()  # back on the stream once the window is all read
        return delta

    def _add_streamed(self, token_ids) -> str:
        if len(token_ids) == 1:  # the decode step's case, kept short
            t = int(token_ids[0])
            self._ids.append(t)
            self.num_output_tokens += 1
            try:
                piece = self._stream.step(self._backend, t)
            except Exception:
                return self._reject_last()
            if piece is None:
                return ""
            self.prefix_offset = self.read_offset
            self.read_offset = len(self._ids)
            if self.stop:
                self._append_text(piece)
            else:
                self.text += piece
            return piece
        deltas = []
        for i, t in enumerate(token_ids):
            t = int(t)
            self._ids.append(t)
            self.num_output_tokens += 1
            try:
                piece = self._stream.step(self._backend, t)
            except Exception:
                deltas.append(self._reject_last())
                if self.stopped_on is None and i + 1 < len(token_ids):
                    deltas.append(self.add_tokens(token_ids[i + 1 :]))
                break
            if piece is None:
                continue
            self.prefix_offset = self.read_offset
            self.read_offset = len(self._ids)
            self._append_text(piece)
            deltas.append(piece)
            if self.stopped_on is not None:
                break
        return "".join(deltas)

    def _reject_last(self) -> str:
        """The stream rejected the newest token (the window's start rendered differently with it): that
        token goes through the Python path, and the stream restarts once the window is all read."""
        self._stream = None
        delta = self._emit_window()
        if self.read_offset == len(self._ids):
            self._stream = self._new_stream()
        return delta

    def _emit_window(self) -> str:
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
        self._append_text(delta)
        return delta

    def _append_text(self, delta: str) -> None:
        old_len = len(self.text)
        self.text += delta
        if self.stop and delta and self.num_output_tokens > self.min_tokens:
            self._check_stop(old_len)

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

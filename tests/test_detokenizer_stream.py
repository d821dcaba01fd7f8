"""The detokenizer's ``DecodeStream`` path gives the same deltas, text and stop as its Python path.

The Python path (two ``decode`` calls a token over a window of ids) is the reference: both paths run
the same window scheme, so on one token at a time they must agree exactly, string for string.
"""

import random

import pytest

from kvforge.engine import detokenizer as detok
from kvforge.engine.detokenizer import IncrementalDetokenizer

pytest.importorskip("tokenizers.decoders", reason="tokenizers")
if detok.DecodeStream is None:
    pytest.skip("this tokenizers has no DecodeStream", allow_module_level=True)

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
        " héllo, 世界 🙂 ñ 日本語のテキスト 👍🏽 naïve café — “quotes” \t tabs\n")
STOPS = (" the", "e", "\n\n", "🙂", "peak", "日本")


@pytest.fixture(scope="module")
def tokenizer():
    from kvforge.spec.embedded import embedded_model_path
    from kvforge.tokenizer import load_tokenizer

    return load_tokenizer(embedded_model_path())


def _python_path(tokenizer, *args, **kwargs):
    saved, detok.DecodeStream = detok.DecodeStream, None
    try:
        d = IncrementalDetokenizer(tokenizer, *args, **kwargs)
    finally:
        detok.DecodeStream = saved
    assert d._stream is None
    return d


def _cases(tokenizer, n_cases, seed):
    rnd = random.Random(seed)
    vocab = tokenizer.vocab_size
    text_ids = tokenizer.encode(TEXT * 4, add_special_tokens=False)
    for case in range(n_cases):
        n = rnd.randrange(1, 120)
        if case % 3 == 0:  # any id, special tokens and lone byte tokens included
            out = [rnd.randrange(vocab) if rnd.random() < 0.6 else rnd.randrange(300) for _ in range(n)]
        else:  # real text, every fifth id replaced in one case of three
            i = rnd.randrange(len(text_ids) - n)
            out = [x if case % 3 == 1 or rnd.random() < 0.8 else rnd.randrange(vocab) for x in text_ids[i:i + n]]
        prompt = [rnd.randrange(vocab) for _ in range(rnd.randrange(9))]
        stop = tuple(rnd.sample(STOPS, rnd.randrange(3)))
        yield prompt, out, dict(stop=stop, skip_special_tokens=rnd.random() < 0.7,
                                include_stop=rnd.random() < 0.3, min_tokens=rnd.choice((0, 0, 5)))


def _run(d, out):
    deltas, streamed = [], []
    for t in out:
        deltas.append(d.add_tokens([t]))
        streamed.append(d.output_text(finished=False))
    return deltas, streamed, d.text, d.stopped_on


def test_stream_path_is_taken_for_a_tokenizers_backend(tokenizer):
    assert IncrementalDetokenizer(tokenizer, tokenizer.encode("Once upon a time"))._stream is not None


def test_stream_path_equals_python_path_token_by_token(tokenizer):
    for prompt, out, kw in _cases(tokenizer, 300, seed=0):
        fast = IncrementalDetokenizer(tokenizer, prompt, **kw)
        assert _run(fast, out) == _run(_python_path(tokenizer, prompt, **kw), out), (prompt, out, kw)


def test_text_ids_decode_to_the_text(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [])
    assert "".join(d.add_tokens([t]) for t in ids) == tokenizer.decode(ids) == d.text
    assert "🙂" in d.text and "\ufffd" not in d.text


class _RejectingStream:
    """The library's stream, rejecting every ``every``-th token as it does for a window whose start
    renders differently with more context."""

    calls = 0

    def __init__(self, ids, skip_special_tokens):
        self._inner = _RealStream(ids, skip_special_tokens=skip_special_tokens)

    def step(self, backend, token):
        type(self).calls += 1
        if type(self).calls % self.every == 0:
            raise RuntimeError("invalid prefix")
        return self._inner.step(backend, token)


_RealStream = detok.DecodeStream


@pytest.mark.parametrize("every", [1, 2, 7])
def test_a_rejected_token_goes_through_the_python_path(tokenizer, monkeypatch, every):
    cases = list(_cases(tokenizer, 60, seed=every))
    monkeypatch.setattr(_RejectingStream, "every", every, raising=False)
    monkeypatch.setattr(detok, "DecodeStream", _RejectingStream)
    for prompt, out, kw in cases:
        _RejectingStream.calls = 0
        fast = IncrementalDetokenizer(tokenizer, prompt, **kw)
        got = _run(fast, out)
        monkeypatch.setattr(detok, "DecodeStream", None)
        want = _run(IncrementalDetokenizer(tokenizer, prompt, **kw), out)
        monkeypatch.setattr(detok, "DecodeStream", _RejectingStream)
        assert got == want, (prompt, out, kw)
        assert _RejectingStream.calls > 0


def test_several_tokens_at_once_step_the_stream_one_by_one(tokenizer):
    for prompt, out, kw in _cases(tokenizer, 60, seed=3):
        one = IncrementalDetokenizer(tokenizer, prompt, **kw)
        for t in out:
            one.add_tokens([t])
        chunked = IncrementalDetokenizer(tokenizer, prompt, **kw)
        for i in range(0, len(out), 3):
            chunked.add_tokens(out[i:i + 3])
        assert (chunked.text, chunked.stopped_on) == (one.text, one.stopped_on)


def test_a_stream_without_prefill_ids_leaves_the_python_path(tokenizer, monkeypatch):
    class NoPrefill:
        def __init__(self, skip_special_tokens=False):
            pass

    monkeypatch.setattr(detok, "DecodeStream", NoPrefill)
    d = IncrementalDetokenizer(tokenizer, [5, 6])
    assert d._stream is None
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    for t in ids:
        d.add_tokens([t])
    assert d._stream is None and d.text == tokenizer.decode(ids)


def test_a_tokenizer_without_a_tokenizers_backend_uses_the_python_path():
    class Chars:
        backend = object()

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids)

    d = IncrementalDetokenizer(Chars(), [0])
    assert d._stream is None
    assert [d.add_tokens([i]) for i in (1, 2)] == ["b", "c"] and d.text == "bc"

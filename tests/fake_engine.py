"""A tiny deterministic stand-in for ``LLMEngine`` (docs/ENGINE_API.md), and the real engine the
server tests use.

``FakeEngine`` is for tests of server and load-generator mechanics where the model is not the
point and a fast, controllable step is (queue bounds, SIGTERM drain, timing); tests construct it
explicitly. Everything about outputs runs on ``smollm2_test_engine()``. The fake:

* the tokenizer is character level (token id = code point, EOS = 0);
* the "model" picks the next token from a hash of the whole sequence so far
  (greedy is a pure function of the prompt, independent of batching); sampling
  with temperature > 0 uses a per-request RNG seeded by ``seed``;
* a block counter (``block_size`` tokens a block) allocates blocks on admission
  and as sequences grow and frees them on finish or abort, so leaks are
  observable through ``stats()["kv_blocks_used"]``;
* at most ``max_num_seqs`` requests run at once; the rest wait (FIFO).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import threading
import time
from dataclasses import dataclass, field

from kvforge.engine.outputs import CompletionOutput, RequestOutput
from kvforge.engine.sampling_params import SamplingParams
from kvforge.errors import InvalidRequestError

_ALPHABET = "abcdefghijklmnopqrstuvwxyz     ."


class FakeTokenizer:
    eos_token_id = 0
    eos_token_ids = (0,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids if not (skip_special_tokens and t == 0))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False, **_):
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text) if tokenize else text


class FakePlan:
    def summary(self) -> str:
        return "fake plan: block_size=4, kv_cache_dtype=auto, blocks=4096"


@dataclass
class _Req:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    rng: random.Random
    out_ids: list[int] = field(default_factory=list)
    lps: list[dict] = field(default_factory=list)
    blocks: int = 0
    first_step: bool = True


class FakeEngine:
    """Implements the synchronous engine contract with trivial compute."""

    model_name = "fake-model"
    vocab_size = 0x10000

    def __init__(
        self,
        max_model_len: int = 512,
        block_size: int = 4,
        num_blocks: int = 4096,
        max_num_seqs: int = 16,
        step_delay: float = 0.0,
    ):
        self.tokenizer = FakeTokenizer()
        self.plan = FakePlan()
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._blocks_used = 0
        self._prompt_tokens = 0
        self._gen_tokens = 0
        self._queries = 0
        # The contract says the engine is not thread-safe; catch misuse loudly.
        self._busy = threading.Lock()

    # -- contract -------------------------------------------------------------

    def add_request(self, request_id: str, prompt, params: SamplingParams) -> None:
        with self._guard():
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt)
            else:
                ids = list(prompt)
            if not ids:
                raise InvalidRequestError("prompt must not be empty", field="prompt")
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", field="prompt")
            if len(ids) >= self.max_model_len:
                raise InvalidRequestError(
                    f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}", field="prompt"
                )
            if any(r.request_id == request_id for r in self._waiting + self._running):
                raise InvalidRequestError(f"duplicate request id {request_id}", field="request_id")
            seed = params.seed if params.seed is not None else random.randrange(1 << 30)
            self._waiting.append(
                _Req(request_id, prompt if isinstance(prompt, str) else None, ids, params, random.Random(seed))
            )

    def abort_request(self, request_id: str) -> None:
        with self._guard():
            for queue in (self._waiting, self._running):
                for r in list(queue):
                    if r.request_id == request_id:
                        queue.remove(r)
                        self._free(r)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def stats(self) -> dict:
        return {
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
            "kv_blocks_used": self._blocks_used,
            "kv_blocks_total": self.num_blocks,
            "prefix_cache_queries": self._queries,
            "prefix_cache_hits": 0,
            "num_preemptions": 0,
            "prompt_tokens_total": self._prompt_tokens,
            "generation_tokens_total": self._gen_tokens,
        }

    def step(self) -> list[RequestOutput]:
        with self._guard():
            if self.step_delay:
                time.sleep(self.step_delay)
            while self._waiting and len(self._running) < self.max_num_seqs:
                r = self._waiting.pop(0)
                self._running.append(r)
                self._prompt_tokens += len(r.prompt_ids)
                self._queries += len(r.prompt_ids)
            outputs = []
            for r in list(self._running):
                tok = self._next_token(r)
                r.out_ids.append(tok)
                self._gen_tokens += 1
                self._grow(r)
                finish, stop_reason = self._finish_reason(r, tok)
                # The engine's text: a stop token (a stop_token_ids entry, or EOS) adds none, a stop string is cut.
                stop_token = isinstance(stop_reason, int) or tok == self.tokenizer.eos_token_id
                shown = r.out_ids[:-1] if finish == "stop" and stop_token else r.out_ids
                text = self.tokenizer.decode(shown, r.params.skip_special_tokens)
                if finish == "stop" and isinstance(stop_reason, str):
                    text = text[: text.find(stop_reason)]
                lps = None
                if r.params.logprobs is not None:
                    ranked = [tok] + self._alts(tok, r.params.logprobs)
                    r.lps.append({t: -1.0 - 0.1 * i for i, t in enumerate(ranked[: r.params.logprobs + 1])})
                    lps = list(r.lps)
                comp = CompletionOutput(0, text, list(r.out_ids), finish, stop_reason, lps)
                outputs.append(RequestOutput(r.request_id, r.prompt, list(r.prompt_ids), [comp], finish is not None))
                if finish is not None:
                    self._running.remove(r)
                    self._free(r)
            return outputs

    # -- internals --------------------------------------------------------------

    def _guard(self):
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("FakeEngine called from two threads at once")
        lock = self._busy

        class _Release:
            def __enter__(self):
                return None

            def __exit__(self, *exc):
                lock.release()
                return False

        return _Release()

    @staticmethod
    def _alts(tok: int, n: int) -> list[int]:
        return [ord(c) for c in _ALPHABET if ord(c) != tok][:n]

    def _next_token(self, r: _Req) -> int:
        if r.params.is_greedy:
            h = hashlib.blake2b(bytes(str(r.prompt_ids + r.out_ids), "utf8"), digest_size=4).digest()
            return ord(_ALPHABET[int.from_bytes(h, "little") % len(_ALPHABET)])
        return ord(r.rng.choice(_ALPHABET))

    def _finish_reason(self, r: _Req, tok: int):
        p = r.params
        if tok in p.stop_token_ids:
            return "stop", tok
        if p.stop:
            text = self.tokenizer.decode(r.out_ids)
            for s in p.stop:
                if s in text:
                    return "stop", s
        if p.max_tokens is not None and len(r.out_ids) >= p.max_tokens:
            return "length", None
        if len(r.prompt_ids) + len(r.out_ids) >= self.max_model_len:
            return "length", None
        return None, None

    def _grow(self, r: _Req) -> None:
        need = -(-(len(r.prompt_ids) + len(r.out_ids)) // self.block_size)
        self._blocks_used += need - r.blocks
        r.blocks = need

    def _free(self, r: _Req) -> None:
        self._blocks_used -= r.blocks
        r.blocks = 0


class ScriptedEngine(FakeEngine):
    """A FakeEngine whose every request writes ``script`` (one character a token), then ends with EOS: a model
    output fixed by the test, for server behaviour that reads the output's text."""

    def __init__(self, script: str, **kwargs):
        super().__init__(**kwargs)
        self.script = script

    def _next_token(self, r: _Req) -> int:
        k = len(r.out_ids)
        return ord(self.script[k]) if k < len(self.script) else self.tokenizer.eos_token_id

    def _finish_reason(self, r: _Req, tok: int):
        if tok == self.tokenizer.eos_token_id and not r.params.ignore_eos:
            return "stop", None
        return super()._finish_reason(r, tok)


def smollm2_test_engine(max_model_len: int = 512, max_num_seqs: int = 32, extra_args: tuple[str, ...] = ()):
    """The real engine on the embedded SmolLM2 (CPU), built through its command-line arguments
    (``extra_args`` appended)."""
    import argparse

    from kvforge.config import EngineArgs
    from kvforge.engine.llm_engine import LLMEngine

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--device", "cpu", "--max-model-len", str(max_model_len), "--max-num-seqs",
                            str(max_num_seqs), "--no-progress", *extra_args])
    return LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))


@contextlib.contextmanager
def smollm2_server(max_model_len: int = 512, max_num_seqs: int = 8, extra_args: tuple[str, ...] = (),
                   **app_kwargs):
    """A server (``ServerThread``) over a fresh embedded-model engine (``--kv-cache-memory 256M`` unless
    ``extra_args`` set it), ``app_kwargs`` going to ``create_app``; both stopped on exit."""
    from kvforge.server.app import ServerThread, create_app

    if "--kv-cache-memory" not in extra_args:
        extra_args = ("--kv-cache-memory", "256M", *extra_args)
    engine = smollm2_test_engine(max_model_len, max_num_seqs, extra_args)
    srv = ServerThread(create_app(engine, **app_kwargs)).start()
    try:
        yield srv
    finally:
        srv.stop()
        engine.shutdown()


def openai_client(srv):
    """The official openai client of server ``srv`` (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def serve_refused(monkeypatch, capsys, argv: list[str]) -> str:
    """Run ``kvforge serve --device cpu ARGV`` on a free port, which must stop with exit code 2 before any weight
    is read and without a traceback; returns what it printed to stderr."""
    import socket

    import kvforge.weights
    from kvforge.server.cli import serve_main

    def boom(*a, **k):
        raise AssertionError(f"weights were loaded despite {argv}")

    monkeypatch.setattr(kvforge.weights, "load_weights", boom)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert serve_main(["--device", "cpu", *argv, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err

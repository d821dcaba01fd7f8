"""kvforge.eval.gsm8k: scorer, prompt builder, and runs against a stub and the real server.

The real-server run reads tests/data/gsm8k_style (a few GSM8K-format word problems written for
these tests), so nothing here needs the GSM8K dataset itself."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import threading
from pathlib import Path

import pytest

from kvforge.eval import gsm8k
from kvforge.eval.cli import add_gsm8k_args, gsm8k_main
from kvforge.eval.gsm8k import (
    INVALID,
    build_prompt,
    extract_flexible,
    extract_strict,
    normalize,
    score_completion,
    target_answer,
)

FIXTURE_DIR = Path(__file__).parent / "data" / "gsm8k_style"

# lm-evaluation-harness lm_eval/tasks/gsm8k/gsm8k.yaml (version 3.0), filter_list and
# metric_list.regexes_to_ignore, as written there.
LM_EVAL_STRICT = r"#### (\-?[0-9\.\,]+)"
LM_EVAL_FLEXIBLE = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"
LM_EVAL_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")


# ---------------------------------------------------------------------------
# scorer
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, target, strict_pred, flexible_pred, strict_ok, flexible_ok",
    [
        # The dataset's own format: both filters find it.
        (" She has 40 + 2 = 42 apples.\n#### 42", "42", "42", "42", True, True),
        # lm-eval's gsm8k strict filter knows only "#### " (not the CoT task's "The answer is").
        (" 10 boxes of 100 each. The answer is 1,000.", "1000", INVALID, "1000", False, True),
        # Thousands separator and a sentence-ending period after the marker.
        (" 10 boxes of 100 each.\n#### 1,000.", "1000", "1000", "1000", True, True),
        # No marker: only the flexible filter (last number) scores it.
        (" so 3 apples then 7", "7", INVALID, "7", False, True),
        # Flexible takes the LAST number, so a wrong trailing number loses it.
        (" 7 apples, then 3 left", "7", INVALID, "3", False, False),
        # Negative numbers.
        (" The temperature fell to -5 degrees.\n#### -5", "-5", "-5", "-5", True, True),
        # Decimals are compared as strings, as in lm-eval.
        (" Each costs $2.50.\n#### 2.50", "2.50", "2.50", "2.50", True, True),
        (" #### 2.5", "2.50", "2.5", "2.5", False, False),
        # Dollars and commas are ignored on both sides ...
        (" He made $70,000 profit.\n#### 70,000", "70000", "70000", "70000", True, True),
        # ... but, as in lm-eval, the strict pattern wants a digit right after "#### ".
        (" He made a profit.\n#### $70,000", "70000", INVALID, "70000", False, True),
        # Strict takes the FIRST marker, flexible the last number.
        (" #### 5\nQuestion nonsense 6", "5", "5", "6", True, False),
        # No number at all.
        (" I do not know.", "3", INVALID, INVALID, False, False),
        ("", "3", INVALID, INVALID, False, False),
    ],
)
def test_score_completion(completion, target, strict_pred, flexible_pred, strict_ok, flexible_ok):
    sc = score_completion(completion, target)
    assert sc.strict_pred == strict_pred
    assert sc.flexible_pred == flexible_pred
    assert sc.strict_correct is strict_ok
    assert sc.flexible_correct is flexible_ok


def test_extractors_raw():
    assert extract_strict("#### 1,234.") == "1,234."
    assert extract_strict("The answer is 18.") == INVALID
    assert extract_strict("answer: 18") == INVALID
    assert extract_flexible("costs $18.") == "$18."
    assert extract_flexible("a 1 b 22 c") == "22"
    assert extract_flexible("no digits") == INVALID


def test_normalize_and_target():
    assert normalize(" $1,000. ") == "1000"
    assert normalize("3.5") == "3.5"  # only ONE trailing period, and only at the end
    assert target_answer("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs.\n#### 18") == "18"
    assert target_answer("step\n#### 1,200") == "1200"


def test_truncate_at_stop():
    assert gsm8k.truncate_at_stop(" 4\n#### 4\n\nQuestion: next") == " 4\n#### 4\n\n"
    assert gsm8k.truncate_at_stop("abc<|im_end|>x</s>") == "abc"
    assert gsm8k.truncate_at_stop("plain") == "plain"


# ---------------------------------------------------------------------------
# prompt builder
# ---------------------------------------------------------------------------


SHOTS = [
    {"question": "What is 1+1?", "answer": "1+1=<<1+1=2>>2\n#### 2"},
    {"question": "What is 2*3?", "answer": "2*3=<<2*3=6>>6\n#### 6"},
]


def test_build_prompt_exact():
    p = build_prompt("What is 5-4?", SHOTS)
    assert p == (
        "Question: What is 1+1?\nAnswer: 1+1=<<1+1=2>>2\n#### 2\n\n"
        "Question: What is 2*3?\nAnswer: 2*3=<<2*3=6>>6\n#### 6\n\n"
        "Question: What is 5-4?\nAnswer:"
    )
    assert build_prompt("Q?", []) == "Question: Q?\nAnswer:"


def test_filters_are_lm_evals():
    """The patterns are lm-eval's gsm8k filters verbatim, and behave as its regex filter does
    (findall; strict takes the first match, flexible the last, its non-empty group)."""
    assert gsm8k.STRICT_RE.pattern == LM_EVAL_STRICT
    assert gsm8k.FLEXIBLE_RE.pattern == LM_EVAL_FLEXIBLE
    for text in ["#### 5 then #### 6", "costs $1,250.50 or 7", "x -3 y", "The answer is 4.", "#### -2.5\n"]:
        strict = re.findall(LM_EVAL_STRICT, text)
        assert extract_strict(text) == (strict[0] if strict else INVALID)
        flexible = re.findall(LM_EVAL_FLEXIBLE, text)
        assert extract_flexible(text) == (next(g for g in flexible[-1] if g) if flexible else INVALID)


def test_prompt_uses_first_train_examples():
    train = gsm8k.load_split(FIXTURE_DIR, "train", 3)
    test = gsm8k.load_split(FIXTURE_DIR, "test", 1)
    p = build_prompt(test[0]["question"], train)
    assert p.count("Question: ") == 4
    assert p.startswith("Question: " + train[0]["question"] + "\nAnswer: " + train[0]["answer"] + "\n\n")
    assert p.endswith("Question: " + test[0]["question"] + "\nAnswer:")
    assert p.count("#### ") == 3


def test_urls():
    assert gsm8k.completions_url("http://h:1") == "http://h:1/v1/completions"
    assert gsm8k.completions_url("http://h:1/v1/") == "http://h:1/v1/completions"
    assert gsm8k.models_url("http://h:1/v1") == "http://h:1/v1/models"


def test_summarize_stderr():
    rows = [{"strict_correct": c, "flexible_correct": True} for c in (True, False, True, False)]
    s = gsm8k.summarize(rows, 5)
    assert s["n"] == 4 and s["strict_match"] == 0.5 and s["flexible_extract"] == 1.0
    # sample std of [1,0,1,0] = sqrt(1/3); / sqrt(4)
    assert s["strict_match_stderr"] == pytest.approx((1 / 3) ** 0.5 / 2)
    assert s["flexible_extract_stderr"] == 0.0


# ---------------------------------------------------------------------------
# end to end against a stub OpenAI server (always runs)
# ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StubServer:
    """A tiny aiohttp OpenAI /v1/completions stub in a background thread.

    It answers each test question from a canned table keyed by the question
    text at the end of the prompt, and records every request body.
    """

    def __init__(self, answers: dict[str, str], api_key: str | None = None, fail_first: int = 0):
        self.answers = answers
        self.api_key = api_key
        self.protect_models = False  # /v1/models asks for the key too
        self.fail_first = fail_first
        self.requests: list[dict] = []
        self.port = _free_port()
        self._ready = threading.Event()
        self._loop = None
        self._runner = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self):
        from aiohttp import web

        async def models(request):
            if self.protect_models and request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return web.json_response({"error": {"message": "bad key"}}, status=401)
            return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

        async def completions(request):
            if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
                return web.json_response({"error": {"message": "bad key"}}, status=401)
            body = await request.json()
            self.requests.append(body)
            if self.fail_first > 0:
                self.fail_first -= 1
                return web.json_response({"error": {"message": "overloaded"}}, status=503)
            last_q = body["prompt"].rsplit("Question: ", 1)[1].rsplit("\nAnswer:", 1)[0]
            text = self.answers.get(last_q, " I am not sure.")
            return web.json_response(
                {
                    "id": "cmpl-1",
                    "object": "text_completion",
                    "model": body.get("model"),
                    "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
                    "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110},
                }
            )

        async def main():
            app = web.Application()
            app.router.add_get("/v1/models", models)
            app.router.add_post("/v1/completions", completions)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            await site.start()
            self._ready.set()
            self._stop = asyncio.Event()
            await self._stop.wait()
            await self._runner.cleanup()

        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(main())
        self._loop.close()

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10), "stub server did not start"
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def _write_data(tmp_path: Path) -> Path:
    d = tmp_path / "gsm8k"
    d.mkdir()
    test = [
        {"question": "Q one?", "answer": "work\n#### 12"},
        {"question": "Q two?", "answer": "work\n#### 1,500"},
        {"question": "Q three?", "answer": "work\n#### 7"},
        {"question": "Q four?", "answer": "work\n#### 9"},
    ]
    train = [{"question": f"T{i}?", "answer": f"t{i}\n#### {i}"} for i in range(8)]
    (d / "test.jsonl").write_text("".join(json.dumps(x) + "\n" for x in test))
    (d / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in train))
    return d


CANNED = {
    "Q one?": " 6 + 6 = 12\n#### 12",  # strict and flexible
    "Q two?": " That is 1,500 in total",  # flexible only
    "Q three?": " #### 8\n\nQuestion: extra 7",  # wrong; text after 'Question:' must be cut
    "Q four?": " #### 9",
}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_gsm8k_args(p)
    return p.parse_args(argv)


def test_stub_end_to_end_cli(tmp_path, capsys):
    data = _write_data(tmp_path)
    out = tmp_path / "out.jsonl"
    with StubServer(CANNED, api_key="sekret") as srv:
        args = _parse(
            ["--base-url", srv.url, "--data-dir", str(data), "--limit", "3", "--num-fewshot", "2",
             "--concurrency", "2", "--output", str(out), "--api-key", "sekret", "--json", "--no-progress"]
        )
        rc = gsm8k_main(args)
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["n"] == 3
    assert summary["model"] == "stub-model"  # discovered through /v1/models
    assert summary["strict_match"] == pytest.approx(1 / 3)
    assert summary["flexible_extract"] == pytest.approx(2 / 3)
    assert summary["errors"] == 0

    # The request shape: greedy, 256 tokens, lm-eval's stop list, few-shot prompt.
    assert len(srv.requests) == 3
    req = srv.requests[0]
    assert req["temperature"] == 0 and req["max_tokens"] == 256
    assert req["stop"] == ["Question:", "</s>", "<|im_end|>"]
    assert req["model"] == "stub-model"
    assert req["prompt"].startswith("Question: T0?\nAnswer: t0\n#### 0\n\nQuestion: T1?\nAnswer: t1\n#### 1\n\n")
    assert req["prompt"].count("Question: ") == 3

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["question"] for r in rows] == ["Q one?", "Q two?", "Q three?"]
    keys = {"question", "target", "completion", "strict_pred", "flexible_pred", "strict_correct", "flexible_correct"}
    assert keys <= set(rows[0])
    assert (rows[0]["strict_correct"], rows[0]["flexible_correct"]) == (True, True)
    assert (rows[1]["strict_pred"], rows[1]["flexible_pred"], rows[1]["target"]) == (INVALID, "1500", "1500")
    assert (rows[1]["strict_correct"], rows[1]["flexible_correct"]) == (False, True)
    assert rows[2]["completion"] == " #### 8\n\n"  # cut at the stop sequence
    assert (rows[2]["strict_correct"], rows[2]["flexible_correct"]) == (False, False)


def test_stub_table_output_and_retry(tmp_path, capsys):
    data = _write_data(tmp_path)
    with StubServer(CANNED, fail_first=1) as srv:
        args = _parse(["--base-url", srv.url + "/v1", "--model", "m", "--data-dir", str(data),
                       "--num-fewshot", "0", "--no-progress"])
        rc = gsm8k_main(args)
    assert rc == 0  # the 503 was retried
    out = capsys.readouterr().out
    assert "flexible-extract" in out and "strict-match" in out
    assert "0.5000" in out  # strict: Q one, Q four
    assert "0.7500" in out  # flexible: + Q two
    assert all(r["model"] == "m" for r in srv.requests)
    assert "Question: " in srv.requests[0]["prompt"] and "#### " not in srv.requests[0]["prompt"]


def test_a_run_whose_every_request_failed_reports_no_score(tmp_path, capsys):
    """No accuracy (not 0.0) where nothing reached the model; the error names the refused key."""
    data = _write_data(tmp_path)
    with StubServer(CANNED, api_key="right") as srv:
        args = _parse(["--base-url", srv.url, "--model", "m", "--data-dir", str(data), "--limit", "2",
                       "--api-key", "wrong", "--json", "--no-progress"])
        rc = gsm8k_main(args)
    assert rc == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "all 2 requests failed, so there is no score" in captured.err and "HTTP 401" in captured.err
    assert "refused the API key sent" in captured.err and "pass --api-key" not in captured.err


def test_data_dir_may_name_the_data_folder_like_the_environment_variable(tmp_path, capsys):
    """``--data-dir`` naming the folder that holds gsm8k/ (as $KVFORGE_DATA_DIR does) runs the same questions
    as naming gsm8k/ itself."""
    data = _write_data(tmp_path)
    summaries = []
    with StubServer(CANNED) as srv:
        for folder in (data, data.parent):
            args = _parse(["--base-url", srv.url, "--model", "m", "--data-dir", str(folder), "--limit", "4",
                           "--num-fewshot", "1", "--json", "--no-progress"])
            assert gsm8k_main(args) == 0
            summary = json.loads(capsys.readouterr().out)
            summary.pop("elapsed_s")  # wall time: the one field that differs between the runs
            summaries.append(summary)
    assert summaries[0]["n"] == 4 and summaries[0] == summaries[1]


def test_missing_data_dir(tmp_path, capsys):
    args = _parse(["--base-url", "http://127.0.0.1:9", "--data-dir", str(tmp_path / "nope"), "--no-progress"])
    assert gsm8k_main(args) == 2  # a usage error, as the other commands exit
    assert "test.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("kvforge_key, openai_key", [(None, "from-env"), ("from-env", "wrong")],
                         ids=["openai", "kvforge-first"])
def test_api_key_from_environment(tmp_path, capsys, monkeypatch, kvforge_key, openai_key):
    """Without --api-key the client sends $KVFORGE_API_KEY, else $OPENAI_API_KEY (kvforge/server/api_keys.py)."""
    data = _write_data(tmp_path)
    monkeypatch.setenv("OPENAI_API_KEY", openai_key)
    if kvforge_key is None:
        monkeypatch.delenv("KVFORGE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("KVFORGE_API_KEY", kvforge_key)
    with StubServer(CANNED, api_key="from-env") as srv:
        args = _parse(["--base-url", srv.url, "--data-dir", str(data), "--limit", "2", "--json", "--no-progress"])
        assert gsm8k_main(args) == 0
    assert json.loads(capsys.readouterr().out)["errors"] == 0
    assert len(srv.requests) == 2


@pytest.mark.parametrize("model", [None, "m"], ids=["models-listing", "completions"])
def test_unauthorized_names_the_key_and_flag(tmp_path, capsys, monkeypatch, model):
    """HTTP 401, from /v1/models (a usage error, exit 2, as bench serve's) or from /v1/completions (every
    request failed: exit 1), ends with a hint naming --api-key and both environment variables."""
    data = _write_data(tmp_path)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("KVFORGE_API_KEY", raising=False)
    with StubServer(CANNED, api_key="right") as srv:
        srv.protect_models = True
        argv = ["--base-url", srv.url, "--data-dir", str(data), "--limit", "1", "--no-progress"]
        assert gsm8k_main(_parse(argv + (["--model", model] if model else []))) == (1 if model else 2)
    err = capsys.readouterr().err
    assert "401" in err and "--api-key" in err and "KVFORGE_API_KEY" in err and "OPENAI_API_KEY" in err


# ---------------------------------------------------------------------------
# end to end against the real kvforge server
# ---------------------------------------------------------------------------


def _lm_eval_score(completion: str, answer: str) -> tuple[bool, bool]:
    """(strict, flexible) exact match as lm-eval's gsm8k task computes them, from its yaml."""

    def norm(x: str) -> str:
        for rx in LM_EVAL_IGNORE:
            x = re.sub(rx, "", x)
        return x.lower()

    target = norm(answer)
    strict = re.findall(LM_EVAL_STRICT, completion)
    flexible = [next(g for g in m if g) for m in re.findall(LM_EVAL_FLEXIBLE, completion)]
    return (bool(strict) and norm(strict[0].strip()) == target,
            bool(flexible) and norm(flexible[-1].strip()) == target)


@pytest.mark.slow
def test_real_server_limit_3(tmp_path, capsys):
    """The embedded SmolLM2 behind the real kvforge server (CPU), 3 questions of tests/data.

    Kept short for CPU (2 shots, 48 new tokens): this checks the plumbing, the per-question
    records and the scores (recomputed here from lm-eval's patterns), not the model's accuracy.
    """
    from kvforge.config import EngineArgs
    from kvforge.engine.llm_engine import LLMEngine
    from kvforge.server.app import ServerThread, create_app

    engine = LLMEngine.from_engine_args(
        EngineArgs(device="cpu", max_model_len=1024, kv_cache_memory=64 << 20, progress=False)
    )
    out = tmp_path / "real.jsonl"
    with ServerThread(create_app(engine)) as srv:
        args = _parse(["--base-url", srv.url, "--data-dir", str(FIXTURE_DIR), "--limit", "3", "--num-fewshot", "2",
                       "--max-tokens", "48", "--concurrency", "3", "--output", str(out), "--json", "--no-progress"])
        rc = gsm8k_main(args)
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["n"] == 3 and summary["errors"] == 0
    assert summary["model"] == engine.model_name
    assert summary["completion_tokens"] > 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    test_docs = gsm8k.load_split(FIXTURE_DIR, "test", 3)
    assert [r["question"] for r in rows] == [d["question"] for d in test_docs]
    expected = [_lm_eval_score(r["completion"], d["answer"]) for r, d in zip(rows, test_docs)]
    assert [(r["strict_correct"], r["flexible_correct"]) for r in rows] == expected
    assert summary["strict_match"] == pytest.approx(sum(e[0] for e in expected) / 3)
    assert summary["flexible_extract"] == pytest.approx(sum(e[1] for e in expected) / 3)
    for r in rows:
        assert r["completion"].strip(), r  # the model said something
        assert "Question:" not in r["completion"]
        assert r["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("argv, needle", [
    (["--base-url", "notaurl"], "argument --base-url: 'notaurl' is not an http(s) URL"),
    (["--base-url", "http://127.0.0.1:9", "--max-tokens", "0"], "argument --max-tokens: '0' must be >= 1"),
    (["--base-url", "http://127.0.0.1:9", "--timeout", "-1"], "argument --timeout: '-1' must be > 0"),
    (["--base-url", "http://127.0.0.1:9", "--limit", "0"], "argument --limit: '0' must be >= 1"),
    (["--base-url", "http://127.0.0.1:9", "--num-fewshot", "-1"], "argument --num-fewshot: '-1' must be >= 0"),
    # checked before the questions run, not when the answers are written
    (["--base-url", "http://127.0.0.1:9", "--output", "/nonexistent/a.jsonl"],
     "argument --output: the folder '/nonexistent' does not exist"),
])
def test_bad_values_are_usage_errors_naming_the_flag(capsys, argv, needle):
    from kvforge.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["eval", "gsm8k", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "kvforge eval gsm8k: error: " + needle in err


def test_no_server_at_the_url_says_how_to_start_one(tmp_path, capsys):
    data = _write_data(tmp_path)
    with socket.socket() as s:  # a port nobody listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = _parse(["--base-url", f"http://127.0.0.1:{port}", "--data-dir", str(data), "--limit", "1",
                   "--no-progress"])
    assert gsm8k_main(args) == 2
    err = capsys.readouterr().err
    assert f"cannot reach a server at --base-url http://127.0.0.1:{port}" in err and "kvforge serve" in err

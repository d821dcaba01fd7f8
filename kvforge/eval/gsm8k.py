"""GSM8K over an OpenAI-compatible ``/v1/completions`` endpoint.

Follows lm-evaluation-harness's ``gsm8k`` task (the plain, non-CoT one, version 3), with one
named difference, the few-shot choice:

* prompt: ``Question: {question}\\nAnswer:``; each few-shot example is that
  prompt, a space and the full worked answer from the train split (ending in
  ``#### N``); examples are separated by a blank line.
* few-shot examples: the FIRST ``num_fewshot`` of the train split, as lm-eval
  does only with ``sampler: first_n``. lm-eval's gsm8k task uses its default
  sampler, which draws them at random from the train split (fixed seed), so
  scores are close to lm-eval's but not identical.
* greedy decoding, ``max_tokens`` 256, stop at ``Question:``, ``</s>`` and
  ``<|im_end|>``.
* two filters, both scored by exact match after normalization, exactly
  lm-eval's:
  ``strict-match``: regex ``#### (\\-?[0-9\\.\\,]+)``, first match;
  ``flexible-extract``: regex ``(-?[$0-9.,]{2,})|(-?[0-9]+)``, last match
  (``group_select: -1``), its non-empty group.
* normalization (lm-eval's ``regexes_to_ignore`` plus ``ignore_case``):
  drop commas, dollar signs, everything up to ``#### `` and one trailing ``.``.
  Comparison stays a string comparison, as in lm-eval ("3.50" != "3.5").

The scorer, the prompt builder and the data loader are plain functions (no
network) so they can be unit tested; :func:`run_gsm8k` does the HTTP part.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvforge.server.api_keys import unauthorized_hint

DEFAULT_NUM_FEWSHOT = 5
DEFAULT_MAX_TOKENS = 256
DEFAULT_CONCURRENCY = 16
STOP_SEQUENCES: tuple[str, ...] = ("Question:", "</s>", "<|im_end|>")
INVALID = "[invalid]"

# Strict: lm-eval gsm8k's "strict-match" pattern, first match (take_first).
STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
# Flexible: lm-eval's "flexible-extract" pattern, last match wins
# (group_select -1); a match is a tuple and the non-empty group is used.
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
# lm-eval's regexes_to_ignore for the gsm8k exact_match metric.
_IGNORE_RES = (re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))


def gsm8k_dir(given: str | Path | None = None) -> Path:
    """The GSM8K folder (holding test.jsonl): ``given`` (``--data-dir``) as a folder holding ``gsm8k/`` or
    the ``gsm8k/`` folder itself, else ``gsm8k/`` in the evaluation data folder (kvforge/data_paths.py,
    ``dataset_dir``); FileNotFoundError naming the folders tried when there is none."""
    from kvforge.data_paths import dataset_dir

    return dataset_dir("gsm8k", "test.jsonl", given)


# ---------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------


def normalize(text: str) -> str:
    """Apply lm-eval's gsm8k normalization: strip ``,``, ``$``, ``.* #### ``,
    one trailing ``.``; lower-case; surrounding whitespace removed."""
    s = text.strip()
    for rx in _IGNORE_RES:
        s = rx.sub("", s)
    return s.strip().lower()


def extract_strict(completion: str) -> str:
    """The first number after ``#### `` (else ``[invalid]``)."""
    m = STRICT_RE.search(completion)
    return m.group(1) if m else INVALID


def extract_flexible(completion: str) -> str:
    """The last number-like token in the completion (else ``[invalid]``)."""
    matches = FLEXIBLE_RE.findall(completion)
    if not matches:
        return INVALID
    last = matches[-1]
    return next((g for g in last if g), INVALID)


def target_answer(answer: str) -> str:
    """The normalized reference answer (the text after ``#### `` in the dataset)."""
    return normalize(answer)


@dataclass(frozen=True)
class Score:
    strict_pred: str
    flexible_pred: str
    strict_correct: bool
    flexible_correct: bool


def score_completion(completion: str, target: str) -> Score:
    """Score one completion against a normalized ``target`` (see :func:`target_answer`)."""
    strict = extract_strict(completion)
    flexible = extract_flexible(completion)
    strict_pred = normalize(strict) if strict != INVALID else INVALID
    flexible_pred = normalize(flexible) if flexible != INVALID else INVALID
    return Score(
        strict_pred=strict_pred,
        flexible_pred=flexible_pred,
        strict_correct=strict_pred != INVALID and strict_pred == target,
        flexible_correct=flexible_pred != INVALID and flexible_pred == target,
    )


def truncate_at_stop(text: str, stops: tuple[str, ...] = STOP_SEQUENCES) -> str:
    """Cut ``text`` at the first stop sequence (in case a server ignores ``stop``)."""
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


# ---------------------------------------------------------------------------
# data and prompts
# ---------------------------------------------------------------------------


def load_jsonl(path: str | Path, limit: int | None = None) -> list[dict]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            docs.append(json.loads(line))
            if limit is not None and len(docs) >= limit:
                break
    return docs


def load_split(data_dir: str | Path, split: str, limit: int | None = None) -> list[dict]:
    path = Path(data_dir) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"GSM8K {split} split not found at {path} (pass --data-dir DIR holding test.jsonl and train.jsonl)"
        )
    return load_jsonl(path, limit)


def doc_to_text(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def build_fewshot_prefix(shots: list[dict]) -> str:
    """Each shot as ``Question: q\\nAnswer: full answer``, each followed by a blank line."""
    return "".join(f"{doc_to_text(d['question'])} {d['answer']}\n\n" for d in shots)


def build_prompt(question: str, shots: list[dict]) -> str:
    return build_fewshot_prefix(shots) + doc_to_text(question)


# ---------------------------------------------------------------------------
# running against a server
# ---------------------------------------------------------------------------


def completions_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    if base.endswith("/v1/completions"):
        return base
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base + "/v1/completions"


def models_url(base_url: str) -> str:
    return completions_url(base_url)[: -len("/completions")] + "/models"


@dataclass
class Gsm8kResult:
    rows: list[dict]
    summary: dict
    errors: int = 0
    extra: dict = field(default_factory=dict)


def _stderr(values: list[float]) -> float:
    """lm-eval's mean stderr: sample standard deviation / sqrt(n)."""
    n = len(values)
    if n < 2:
        return float("nan")
    mu = sum(values) / n
    var = sum((v - mu) ** 2 for v in values) / (n - 1)
    return math.sqrt(var / n)


def summarize(rows: list[dict], num_fewshot: int) -> dict:
    strict = [1.0 if r["strict_correct"] else 0.0 for r in rows]
    flexible = [1.0 if r["flexible_correct"] else 0.0 for r in rows]
    n = len(rows)
    return {
        "task": "gsm8k",
        "num_fewshot": num_fewshot,
        "n": n,
        "strict_match": sum(strict) / n if n else float("nan"),
        "strict_match_stderr": _stderr(strict),
        "flexible_extract": sum(flexible) / n if n else float("nan"),
        "flexible_extract_stderr": _stderr(flexible),
        "errors": sum(1 for r in rows if r.get("error")),
    }


async def _fetch_model_name(session, base_url: str, headers: dict) -> str:
    async with session.get(models_url(base_url), headers=headers) as resp:
        if resp.status == 401:
            raise PermissionError(f"{models_url(base_url)} answered HTTP 401 Unauthorized; "
                                  f"{unauthorized_hint(bool(headers))}")
        if resp.status != 200:
            raise RuntimeError(f"{models_url(base_url)} answered HTTP {resp.status}: {(await resp.text())[:200]}; is "
                               f"--base-url the server's root (or its /v1)?")
        body = await resp.json()
    data = body.get("data") or []
    if not data:
        raise RuntimeError(f"{models_url(base_url)} lists no models; pass --model NAME")
    return data[0]["id"]


async def _complete(session, url: str, headers: dict, payload: dict, retries: int) -> dict:
    import aiohttp

    delay = 0.5
    for attempt in range(retries + 1):
        try:
            async with session.post(url, json=payload, headers=headers) as resp:
                if resp.status >= 500 or resp.status == 429:
                    text = await resp.text()
                    raise RuntimeError(f"HTTP {resp.status}: {text[:300]}")
                if resp.status != 200:
                    # A 4xx will not get better by retrying.
                    text = await resp.text()
                    hint = f" ({unauthorized_hint(bool(headers))})" if resp.status == 401 else ""
                    return {"error": f"HTTP {resp.status}: {text[:300]}{hint}"}
                return await resp.json()
        except (TimeoutError, aiohttp.ClientError, RuntimeError) as e:
            if attempt == retries:
                return {"error": f"{type(e).__name__}: {e}"}
            await asyncio.sleep(delay)
            delay *= 2
    return {"error": "unreachable"}


async def run_gsm8k(
    base_url: str,
    *,
    model: str | None = None,
    data_dir: str | Path | None = None,
    num_fewshot: int = DEFAULT_NUM_FEWSHOT,
    limit: int | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    api_key: str | None = None,
    timeout_s: float = 600.0,
    retries: int = 2,
    progress: bool = True,
) -> Gsm8kResult:
    """Run GSM8K (test split, first ``limit`` questions) against ``base_url``; ``api_key`` is sent
    as ``Authorization: Bearer KEY``."""
    import aiohttp
    from tqdm import tqdm

    data_dir = gsm8k_dir(data_dir)
    tests = load_split(data_dir, "test", limit)
    shots = load_split(data_dir, "train", num_fewshot) if num_fewshot > 0 else []
    if len(shots) < num_fewshot:
        raise ValueError(f"asked for {num_fewshot} few-shot examples, the train split has {len(shots)}")
    prefix = build_fewshot_prefix(shots)

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    url = completions_url(base_url)
    sem = asyncio.Semaphore(max(1, concurrency))
    rows: list[dict | None] = [None] * len(tests)
    usage = {"prompt_tokens": 0, "completion_tokens": 0}

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=max(1, concurrency))
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if model is None:
            model = await _fetch_model_name(session, base_url, headers)
        bar = tqdm(total=len(tests), desc="gsm8k", unit="q", disable=not progress, file=sys.stderr)

        async def one(i: int, doc: dict) -> None:
            payload = {
                "model": model,
                "prompt": prefix + doc_to_text(doc["question"]),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stop": list(STOP_SEQUENCES),
            }
            async with sem:
                body = await _complete(session, url, headers, payload, retries)
            error = body.get("error") if isinstance(body, dict) else None
            if error is not None and not isinstance(error, str):
                error = json.dumps(error)
            completion, finish = "", None
            if error is None:
                try:
                    choice = body["choices"][0]
                    completion = choice.get("text") or ""
                    finish = choice.get("finish_reason")
                except (KeyError, IndexError, TypeError):
                    error = f"malformed response: {json.dumps(body)[:300]}"
                u = body.get("usage") or {}
                usage["prompt_tokens"] += int(u.get("prompt_tokens") or 0)
                usage["completion_tokens"] += int(u.get("completion_tokens") or 0)
            completion = truncate_at_stop(completion)
            target = target_answer(doc["answer"])
            sc = score_completion(completion, target)
            row = {
                "idx": i,
                "question": doc["question"],
                "target": target,
                "completion": completion,
                "strict_pred": sc.strict_pred,
                "flexible_pred": sc.flexible_pred,
                "strict_correct": sc.strict_correct,
                "flexible_correct": sc.flexible_correct,
                "finish_reason": finish,
            }
            if error is not None:
                row["error"] = error
            rows[i] = row
            bar.update(1)

        try:
            await asyncio.gather(*(one(i, d) for i, d in enumerate(tests)))
        finally:
            bar.close()
    elapsed = time.perf_counter() - t0
    done = [r for r in rows if r is not None]
    summary = summarize(done, num_fewshot)
    summary.update(
        {
            "model": model,
            "base_url": base_url,
            "limit": limit,
            "concurrency": concurrency,
            "max_tokens": max_tokens,
            "elapsed_s": round(elapsed, 3),
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
        }
    )
    return Gsm8kResult(rows=done, summary=summary, errors=summary["errors"])


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def format_summary(summary: dict) -> str:
    """An lm-eval-style markdown table."""

    def fmt(x: float) -> str:
        return "nan" if x != x else f"{x:.4f}"

    n = summary["n"]
    k = summary["num_fewshot"]
    lines = [
        f"gsm8k: {n} questions, {k}-shot, model {summary.get('model')!s}, "
        f"{summary.get('elapsed_s', 0):.1f}s, {summary.get('errors', 0)} request error(s)",
        "|Tasks|Version|     Filter     |n-shot|  Metric   |   |Value |   |Stderr|",
        "|-----|------:|----------------|-----:|-----------|---|-----:|---|-----:|",
        f"|gsm8k|      3|flexible-extract|{k:6d}|exact_match|↑  |{fmt(summary['flexible_extract'])}|±  "
        f"|{fmt(summary['flexible_extract_stderr'])}|",
        f"|     |       |strict-match    |{k:6d}|exact_match|↑  |{fmt(summary['strict_match'])}|±  "
        f"|{fmt(summary['strict_match_stderr'])}|",
    ]
    return "\n".join(lines)

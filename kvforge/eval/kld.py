"""KL divergence of next-token distributions: model-dtype KV cache vs a quantized one.

The method is llama.cpp's ``perplexity --kl-divergence``, with both sides run
live instead of through a saved logits file:

* the text is tokenized once and cut into consecutive, non-overlapping windows
  of ``ctx`` tokens;
* every window is teacher-forced through a baseline engine (``kv_cache_dtype
  ="auto"``, i.e. the model dtype) and through one engine per quantized config,
  via ``engine.compute_prompt_logits(token_ids) -> [T, vocab] float32``;
* only the second half of each window is scored (logits at positions
  ``ctx//2 .. ctx-2`` predicting tokens ``ctx//2+1 .. ctx-1``), so every scored
  token sees at least ``ctx/2`` tokens of context, and most of the prefix
  lives in the (possibly fp8) paged cache;
* per scored token: ``KL(P_base || P_quant)``, whether the argmax agrees, the
  negative log-likelihood of the real next token under both, and the change in
  its probability (``Δp = p_quant - p_base``).

:func:`kld_stats` is the pure math (no engine); :func:`run_kld` drives engines.

The ``_stderr`` figures are over the scored tokens of one run. They do not cover the change from float
rounding order: the baseline's own logits move slightly with the CPU thread count or the kernel route, and
the quantized cache amplifies that (docs/BENCHMARKS.md, "KL divergence and the CPU thread count"). Compare
KV configurations within one invocation on one machine.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DEFAULT_CTX = (512,)
DEFAULT_MAX_TOKENS = 20_000
# The smallest window: its second half (positions ctx//2 .. ctx-2) must score at least one token.
MIN_CTX = 4
# KV bytes per engine. The baseline and every quantized engine live on one
# device at once, so none may size its cache from "free memory" (on CUDA the
# first would take it all). 512 MiB holds a 2048-token window of a 7B-class
# model in bf16; raise it with --kv-cache-memory for bigger models.
DEFAULT_KV_CACHE_MEMORY = 512 << 20
# Rows of [rows, vocab] float64 processed at once (bounds temporary memory).
_ROW_CHUNK = 256


def default_text_path() -> Path:
    """``text/tinyshakespeare.txt`` in the evaluation data folder (kvforge/data_paths.py);
    FileNotFoundError when there is none."""
    from kvforge.data_paths import shared_data_dir

    return shared_data_dir("--text FILE") / "text" / "tinyshakespeare.txt"


# ---------------------------------------------------------------------------
# pure math
# ---------------------------------------------------------------------------


def token_stats(base_logits, quant_logits, targets) -> dict[str, np.ndarray]:
    """Per-token statistics for ``N`` scored positions.

    ``base_logits`` and ``quant_logits`` are ``[N, vocab]`` (torch tensors or
    arrays, any float dtype; computed in float64), ``targets`` ``[N]`` are the
    real next tokens. Returns float64/bool numpy arrays of length ``N``:
    ``kld`` (KL(base || quant), nats), ``nll_base``, ``nll_quant``,
    ``p_base``, ``p_quant`` (probability of the target) and ``top1_same``.
    """
    import torch

    b = torch.as_tensor(base_logits)
    q = torch.as_tensor(quant_logits)
    t = torch.as_tensor(targets, dtype=torch.long).reshape(-1).to(b.device)
    q = q.to(b.device)
    if b.dim() != 2 or b.shape != q.shape:
        raise ValueError(f"logits must both be [N, vocab]; got {tuple(b.shape)} and {tuple(q.shape)}")
    if t.shape[0] != b.shape[0]:
        raise ValueError(f"{b.shape[0]} logit rows but {t.shape[0]} targets")
    out: dict[str, list] = {k: [] for k in ("kld", "nll_base", "nll_quant", "p_base", "p_quant", "top1_same")}
    for s in range(0, b.shape[0], _ROW_CHUNK):
        bb = b[s : s + _ROW_CHUNK].to(torch.float64)
        qq = q[s : s + _ROW_CHUNK].to(torch.float64)
        tt = t[s : s + _ROW_CHUNK].unsqueeze(1)
        lb = torch.log_softmax(bb, dim=-1)
        lq = torch.log_softmax(qq, dim=-1)
        pb = lb.exp()
        # p log(p/q) with the 0 * log 0 = 0 convention (masked-out vocab entries).
        terms = torch.where(pb > 0, pb * (lb - lq), torch.zeros_like(pb))
        out["kld"].append(terms.sum(-1))
        lbt = lb.gather(1, tt).squeeze(1)
        lqt = lq.gather(1, tt).squeeze(1)
        out["nll_base"].append(-lbt)
        out["nll_quant"].append(-lqt)
        out["p_base"].append(lbt.exp())
        out["p_quant"].append(lqt.exp())
        out["top1_same"].append(bb.argmax(-1) == qq.argmax(-1))
    if b.shape[0] == 0:
        return {k: np.zeros(0, dtype=bool if k == "top1_same" else np.float64) for k in out}
    return {k: torch.cat(v).cpu().numpy() for k, v in out.items()}


def _mean_stderr(x: np.ndarray) -> float:
    n = x.size
    return float(np.std(x, ddof=1) / math.sqrt(n)) if n > 1 else float("nan")


def summarize(tok: dict[str, np.ndarray]) -> dict:
    """Aggregate :func:`token_stats` arrays (possibly concatenated over windows)."""
    kld = np.asarray(tok["kld"], dtype=np.float64)
    n = int(kld.size)
    if n == 0:
        raise ValueError("no tokens scored")
    nb = np.asarray(tok["nll_base"], dtype=np.float64)
    nq = np.asarray(tok["nll_quant"], dtype=np.float64)
    dp = np.asarray(tok["p_quant"], dtype=np.float64) - np.asarray(tok["p_base"], dtype=np.float64)
    same = np.asarray(tok["top1_same"], dtype=np.float64)
    ppl_base = math.exp(nb.mean())
    ppl_quant = math.exp(nq.mean())
    dl = nq - nb  # per-token ln(PPL(Q)/PPL(base)) contributions
    if n > 1 and nb.std() > 0 and nq.std() > 0:
        cor = float(np.corrcoef(nb, nq)[0, 1])
    else:
        cor = 1.0

    def pct(a: np.ndarray, p: float) -> float:
        return float(np.percentile(a, p))

    return {
        "tokens_scored": n,
        "mean_kld": float(kld.mean()),
        "mean_kld_stderr": _mean_stderr(kld),
        "max_kld": float(kld.max()),
        "p999_kld": pct(kld, 99.9),
        "p99_kld": pct(kld, 99.0),
        "p90_kld": pct(kld, 90.0),
        "median_kld": pct(kld, 50.0),
        "p10_kld": pct(kld, 10.0),
        "p5_kld": pct(kld, 5.0),
        "p1_kld": pct(kld, 1.0),
        "min_kld": float(kld.min()),
        "top1_agreement": float(same.mean()),
        "top1_agreement_stderr": _mean_stderr(same),
        "ppl_base": ppl_base,
        "ppl_base_stderr": ppl_base * _mean_stderr(nb),
        "ppl_quant": ppl_quant,
        "ppl_quant_stderr": ppl_quant * _mean_stderr(nq),
        "ppl_ratio": ppl_quant / ppl_base,
        "ppl_rel_change": ppl_quant / ppl_base - 1.0,
        "mean_ln_ppl_ratio": float(dl.mean()),
        "mean_ln_ppl_ratio_stderr": _mean_stderr(dl),
        "cor_ln_ppl": cor,
        "mean_delta_p": float(dp.mean()),
        "mean_delta_p_stderr": _mean_stderr(dp),
        "max_delta_p": float(dp.max()),
        "p99_delta_p": pct(dp, 99.0),
        "median_delta_p": pct(dp, 50.0),
        "p1_delta_p": pct(dp, 1.0),
        "min_delta_p": float(dp.min()),
        "rms_delta_p": float(math.sqrt(np.mean(dp * dp))),
    }


def kld_stats(base_logits, quant_logits, targets) -> dict:
    """KL(base || quant), top-1 agreement and perplexities over ``N`` positions.

    ``base_logits``/``quant_logits``: ``[N, vocab]``; ``targets``: ``[N]`` token
    ids that actually follow each position. See :func:`summarize` for the keys
    (``mean_kld``, ``p99_kld``, ``top1_agreement``, ``ppl_base``, ``ppl_quant``,
    ``ppl_rel_change``, ``tokens_scored``, ...).
    """
    return summarize(token_stats(base_logits, quant_logits, targets))


def _concat(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


# ---------------------------------------------------------------------------
# windows
# ---------------------------------------------------------------------------


def check_ctx(ctx: int) -> None:
    """ValueError unless a window of ``ctx`` tokens scores at least one token."""
    if ctx < MIN_CTX:
        raise ValueError(f"--ctx {ctx} is too short: a window scores its second half, so it needs at least "
                         f"{MIN_CTX} tokens; use --ctx {MIN_CTX} or more (default {DEFAULT_CTX[0]})")


def plan_windows(num_tokens: int, ctx: int, max_scored: int) -> list[tuple[int, int]]:
    """Consecutive windows ``(start, length)`` over a token stream.

    A full window has ``ctx`` tokens and scores ``ctx - 1 - ctx//2`` of them;
    the last window is shortened so the total scored is ``min(max_scored,
    available)``. Raises ValueError if not even one window fits.
    """
    check_ctx(ctx)
    first = ctx // 2
    per = ctx - 1 - first
    windows: list[tuple[int, int]] = []
    scored = 0
    start = 0
    while start + ctx <= num_tokens and scored < max_scored:
        k = min(per, max_scored - scored)
        windows.append((start, first + k + 1))
        scored += k
        start += ctx
    if not windows:
        raise ValueError(f"the text has {num_tokens} tokens, fewer than one window of ctx={ctx}")
    return windows


# ---------------------------------------------------------------------------
# engines
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantConfig:
    """One quantized KV-cache configuration to compare against the baseline."""

    kv_cache_dtype: str
    overrides: tuple[tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.overrides)
        return f"{self.kv_cache_dtype}" + (f"[{extra}]" if extra else "")


@dataclass
class KldRun:
    ctx: int
    config: QuantConfig
    stats: dict
    windows: int
    elapsed_s: float


@dataclass
class KldReport:
    model: str
    text: str
    runs: list[KldRun] = field(default_factory=list)
    baseline_kv_dtype: str = "auto"
    plan_summaries: dict[str, str] = field(default_factory=dict)


def engine_arg_fields() -> set[str]:
    from kvforge.config import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def engine_args(model: str | None, kv_cache_dtype: str, overrides: dict | None = None):
    """The :class:`EngineArgs` of one engine (ValueError naming a field EngineArgs does not have)."""
    from kvforge.config import EngineArgs

    names = engine_arg_fields()
    kwargs = {"model": model, "kv_cache_dtype": kv_cache_dtype}
    for k, v in (overrides or {}).items():
        if k not in names:
            raise ValueError(f"EngineArgs has no field {k!r} (fields: {', '.join(sorted(names))})")
        kwargs[k] = v
    return EngineArgs(**kwargs)


def make_engine(model: str | None, kv_cache_dtype: str, overrides: dict | None = None):
    """Build an :class:`LLMEngine` for ``model`` (None = embedded SmolLM2)."""
    from kvforge.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(engine_args(model, kv_cache_dtype, overrides))


def check_engines(model: str | None, configs: list[QuantConfig], common: dict) -> None:
    """Check every engine's options before any engine loads weights: EngineArgs' own checks and the
    planner's input checks (KV dtype, scale scheme). Without this a bad quantized config would only fail
    once the baseline's weights were loaded."""
    from kvforge.planner.inputs import CacheConfig

    for dtype, overrides in [("auto", common)] + [(c.kv_cache_dtype, {**common, **dict(c.overrides)})
                                                 for c in configs]:
        args = engine_args(model, dtype, overrides)
        CacheConfig(kv_cache_dtype=args.kv_cache_dtype, kv_scale_scheme=args.kv_scale_scheme)


def _encode(tokenizer, text: str) -> list[int]:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return list(getattr(ids, "ids", ids))


def tokenize_enough(tokenizer, text: str, need: int) -> list[int]:
    """Tokenize a prefix of ``text`` long enough to give ``need`` tokens (or all of it)."""
    chars = max(4096, need * 8)
    while True:
        ids = _encode(tokenizer, text[:chars])
        if len(ids) >= need + 1 or chars >= len(text):
            return ids
        chars *= 2


def _logits(engine, ids: list[int]):
    import torch

    out = engine.compute_prompt_logits(ids)
    out = torch.as_tensor(out)
    if out.dim() != 2 or out.shape[0] != len(ids):
        raise RuntimeError(f"compute_prompt_logits returned shape {tuple(out.shape)} for {len(ids)} tokens")
    return out.float()


def _check_real_weights(model: str | None, common: dict) -> None:
    """ValueError where the engines would run random (dummy) weights: a preset, or ``load_format`` dummy.
    The divergence of two random models' KV dtypes says nothing about the model."""
    from kvforge.spec.presets import PRESETS

    preset = model is not None and not Path(model).exists() and model.strip().lower() in PRESETS
    if preset or common.get("load_format") == "dummy":
        what = f"{model!r} is a preset, which has no weights" if preset else "--load-format dummy gives"
        raise ValueError(f"kld measures what a KV dtype does to a model's predictions, but {what} "
                         f"{'(its engines would run random ones)' if preset else 'random weights'}; pass a "
                         f"checkpoint directory or a .gguf file")


def _check_text_length(model: str | None, common: dict, text: str, ctxs: tuple[int, ...], max_tokens: int) -> None:
    """ValueError, before any engine loads, where the text holds fewer tokens than one window of a ``ctx``
    (counted with the model's tokenizer, read without its weights; nothing is checked where there is none)."""
    from kvforge.errors import ConfigError
    from kvforge.spec.embedded import embedded_model_path
    from kvforge.tokenizer import load_tokenizer

    source = common.get("tokenizer") or model or embedded_model_path()
    try:
        tokenizer = load_tokenizer(source)
    except (ConfigError, OSError) as e:
        raise ValueError(f"kld scores a text, which needs the model's tokenizer: {e}; give one with "
                         f"--engine-arg tokenizer=DIR") from None
    if tokenizer is None:
        raise ValueError(f"kld scores a text, which needs the model's tokenizer, and {source} holds none; give one "
                         f"with --engine-arg tokenizer=DIR")
    for ctx in ctxs:
        need = math.ceil(max_tokens / (ctx - 1 - ctx // 2)) * ctx
        plan_windows(len(tokenize_enough(tokenizer, text, need)), ctx, max_tokens)


def run_kld(
    model: str | None = None,
    *,
    text_path: str | Path | None = None,
    ctxs: tuple[int, ...] = DEFAULT_CTX,
    configs: list[QuantConfig] | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    common_overrides: dict | None = None,
    progress: bool = True,
    log=None,
) -> KldReport:
    """Compare each quantized config against the baseline at each context size."""
    from tqdm import tqdm

    log = log or (lambda msg: print(msg, file=sys.stderr))
    configs = configs or [QuantConfig("fp8")]
    for ctx in ctxs:
        check_ctx(ctx)
    text_path = Path(text_path) if text_path is not None else default_text_path()
    if not text_path.is_file():
        raise FileNotFoundError(f"text file {text_path} not found (pass --text FILE)")
    text = text_path.read_text(encoding="utf-8", errors="replace")
    fields = engine_arg_fields()
    common = dict(common_overrides or {})
    if "max_model_len" in fields and "max_model_len" not in common:
        from kvforge.spec.load import load_model_spec

        limit = load_model_spec(model).max_position_embeddings  # config metadata only
        if limit is not None and max(ctxs) > limit:
            raise ValueError(f"--ctx {max(ctxs)} exceeds the model's {limit} positions (max_position_embeddings); "
                             f"use --ctx <= {limit}")
        common["max_model_len"] = max(ctxs)
    if "kv_cache_memory" in fields and common.get("kv_cache_memory") is None:
        common["kv_cache_memory"] = DEFAULT_KV_CACHE_MEMORY
    if "progress" in fields and "progress" not in common:
        common["progress"] = progress

    _check_real_weights(model, common)
    check_engines(model, configs, common)
    _check_text_length(model, common, text, ctxs, max_tokens)
    t0 = time.perf_counter()
    base = make_engine(model, "auto", common)
    quants = []
    for cfg in configs:
        quants.append(make_engine(model, cfg.kv_cache_dtype, {**common, **dict(cfg.overrides)}))
    log(f"kld: loaded baseline + {len(quants)} quantized engine(s) in {time.perf_counter() - t0:.1f}s")
    name = getattr(base, "model_name", None) or (model or "embedded")
    report = KldReport(model=str(name), text=str(text_path))
    for label, eng in [("auto", base)] + [(c.label, e) for c, e in zip(configs, quants)]:
        plan = getattr(eng, "plan", None)
        if plan is not None and hasattr(plan, "summary"):
            try:
                report.plan_summaries[label] = plan.summary()
            except Exception:  # a summary is informative only
                pass

    for ctx in ctxs:
        emax = getattr(base, "max_model_len", None)
        if emax is not None and ctx > emax:
            raise ValueError(f"--ctx {ctx} exceeds the engine's max_model_len {emax}")
        per = ctx - 1 - ctx // 2
        need_windows = math.ceil(max_tokens / per)
        ids = tokenize_enough(base.tokenizer, text, need_windows * ctx)
        windows = plan_windows(len(ids), ctx, max_tokens)
        parts: list[list[dict]] = [[] for _ in configs]
        times = [0.0 for _ in configs]
        bar = tqdm(windows, desc=f"kld ctx={ctx}", unit="win", disable=not progress, file=sys.stderr)
        for start, length in bar:
            win = ids[start : start + length]
            first = ctx // 2
            targets = win[first + 1 :]
            b = _logits(base, win)[first:-1]
            for j, eng in enumerate(quants):
                tq = time.perf_counter()
                q = _logits(eng, win)[first:-1]
                times[j] += time.perf_counter() - tq
                parts[j].append(token_stats(b, q, targets))
        bar.close()
        for j, cfg in enumerate(configs):
            stats = summarize(_concat(parts[j]))
            report.runs.append(KldRun(ctx=ctx, config=cfg, stats=stats, windows=len(windows), elapsed_s=times[j]))
    return report


# ---------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------


def run_to_json(run: KldRun) -> dict:
    d = {
        "ctx": run.ctx,
        "config": run.config.label,
        "kv_cache_dtype": run.config.kv_cache_dtype,
        "windows": run.windows,
    }
    d.update({k: v for k, v in run.config.overrides})
    d.update(run.stats)
    return d


def report_to_json(report: KldReport) -> dict:
    """One flat object for a single (ctx, config); else ``{"results": [...]}``."""
    head = {"model": report.model, "text": report.text, "baseline_kv_cache_dtype": report.baseline_kv_dtype}
    if len(report.runs) == 1:
        return {**head, **run_to_json(report.runs[0])}
    return {**head, "results": [run_to_json(r) for r in report.runs]}


def format_run(run: KldRun) -> str:
    s = run.stats

    def pm(v: float, e: float, fmt: str = "{:.6f}") -> str:
        return fmt.format(v) + " ± " + fmt.format(e)

    lines = [
        f"### ctx {run.ctx}, KV {run.config.label} vs auto: {s['tokens_scored']} tokens in {run.windows} windows",
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {pm(s['ppl_quant'], s['ppl_quant_stderr'])}",
        f"Mean PPL(base)                : {pm(s['ppl_base'], s['ppl_base_stderr'])}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['cor_ln_ppl']:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {pm(s['mean_ln_ppl_ratio'], s['mean_ln_ppl_ratio_stderr'])}",
        f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:.6f}",
        f"Mean PPL(Q)-PPL(base)         : {s['ppl_quant'] - s['ppl_base']:.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {pm(s['mean_kld'], s['mean_kld_stderr'])}",
        f"Maximum KLD: {s['max_kld']:10.6f}",
        f"99.9%   KLD: {s['p999_kld']:10.6f}",
        f"99.0%   KLD: {s['p99_kld']:10.6f}",
        f"90.0%   KLD: {s['p90_kld']:10.6f}",
        f"Median  KLD: {s['median_kld']:10.6f}",
        f"10.0%   KLD: {s['p10_kld']:10.6f}",
        f" 5.0%   KLD: {s['p5_kld']:10.6f}",
        f" 1.0%   KLD: {s['p1_kld']:10.6f}",
        f"Minimum KLD: {s['min_kld']:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * s['mean_delta_p']:.3f} ± {100 * s['mean_delta_p_stderr']:.3f} %",
        f"Maximum Δp: {100 * s['max_delta_p']:7.3f}%",
        f"99.0%   Δp: {100 * s['p99_delta_p']:7.3f}%",
        f"Median  Δp: {100 * s['median_delta_p']:7.3f}%",
        f" 1.0%   Δp: {100 * s['p1_delta_p']:7.3f}%",
        f"Minimum Δp: {100 * s['min_delta_p']:7.3f}%",
        f"RMS Δp    : {100 * s['rms_delta_p']:7.3f}%",
        f"Same top p: {100 * s['top1_agreement']:.3f} ± {100 * s['top1_agreement_stderr']:.3f} %",
    ]
    return "\n".join(lines)


def format_table(report: KldReport) -> str:
    w = max([len("kv cache")] + [len(r.config.label) for r in report.runs])
    head = (
        f"{'ctx':>5} {'kv cache':<{w}} {'tokens':>7} {'mean KLD':>10} {'p99 KLD':>10} {'max KLD':>9} "
        f"{'top-1 %':>8} {'PPL base':>9} {'PPL quant':>9} {'ΔPPL %':>8}"
    )
    rows = [head, "-" * len(head)]
    for r in report.runs:
        s = r.stats
        rows.append(
            f"{r.ctx:>5} {r.config.label:<{w}} {s['tokens_scored']:>7} {s['mean_kld']:>10.6f} "
            f"{s['p99_kld']:>10.6f} {s['max_kld']:>9.4f} {100 * s['top1_agreement']:>8.3f} "
            f"{s['ppl_base']:>9.4f} {s['ppl_quant']:>9.4f} {100 * s['ppl_rel_change']:>+8.3f}"
        )
    return "\n".join(rows)


def format_report(report: KldReport) -> str:
    parts = [f"kld: model {report.model}, text {report.text}, baseline KV cache: auto (model dtype)"]
    for r in report.runs:
        parts.append("")
        parts.append(format_run(r))
    parts.append("")
    parts.append(format_table(report))
    return "\n".join(parts)

"""The load generator (kvforge bench serve) against a live server.

The live server wraps the real engine (embedded SmolLM2, CPU); the failure-counting test uses
``FakeEngine`` explicitly (it needs only an authenticating server).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, smollm2_test_engine  # noqa: E402

from kvforge.bench import serve_bench as sb  # noqa: E402
from kvforge.server.app import ServerThread, create_app  # noqa: E402
from kvforge.server.metrics import metric_sum, parse_prometheus  # noqa: E402


@pytest.fixture(scope="module")
def server():
    engine = smollm2_test_engine(max_model_len=512, max_num_seqs=16)
    srv = ServerThread(create_app(engine)).start()
    srv.engine = engine
    yield srv
    srv.stop()


def _metrics(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics") as r:
        return parse_prometheus(r.read().decode())


# -- pure helpers -------------------------------------------------------------------------------


def test_percentile():
    assert sb.percentile([], 50) is None
    assert sb.percentile([5.0], 99) == 5.0
    xs = list(range(1, 101))
    assert sb.percentile(xs, 50) == pytest.approx(50.5)
    assert sb.percentile(xs, 0) == 1 and sb.percentile(xs, 100) == 100
    assert sb.percentile(xs, 99) == pytest.approx(99.01)


def test_prompts_are_unique_and_seeded():
    a = sb.PromptFactory(64, seed=7)
    b = sb.PromptFactory(64, seed=7)
    pa = [a.make("r0") for _ in range(50)]
    assert pa == [b.make("r0") for _ in range(50)]
    assert len(set(pa)) == 50
    # each prompt starts with its own id, so no two share even a first block
    assert len({p.split("]")[0] for p in pa}) == 50


def test_calibration_fits_isl():
    f = sb.PromptFactory(100, seed=0)
    # a tokenizer that costs 10 tokens of prefix plus 2 tokens per word
    samples = [(w, 10 + 2 * w) for w in (f.words, f.words // 2)]
    f.calibrate(samples)
    assert f.words == 45


def _rep(i, duration):
    d = {"mean": 1.0, "p50": 1.0, "p90": 2.0, "p99": 3.0, "n": 1}
    return {"repetition": i, "duration_s": duration, "request_throughput": 1 / duration,
            "output_throughput_tok_s": 100 / duration, "total_throughput_tok_s": 200 / duration,
            "ttft_ms": d, "tpot_ms": d, "itl_ms": d}


def test_cold_first_repetition_is_flagged():
    s = sb.summarize_repetitions([_rep(0, 4.0), _rep(1, 2.0), _rep(2, 2.2), _rep(3, 1.9)])
    assert s["cold_start"]["first_repetition_is_outlier"] is True
    assert s["duration_s"] == {"median": 2.1, "min": 1.9, "max": 4.0}
    s = sb.summarize_repetitions([_rep(0, 2.1), _rep(1, 2.0), _rep(2, 2.2)])
    assert s["cold_start"]["first_repetition_is_outlier"] is False
    assert s["output_throughput_tok_s"]["min"] == pytest.approx(100 / 2.2)


# -- against a live server ------------------------------------------------------------------------


def test_bench_counts_agree_with_server_metrics(server, tmp_path):
    before = _metrics(server.url)
    out, plot = tmp_path / "results.json", tmp_path / "results.png"
    rc = sb.bench_serve_main([
        "--base-url", server.url, "--isl", "40", "--osl", "6", "--concurrency", "3", "--num-requests", "6",
        "--repetitions", "2", "--warmup", "1", "--out", str(out), "--plot", str(plot),
    ])
    assert rc == 0
    after = _metrics(server.url)
    report = json.loads(out.read_text())
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    reps = report["repetitions"]
    assert len(reps) == 2 and all(r["requests_succeeded"] == 6 and r["requests_failed"] == 0 for r in reps)
    assert all(r["output_tokens"] == 6 * 6 for r in reps)  # ignore_eos: exactly OSL each
    for r in reps:
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert r[key]["p50"] is not None and r[key]["p50"] <= r[key]["p90"] <= r[key]["p99"]
        assert r["output_throughput_tok_s"] > 0 and r["total_throughput_tok_s"] > r["output_throughput_tok_s"]
    # prompts land near ISL after warm-up calibration
    assert 40 * 0.7 <= reps[0]["mean_prompt_tokens"] <= 40 * 1.3, reps[0]["mean_prompt_tokens"]
    assert set(report["summary"]["ttft_ms_p50"]) == {"median", "min", "max"}

    totals = report["totals"]
    assert totals["requests_sent"] == totals["requests_succeeded"] == 3 + 12
    name = server.engine.model_name

    def delta(metric):
        return metric_sum(after, metric) - metric_sum(before, metric)

    ok_key = 'kvforge:request_success_total{finished_reason="length",model_name="%s"}'
    assert after[ok_key % name] - before.get(ok_key % name, 0) == totals["requests_succeeded"]
    assert delta("kvforge:request_success_total") == totals["requests_succeeded"]
    assert delta("kvforge:request_prompt_tokens_sum") == totals["prompt_tokens"]
    assert delta("kvforge:request_generation_tokens_sum") == totals["output_tokens"]
    # the engine's own counter agrees on generated tokens
    assert delta("kvforge:generation_tokens_total") == totals["output_tokens"]
    assert delta("kvforge:time_to_first_token_seconds_count") == totals["requests_succeeded"]
    # the report's server deltas span the timed runs only: the warm-up is read before them
    timed = sum(r["output_tokens"] for r in reps)
    assert timed < totals["output_tokens"]
    assert report["server_metrics_delta"]["kvforge:request_generation_tokens_sum"] == timed


def test_bench_counts_failures():
    engine = FakeEngine(step_delay=0.001)
    with ServerThread(create_app(engine, api_key="secret")) as srv:
        report = asyncio.run(sb.run_benchmark(srv.url, isl=16, osl=4, concurrency=2, num_requests=4,
                                              repetitions=1, warmup=0, model="fake-model", log=lambda *_: None))
        rep = report["repetitions"][0]
        assert rep["requests_failed"] == 4 and rep["requests_succeeded"] == 0
        assert "401" in rep["errors"][0]
        report = asyncio.run(sb.run_benchmark(srv.url + "/v1", isl=16, osl=4, concurrency=2, num_requests=4,
                                              repetitions=1, warmup=0, api_key="secret",
                                              log=lambda *_: None))
        assert report["repetitions"][0]["requests_succeeded"] == 4


def test_a_warm_up_that_fails_entirely_stops_with_its_first_error(capsys):
    """Every warm-up request refused (no API key): the timed runs would fail alike, so the bench stops there,
    naming the server's answer and the fix, instead of printing tables of zeros."""
    engine = FakeEngine(step_delay=0.001)
    with ServerThread(create_app(engine, api_key="secret")) as srv:
        rc = sb.bench_serve_main(["--base-url", srv.url, "--model", "fake-model", "--isl", "16", "--osl", "2",
                                  "--num-requests", "2", "--concurrency", "2"])
    captured = capsys.readouterr()
    assert rc == 2 and "every request of warm-up pass 1 failed" in captured.err and "HTTP 401" in captured.err
    assert "--api-key" in captured.err and "repetition" not in captured.out


@pytest.mark.parametrize("key", [None, "wrong"], ids=["no-key", "wrong-key"])
def test_a_refused_model_listing_says_the_fix_once(capsys, monkeypatch, key):
    """No key: send one; a wrong one: send the server's. Said once, though the listing's error names it."""
    monkeypatch.delenv("KVFORGE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    engine = FakeEngine(step_delay=0.001)
    with ServerThread(create_app(engine, api_key="secret")) as srv:
        rc = sb.bench_serve_main(["--base-url", srv.url, "--isl", "16", "--osl", "2", "--num-requests", "2"]
                                 + (["--api-key", key] if key else []))
    err = capsys.readouterr().err
    assert rc == 2 and "HTTP 401" in err
    hint = "refused the API key sent" if key else "the server wants an API key"
    assert err.count(hint) == 1 and err.count("--api-key") == 1, err


def test_a_failed_timed_request_is_printed_with_the_run():
    engine = FakeEngine(step_delay=0.001)
    lines = []
    with ServerThread(create_app(engine, api_key="secret")) as srv:
        report = asyncio.run(sb.run_benchmark(srv.url, isl=16, osl=2, concurrency=2, num_requests=2, repetitions=1,
                                              warmup=0, model="fake-model", log=lines.append))
    assert any(line.strip().startswith("2 failed; the first: HTTP 401") for line in lines), lines
    table = sb.format_report(report).splitlines()
    assert any(line.split()[:2] == ["requests_failed", "2.00"] for line in table), table
    assert any(line.split()[:2] == ["requests_succeeded", "0.00"] for line in table), table


def test_the_summary_counts_requests_and_the_prompt_length_got():
    """Beside the latencies, each repetition's successes, failures and mean prompt length (what --isl gave)."""
    reps = [dict(_rep(i, 2.0), requests_succeeded=6 - i, requests_failed=i, mean_prompt_tokens=40.0 + i)
            for i in range(3)]
    s = sb.summarize_repetitions(reps)
    assert s["requests_failed"] == {"median": 1, "min": 0, "max": 2}
    assert s["requests_succeeded"] == {"median": 5, "min": 4, "max": 6}
    assert s["mean_prompt_tokens"] == {"median": 41.0, "min": 40.0, "max": 42.0}


def test_plot_without_matplotlib_stops_before_any_request(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    rc = sb.bench_serve_main(["--base-url", "http://127.0.0.1:9", "--plot", "out.png"])
    err = capsys.readouterr().err
    assert rc == 2 and "--plot needs matplotlib" in err and "Cannot connect" not in err


@pytest.mark.parametrize("argv, says", [
    (["--warmup-requests", "-3"], "argument --warmup-requests: '-3' must be >= 1"),
    (["--timeout", "-1"], "argument --timeout: '-1' must be > 0"),
    (["--concurrency", "0"], "argument --concurrency/--max-concurrency: '0' must be >= 1"),
    (["--out", "/nonexistent/x.json"], "argument --out/--result-filename: the folder '/nonexistent' does not exist"),
    (["--plot", "/nonexistent/x.png"], "argument --plot: the folder '/nonexistent' does not exist"),
], ids=["warmup-requests", "timeout", "concurrency", "out", "plot"])
def test_bad_values_are_refused_before_any_request(capsys, argv, says):
    """Refused by the parser (exit 2) before the bench connects: the port named here has no server, so any
    request would fail otherwise, and a bad output path would only fail after the whole run."""
    from kvforge.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *argv])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_vllm_bench_serve_flags_name_the_server_and_the_report(tmp_path, capsys, monkeypatch):
    """``vllm bench serve``'s spellings: --host / --port build the URL, --save-result with --result-dir and
    --result-filename places the report, --backend / --endpoint / --request-rate are taken at what the bench
    does and refused otherwise."""
    from kvforge.cli import build_parser

    def parsed(*argv):
        args = build_parser("bench").parse_args(["bench", "serve", *argv])
        return args, sb.resolve_destinations(args)

    args, problem = parsed("--backend", "vllm", "--endpoint", "/v1/completions", "--request-rate", "inf",
                           "--port", "8011", "--save-result", "--result-dir", str(tmp_path), "--result-filename",
                           "o.json")
    assert problem is None and args.base_url == "http://127.0.0.1:8011" and args.out == str(tmp_path / "o.json")
    args, _ = parsed("--host", "10.0.0.2")
    assert args.base_url == "http://10.0.0.2:8000" and args.out is None
    args, _ = parsed()
    assert args.base_url == sb.DEFAULT_BASE_URL
    monkeypatch.chdir(tmp_path)
    args, _ = parsed("--save-result")  # a timestamped file in the working folder
    assert args.out.startswith("./kvforge-bench-serve-") and args.out.endswith(".json")
    assert parsed("--base-url", "http://a:1", "--port", "2")[1] == ("give the server as --base-url or as --host "
                                                                     "and --port, not both")
    assert "does not exist" in parsed("--save-result", "--result-dir", str(tmp_path / "none"))[1]
    for argv, says in ((["--backend", "sglang"], "--backend accepts only vllm or openai"),
                       (["--endpoint", "/v1/chat/completions"], "requests go to /v1/completions"),
                       (["--request-rate", "10"], "as fast as --max-concurrency allows")):
        with pytest.raises(SystemExit) as exc:
            parsed(*argv)
        assert exc.value.code == 2 and says in capsys.readouterr().err


def test_no_server_at_the_url_names_the_fix(capsys):
    rc = sb.bench_serve_main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--num-requests", "1"])
    assert rc == 2 and "start one with `kvforge serve`" in capsys.readouterr().err


def test_a_base_url_that_is_no_http_url_is_a_usage_error(capsys):
    from kvforge.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--base-url", "127.0.0.1:8000"])
    assert exc.value.code == 2
    assert "kvforge bench serve: error: argument --base-url: '127.0.0.1:8000' is not an http(s) URL" in \
        capsys.readouterr().err


def test_word_list_is_deterministic():
    rng = random.Random(3)
    p = sb.build_prompt("x", 10, rng)
    assert p.startswith("[x] ") and len(p.split()) == 11


def test_prefill_floor_counts_the_experts_a_token_runs():
    """The prefill floor's parameters per token: a tiny DeepSeek-V2 (tests/test_deepseek_mla.py's BASE: 2 MoE
    layers of 8 routed experts, top-2, hidden 64, expert width 32) multiplies every parameter but its
    256 x 64 input embedding, and of each MoE layer's routed experts (8 x (2*32*64 + 64*32) = 49,152
    parameters) only 2/8."""
    import test_deepseek_mla as t
    import torch

    from kvforge.bench.roofline import dense_decode_flops_per_token as _dense_decode_flops_per_token
    from kvforge.bench.roofline import matmul_params_per_token as _matmul_params_per_token
    from kvforge.models.deepseek import DeepseekV2ForCausalLM

    model = DeepseekV2ForCausalLM({**t.BASE, **t.CASES["v2_group_limited"][2], "architectures": ["DeepseekV2ForCausalLM"]})
    total = sum(p.numel() for p in model.parameters())
    assert _matmul_params_per_token(model) == total - 256 * 64 - 2 * 49152 * (1 - 2 / 8)
    # MoE: no dense compute-aware decode floor (it would count every expert)
    assert _dense_decode_flops_per_token(model) is None
    # a tensor-parallel rank holding 4 of the 8 experts (24,576 routed parameters per layer) runs 2/8 of them
    for moe in [m for m in model.modules() if hasattr(m, "experts_gate_up")]:
        moe.experts_gate_up = torch.nn.Parameter(moe.experts_gate_up[:4].detach().clone())
        moe.experts_down = torch.nn.Parameter(moe.experts_down[:4].detach().clone())
    half = sum(p.numel() for p in model.parameters())
    assert half == total - 2 * 24576
    assert _matmul_params_per_token(model) == half - 256 * 64 - 2 * 24576 * (1 - 2 / 8)


def test_offline_roofline_hand_computed():
    """Two requests (inputs 10 and 20 tokens, outputs 3 and 2), 1000 weight bytes, 10 KV bytes per token,
    1000 B/s, 100 parameters, 1000 FLOP/s, 800 FLOPs per decode token. Decode step 1 runs both requests
    (contexts 11 + 21): weights 1.0 s, KV 0.32 s, FLOPs 1600 -> 1.6 s, so 1.32 s bytes-only and 1.6 + 0.32
    compute-aware. Step 2 runs the first (context 12): 1.0 + 0.12 either way (FLOPs 0.8 s < 1.0 s).
    Prefill 2 x 100 x 30 / 1000 = 6 s."""
    from kvforge.bench.roofline import roofline as _roofline

    r = _roofline([10, 20], [3, 2], 1000, 10, 1000.0, 100, 1000.0, 800.0)
    assert r["decode_floor_s"] == pytest.approx(2.44)
    assert r["decode_floor_compute_aware_s"] == pytest.approx(1.92 + 1.12)
    assert r["prefill_floor_s"] == pytest.approx(6.0)
    assert r["floor_s"] == pytest.approx(8.44) and r["floor_compute_aware_s"] == pytest.approx(9.04)
    assert "floor_compute_aware_s" not in _roofline([10, 20], [3, 2], 1000, 10, 1000.0, 100, 1000.0)


def test_decode_weight_bytes_follow_the_experts_a_batch_touches():
    """1000 dense bytes + 800 routed bytes, top-2 of 8 experts: an expert idles with probability 0.75 per
    token, so batch 1 reads 1000 + 800 x 0.25 = 1200, batch 2 reads 1000 + 800 x (1 - 0.5625) = 1350, and
    batch 64 reads all but 800 x 0.75^64 (~1e-5). A dense model reads the same at every batch."""
    from kvforge.bench.roofline import StepWeightBytes

    w = StepWeightBytes(dense=1000, routed=800, top_k=2, n_experts=8)
    assert w.total == 1800
    assert w.at_batch(1) == pytest.approx(1200.0)
    assert w.at_batch(2) == pytest.approx(1350.0)
    assert w.at_batch(64) == pytest.approx(1800.0, abs=1e-3)
    assert StepWeightBytes(dense=1000).at_batch(7) == 1000.0
    with pytest.raises(ValueError, match="top_k 9 of 8"):
        StepWeightBytes(dense=1, routed=8, top_k=9, n_experts=8)


def test_moe_roofline_charges_the_experts_of_each_step():
    """The roofline test's workload (outputs 3 and 2, so decode step 1 runs both requests and step 2 one)
    with the weights above at 1000 B/s and no KV bytes: step 1 reads 1350 B (1.35 s), step 2 1200 B (1.2 s).
    Charging every expert every step would give 3.6 s."""
    from kvforge.bench.roofline import StepWeightBytes, roofline

    w = StepWeightBytes(dense=1000, routed=800, top_k=2, n_experts=8)
    r = roofline([10, 20], [3, 2], w, 0, 1000.0, 100, 1000.0)
    assert r["decode_floor_s"] == pytest.approx(2.55)
    assert roofline([10, 20], [3, 2], w.total, 0, 1000.0, 100, 1000.0)["decode_floor_s"] == pytest.approx(3.6)


def test_step_weight_bytes_of_a_tiny_deepseek():
    """tests/test_deepseek_mla.py's BASE DeepSeek-V2 (float32): 2 MoE layers of 8 routed experts x 6,144
    parameters (gate_up 64 x 64, down 64 x 32) = 98,304 routed parameters = 393,216 bytes; the dense part is
    every other parameter but the 256 x 64 input embedding; top-2 of 8."""
    import test_deepseek_mla as t

    from kvforge.bench.roofline import step_weight_bytes
    from kvforge.models.deepseek import DeepseekV2ForCausalLM

    model = DeepseekV2ForCausalLM({**t.BASE, **t.CASES["v2_group_limited"][2], "architectures": ["DeepseekV2ForCausalLM"]})
    w = step_weight_bytes(model)
    total = sum(p.numel() for p in model.parameters()) * 4
    assert w.routed == 2 * 8 * (64 * 64 + 64 * 32) * 4 == 393216
    assert (w.top_k, w.n_experts) == (2, 8)
    assert w.dense == total - 256 * 64 * 4 - w.routed


def _tiny(case: str):
    """Our model (float32, untrained) of a tiny config of tests/tiny_checkpoints.py."""
    from tiny_checkpoints import GPT_OSS, KIMI_LINEAR, QWEN3_NEXT

    from kvforge.models.gpt_oss import GptOssForCausalLM
    from kvforge.models.kimi_linear import KimiLinearForCausalLM
    from kvforge.models.qwen3_next import Qwen3NextForCausalLM

    cls, cfg = {"gpt-oss": (GptOssForCausalLM, GPT_OSS), "qwen3-next": (Qwen3NextForCausalLM, QWEN3_NEXT),
                "kimi-linear": (KimiLinearForCausalLM, KIMI_LINEAR)}[case]
    return cls(dict(cfg))


#: Routed-expert parameters, by hand from the configs (hidden 64 everywhere):
#: gpt-oss: 4 MoE layers x 6 experts x (gate_up 64 x 96 + its bias 96 + down 48 x 64 + its bias 64 = 9,376);
#: Qwen3-Next: 3 MoE layers (layer 1 is mlp_only) x 6 experts x (gate_up 64 x 64 + down 64 x 32 = 6,144);
#: Kimi-Linear: 2 sparse layers x 8 experts x 6,144. Each: (routed parameters, top_k, experts, vocab).
ROUTED_BY_HAND = {"gpt-oss": (4 * 6 * 9376, 2, 6, 256), "qwen3-next": (3 * 6 * 6144, 2, 6, 128),
                  "kimi-linear": (2 * 8 * 6144, 2, 8, 128)}


@pytest.mark.parametrize("case", sorted(ROUTED_BY_HAND))
def test_roofline_charges_the_experts_a_step_touches_for_every_moe_layout(case):
    """gpt-oss (experts with biases under ``mlp.experts``), Qwen3-Next (a plain linear router) and Kimi-Linear
    (DeepSeek's MoE): the routed experts are recognised, so a decode step of one request reads the dense
    bytes plus top_k / experts of the routed bytes, and a token multiplies that share of them; the input
    embedding (vocab x 64) is gathered, not read."""
    from kvforge.bench.roofline import (
        dense_decode_flops_per_token,
        matmul_params_per_token,
        roofline,
        step_weight_bytes,
    )

    model = _tiny(case)
    routed, top_k, experts, vocab = ROUTED_BY_HAND[case]
    total = sum(p.numel() for p in model.parameters())
    embed = vocab * 64
    w = step_weight_bytes(model)
    assert (w.routed, w.top_k, w.n_experts) == (4 * routed, top_k, experts)
    assert w.dense == 4 * (total - embed - routed)
    assert matmul_params_per_token(model) == pytest.approx(total - embed - routed * (1 - top_k / experts))
    assert dense_decode_flops_per_token(model) is None
    # one request, two output tokens: one decode step at batch 1, 1 byte/s, no KV bytes
    floor = roofline([10], [2], w, 0, 1.0, 1.0, 1.0)["decode_floor_s"]
    assert floor == pytest.approx(4 * (total - embed - routed) + 4 * routed * top_k / experts)


def test_roofline_of_a_gpt_oss_rank_holding_half_the_experts():
    """Under tensor parallelism a rank holds 3 of the 6 experts (and the router of all 6): its routed bytes
    halve and a token still runs 2/6 of them."""
    from kvforge.bench.roofline import matmul_params_per_token, step_weight_bytes
    from kvforge.models.gpt_oss import GptOssExperts

    model = _tiny("gpt-oss")
    for layer in model.model.layers:
        layer.mlp.experts = GptOssExperts(model.args, num_local=3, first=3)
    total = sum(p.numel() for p in model.parameters())
    routed = 4 * 3 * 9376
    w = step_weight_bytes(model)
    assert (w.routed, w.top_k, w.n_experts) == (4 * routed, 2, 6)
    assert matmul_params_per_token(model) == pytest.approx(total - 256 * 64 - routed * (1 - 2 / 6))


def test_roofline_without_decode_steps_and_tied_embeddings():
    """Every output is the prefill's one token: no decode step, so the decode-only rate is None (it divided
    by zero). And a tied embedding counts once: the LM head reads it, so it stays in the weights a step
    reads, where a separate input table (gathered, not read) does not."""
    import torch

    from kvforge.bench.roofline import dense_decode_flops_per_token, roofline, step_weight_bytes

    r = roofline([10, 20], [1, 1], 1000, 10, 1000.0, 100, 1000.0)
    assert r["decode_floor_s"] == 0 and r["decode_only_output_tokens_per_s_at_floor"] is None

    class Toy(torch.nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.embed_tokens = torch.nn.Embedding(10, 4)  # 40 parameters
            self.body = torch.nn.Linear(4, 4, bias=False)  # 16
            self.lm_head = None if tied else torch.nn.Linear(4, 10, bias=False)  # 40

    assert step_weight_bytes(Toy(tied=True)).total == (40 + 16) * 4
    assert step_weight_bytes(Toy(tied=False)).total == (16 + 40) * 4
    assert dense_decode_flops_per_token(Toy(tied=True)) == 2.0 * 56
    assert dense_decode_flops_per_token(Toy(tied=False)) == 2.0 * 56


def test_kv_floor_reads_only_the_window_of_sliding_layers():
    """Per sequence and step: 10 bytes per token of full layers, 4 of a window-8 layer and 6 of a window-3
    layer, 100 state bytes (read and written: 200). At context 2: 20 + 8 + 12 + 200 = 240; at context 20:
    200 + 32 + 18 + 200 = 450. The roofline workload (inputs 10 and 20, outputs 3 and 2) at 1 B/s with no
    weights: step 1 runs contexts 11 and 21 (110 + 32 + 18 + 200 = 360, 210 + 32 + 18 + 200 = 460), step 2
    context 12 (120 + 32 + 18 + 200 = 370): 1190 s."""
    from kvforge.bench.roofline import StepKVBytes, roofline

    kv = StepKVBytes(per_token=10, windowed=((3, 6), (8, 4)), state=100)
    assert kv.at_context(2) == 240 and kv.at_context(20) == 450
    assert roofline([10, 20], [3, 2], 0, kv, 1.0, 100, 1000.0)["decode_floor_s"] == pytest.approx(1190.0)
    # An int is bytes per token of every layer: the same floor as StepKVBytes(per_token=...).
    assert (roofline([10, 20], [3, 2], 0, 10, 1.0, 100, 1000.0)["decode_floor_s"]
            == roofline([10, 20], [3, 2], 0, StepKVBytes(10), 1.0, 100, 1000.0)["decode_floor_s"])


def test_kv_step_bytes_from_plans():
    """From real plans: a model without sliding layers charges the plan's bytes per token for every
    context token; gpt-oss-20b (12 sliding layers of window 128 and 12 full layers, 8 KV heads x 64 x
    K and V = 1024 fp8 bytes per token and layer) charges its sliding layers at most 128 tokens, so
    beyond the window a step grows only by the full layers' bytes (the plan's bytes per token)."""
    from kvforge.bench.roofline import StepKVBytes
    from kvforge.planner.api import plan as plan_for

    llama = plan_for("llama-3.1-8b", kv_cache_dtype="fp8")
    kv = StepKVBytes.from_plan(llama)
    assert kv == StepKVBytes(per_token=llama.bytes_per_token)
    oss = plan_for("gpt-oss-20b", kv_cache_dtype="fp8")
    kv = StepKVBytes.from_plan(oss)
    assert kv == StepKVBytes(per_token=12 * 1024, windowed=((128, 12 * 1024),)) == StepKVBytes(
        per_token=oss.bytes_per_token, windowed=((128, oss.bytes_per_token),))
    assert kv.at_context(10_000) - kv.at_context(9_999) == oss.bytes_per_token
    assert kv.at_context(100) == 2 * 12 * 1024 * 100


def test_causal_pairs_hand_counted():
    from kvforge.bench.roofline import causal_pairs

    assert causal_pairs(10) == 55  # 1 + 2 + ... + 10
    assert causal_pairs(10, 4) == 1 + 2 + 3 + 4 + 6 * 4  # from token 4 on each query sees 4 keys
    assert causal_pairs(3, 4) == 6  # the window is longer than the prompt
    assert causal_pairs(10, 10) == causal_pairs(10)


@pytest.mark.parametrize("model, tp, expected", [
    # 32 layers x 2 x 32 heads x (128 + 128): the score and the weighted value of every head
    ("llama-3.1-8b", 1, ((0, 32 * 2 * 32 * 256),)),
    ("llama-3.1-8b", 2, ((0, 32 * 2 * 16 * 256),)),  # one rank's 16 heads
    # 27 MLA layers x 2 x 16 heads x (128 nope + 64 rope + 128 v), the expanded heads
    ("deepseek-v2-lite", 1, ((0, 27 * 2 * 16 * 320),)),
    # 12 full and 12 sliding (window 128) layers x 2 x 64 heads x (64 + 64)
    ("gpt-oss-20b", 1, ((0, 12 * 2 * 64 * 128), (128, 12 * 2 * 64 * 128))),
])
def test_prefill_attention_flops_from_plans(model, tp, expected):
    import kvforge
    from kvforge.bench.roofline import PrefillAttentionFlops
    from kvforge.spec.load import load_model_spec

    plan = kvforge.plan(model, device="cuda", gpu_memory=141 * 10**9, tensor_parallel_size=tp)
    assert PrefillAttentionFlops.from_plan(load_model_spec(model), plan).per_pair == expected


def test_prefill_floor_adds_attention_flops():
    """Prompts 10 and 20 over one full layer group of 100 FLOPs a pair and one window-4 group of 10:
    attention 100 x (55 + 210) + 10 x (34 + 74) = 27,580 FLOPs beside 2 x 100 params x 30 tokens."""
    from kvforge.bench.roofline import PrefillAttentionFlops, roofline

    attention = PrefillAttentionFlops(((0, 100), (4, 10)))
    assert attention.of_prompt(20) == 100 * 210 + 10 * (10 + 16 * 4)
    r = roofline([10, 20], [1, 1], 1000, 10, 1000.0, 100, 1000.0, prefill_attention=attention)
    assert r["prefill_attention_floor_s"] == pytest.approx(27.58)
    assert r["prefill_floor_s"] == pytest.approx((6000 + 27580) / 1000.0)
    assert r["prefill_tokens_per_s_at_floor"] == pytest.approx(30 / r["prefill_floor_s"])
    assert roofline([10, 20], [1, 1], 1000, 10, 1000.0, 100, 1000.0)["prefill_floor_s"] == pytest.approx(6.0)


def test_a_sampled_load_sends_its_temperature():
    """``--temperature`` reaches every request (warm-up and timed) and the report's config; 0 stays the default."""
    engine = FakeEngine(step_delay=0.001)
    seen = []
    add = engine.add_request

    def recording_add(request_id, prompt, params):
        seen.append(params.temperature)
        return add(request_id, prompt, params)

    engine.add_request = recording_add
    with ServerThread(create_app(engine)) as srv:
        report = asyncio.run(sb.run_benchmark(srv.url, isl=16, osl=4, concurrency=2, num_requests=4, repetitions=1,
                                              warmup=1, model="fake-model", temperature=0.7, log=lambda *_: None))
    assert report["config"]["temperature"] == 0.7 and report["repetitions"][0]["requests_succeeded"] == 4
    assert len(seen) == 2 + 4 and set(seen) == {0.7}


def test_vllm_bench_serve_spellings_name_the_same_settings():
    parser = sb.add_bench_serve_args(sb.ArgumentParser(prog="kvforge bench serve"))
    vllm = parser.parse_args(["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "32",
                              "--max-concurrency", "4", "--num-prompts", "20", "--result-filename", "r.json"])
    ours = parser.parse_args(["--isl", "256", "--osl", "32", "--concurrency", "4", "--num-requests", "20",
                              "--out", "r.json"])
    assert vars(vllm) == vars(ours)

"""Speculative decoding counters: engine.stats(), /metrics (vLLM's names, kvforge: prefix) and
``kvforge bench offline``'s JSON."""

from __future__ import annotations

import json

import pytest

from kvforge import LLM, SamplingParams
from kvforge.cli import main
from kvforge.server.metrics import ServerMetrics, metric_sum, parse_prometheus

TINY = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, vocab_size=256, max_position_embeddings=1024,
            rms_norm_eps=1e-5, torch_dtype="float32")


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return str(tmp_path)


def test_metrics_absent_without_speculation():
    text = ServerMetrics("m").render({"num_running": 0, "spec_decode": None, "state_snapshots": None},
                                     in_flight=0).decode()
    assert "spec_decode" not in text and "state_snapshots" not in text


def test_engine_counters_reach_metrics(tiny):
    llm = LLM(tiny, load_format="dummy", skip_tokenizer_init=True, device="cpu", progress=False,
              kv_cache_memory=1 << 22, num_speculative_tokens=3)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 5}, {"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()["spec_decode"]
    assert stats["num_draft_tokens"] == sum(o.speculative.num_draft_tokens for o in outs) > 0
    assert stats["num_accepted_tokens"] == sum(o.speculative.num_accepted_tokens for o in outs)
    assert stats["num_drafts"] == sum(o.speculative.num_drafts for o in outs)
    for o in outs:
        s = o.speculative
        assert s.acceptance_rate == pytest.approx(s.num_accepted_tokens / s.num_draft_tokens)
        assert s.mean_accepted_length == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)
    parsed = parse_prometheus(ServerMetrics("tiny").render(llm.engine.stats(), in_flight=0).decode())
    assert parsed['kvforge:spec_decode_num_drafts_total{model_name="tiny"}'] == stats["num_drafts"]
    assert parsed['kvforge:spec_decode_num_draft_tokens_total{model_name="tiny"}'] == stats["num_draft_tokens"]
    assert parsed['kvforge:spec_decode_num_accepted_tokens_total{model_name="tiny"}'] == stats["num_accepted_tokens"]
    for pos in range(3):
        key = f'kvforge:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{pos}"}}'
        assert parsed[key] == stats["accepted_per_pos"][pos]
    assert metric_sum(parsed, "kvforge:spec_decode_num_accepted_tokens_per_pos_total") == stats["num_accepted_tokens"]


def test_bench_offline_reports_acceptance(tiny, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "offline", tiny, "--load-format", "dummy", "--device", "cpu", "--skip-tokenizer-init",
                 "--kv-cache-memory", "4MiB", "--num-prompts", "3", "--input-len", "8", "16", "--output-len", "16",
                 "16", "--repetitions", "2", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 5}', "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["speculative_config"]["num_speculative_tokens"] == 2
    runs = [r["spec_decode"] for r in result["runs"]]
    total = result["spec_decode"]
    assert total["num_draft_tokens"] == sum(r["num_draft_tokens"] for r in runs) > 0
    assert total["num_accepted_tokens"] == sum(r["num_accepted_tokens"] for r in runs)
    assert 0.0 <= total["acceptance_rate"] <= 1.0 and total["mean_accepted_length"] >= 1.0
    assert "acceptance" in capsys.readouterr().out


def test_bench_serve_reads_acceptance_from_the_server_counters():
    from kvforge.bench.serve_bench import _metrics_delta

    def scrape(drafts, proposed, accepted):
        m = 'model_name="m"'
        return {f"kvforge:spec_decode_num_drafts_total{{{m}}}": drafts,
                f"kvforge:spec_decode_num_draft_tokens_total{{{m}}}": proposed,
                f"kvforge:spec_decode_num_accepted_tokens_total{{{m}}}": accepted,
                f"kvforge:generation_tokens_total{{{m}}}": 0.0}

    delta = _metrics_delta(scrape(10, 30, 12), scrape(30, 90, 52))
    assert delta["kvforge:spec_decode_num_draft_tokens_total"] == 60
    assert delta["spec_decode_acceptance_rate"] == pytest.approx(40 / 60)
    assert delta["spec_decode_mean_accepted_length"] == pytest.approx(1 + 40 / 20)
    plain = {'kvforge:generation_tokens_total{model_name="m"}': 1.0}
    assert "spec_decode_acceptance_rate" not in _metrics_delta(plain, plain)

"""kvforge.eval.kld: the KL/perplexity math on hand-built distributions, the window
planner, the driver on a stand-in engine whose noise the tests control, and the real engine
(SmolLM2 on CPU) on tests/data/english_prose.txt."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kvforge.eval import kld
from kvforge.eval.cli import add_kld_args, kld_configs, kld_main
from kvforge.eval.kld import QuantConfig, kld_stats, plan_windows, token_stats

LN2 = math.log(2.0)
PROSE = Path(__file__).parent / "data" / "english_prose.txt"  # written for these tests


def logits_of(*rows):
    """Logits whose softmax is exactly the given probability rows."""
    return torch.log(torch.tensor(rows, dtype=torch.float64))


# ---------------------------------------------------------------------------
# pure math
# ---------------------------------------------------------------------------


def test_identical_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 300, generator=g)
    t = torch.randint(0, 300, (50,), generator=g)
    s = kld_stats(x, x.clone(), t)
    assert s["tokens_scored"] == 50
    assert s["mean_kld"] == 0.0 and s["max_kld"] == 0.0 and s["p99_kld"] == 0.0
    assert s["top1_agreement"] == 1.0
    assert s["ppl_base"] == s["ppl_quant"]
    assert s["ppl_ratio"] == 1.0 and s["ppl_rel_change"] == 0.0
    assert s["rms_delta_p"] == 0.0


def test_known_kl_values():
    # Row 0: P=(1/2,1/4,1/4), Q=(1/4,1/2,1/4): KL = 1/2 ln2 - 1/4 ln2 = ln2/4; argmax 0 vs 1.
    # Row 1: P=(1/2,1/2,0+) , Q=(1/2,1/2,0+): identical, KL 0; argmax agrees (first max).
    # Row 2: P=(0.9,0.1,0) vs Q=(0.6,0.2,0.2): KL = .9 ln(1.5) + .1 ln(.5); P has an exact zero.
    base = logits_of([0.5, 0.25, 0.25], [0.5, 0.5, 0.0], [0.9, 0.1, 0.0])
    quant = logits_of([0.25, 0.5, 0.25], [0.5, 0.5, 0.0], [0.6, 0.2, 0.2])
    # Row 2 of quant must give the zero-probability entry some mass for KL to be finite; it does (0.2).
    targets = torch.tensor([0, 1, 1])
    tok = token_stats(base, quant, targets)
    kl = [LN2 / 4, 0.0, 0.9 * math.log(1.5) + 0.1 * math.log(0.5)]
    np.testing.assert_allclose(tok["kld"], kl, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(tok["top1_same"], [False, True, True])
    np.testing.assert_allclose(tok["nll_base"], [LN2, LN2, -math.log(0.1)], atol=1e-12)
    np.testing.assert_allclose(tok["nll_quant"], [2 * LN2, LN2, -math.log(0.2)], atol=1e-12)

    s = kld_stats(base, quant, targets)
    assert s["mean_kld"] == pytest.approx(sum(kl) / 3, abs=1e-12)
    assert s["max_kld"] == pytest.approx(max(kl), abs=1e-12)
    assert s["min_kld"] == pytest.approx(0.0, abs=1e-12)
    assert s["top1_agreement"] == pytest.approx(2 / 3)
    ppl_b = math.exp((LN2 + LN2 - math.log(0.1)) / 3)
    ppl_q = math.exp((2 * LN2 + LN2 - math.log(0.2)) / 3)
    assert s["ppl_base"] == pytest.approx(ppl_b, rel=1e-12)
    assert s["ppl_quant"] == pytest.approx(ppl_q, rel=1e-12)
    assert s["ppl_rel_change"] == pytest.approx(ppl_q / ppl_b - 1, rel=1e-12)
    # Δp = p_quant(target) - p_base(target): (.25-.5, .5-.5, .2-.1)
    assert s["mean_delta_p"] == pytest.approx((-0.25 + 0.0 + 0.1) / 3, abs=1e-12)
    assert s["rms_delta_p"] == pytest.approx(math.sqrt((0.0625 + 0.01) / 3), abs=1e-12)


def test_kl_is_asymmetric_and_direction_is_base_to_quant():
    p = logits_of([0.9, 0.1])
    q = logits_of([0.5, 0.5])
    t = torch.tensor([0])
    kl_pq = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    kl_qp = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kld_stats(p, q, t)["mean_kld"] == pytest.approx(kl_pq, abs=1e-12)
    assert kld_stats(q, p, t)["mean_kld"] == pytest.approx(kl_qp, abs=1e-12)


def test_logit_shift_invariance_and_float32_inputs():
    g = torch.Generator().manual_seed(1)
    b = torch.randn(8, 64, generator=g)
    q = b + 0.1 * torch.randn(8, 64, generator=g)
    t = torch.randint(0, 64, (8,), generator=g)
    s1 = kld_stats(b, q, t)
    s2 = kld_stats(b + 7.0, q - 3.0, t)
    assert s1["mean_kld"] > 0
    assert s2["mean_kld"] == pytest.approx(s1["mean_kld"], rel=1e-5)
    assert s2["ppl_base"] == pytest.approx(s1["ppl_base"], rel=1e-5)
    # Against a direct float64 formula.
    lp = torch.log_softmax(b.double(), -1)
    lq = torch.log_softmax(q.double(), -1)
    direct = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    assert s1["mean_kld"] == pytest.approx(direct, rel=1e-10)


def test_masked_vocab_entries():
    # -inf logits in the baseline (p = 0) contribute nothing, not NaN.
    b = torch.tensor([[0.0, 0.0, -math.inf]])
    q = torch.tensor([[0.0, 0.0, 0.0]])
    s = kld_stats(b, q, torch.tensor([0]))
    # P=(1/2,1/2,0), Q=(1/3,1/3,1/3): KL = ln(3/2)
    assert s["mean_kld"] == pytest.approx(math.log(1.5), abs=1e-12)


def test_percentiles_on_a_known_spread():
    # 100 rows; row i has P=(1,0-ish) sharp and Q chosen so KL_i is known: use two-point dists.
    ps = np.full(100, 0.5)
    qs = np.linspace(0.5, 0.99, 100)
    b = torch.tensor(np.log(np.stack([ps, 1 - ps], 1)))
    q = torch.tensor(np.log(np.stack([qs, 1 - qs], 1)))
    kl = 0.5 * np.log(0.5 / qs) + 0.5 * np.log(0.5 / (1 - qs))
    s = kld_stats(b, q, torch.zeros(100, dtype=torch.long))
    assert s["p99_kld"] == pytest.approx(np.percentile(kl, 99), rel=1e-10)
    assert s["median_kld"] == pytest.approx(np.median(kl), rel=1e-10)
    assert s["max_kld"] == pytest.approx(kl.max(), rel=1e-10)
    assert s["p99_kld"] < s["max_kld"]


def test_chunked_rows_match_unchunked(monkeypatch):
    g = torch.Generator().manual_seed(2)
    b = torch.randn(70, 16, generator=g)
    q = torch.randn(70, 16, generator=g)
    t = torch.randint(0, 16, (70,), generator=g)
    ref = kld_stats(b, q, t)
    monkeypatch.setattr(kld, "_ROW_CHUNK", 7)
    assert kld_stats(b, q, t)["mean_kld"] == pytest.approx(ref["mean_kld"], rel=1e-12)


def test_shape_errors():
    with pytest.raises(ValueError):
        kld_stats(torch.zeros(3, 4), torch.zeros(3, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError):
        kld_stats(torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long))


# ---------------------------------------------------------------------------
# windows
# ---------------------------------------------------------------------------


def test_plan_windows():
    # ctx 8: score positions 4..6 -> 3 tokens per full window.
    assert plan_windows(40, 8, 100) == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8)]
    assert plan_windows(40, 8, 7) == [(0, 8), (8, 8), (16, 4 + 1 + 1)]
    assert plan_windows(15, 8, 100) == [(0, 8)]  # a partial window is never used
    with pytest.raises(ValueError):
        plan_windows(7, 8, 100)


# ---------------------------------------------------------------------------
# the driver on a fake engine
# ---------------------------------------------------------------------------


class FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 97 for c in text]


class FakeEngine:
    """Baseline: all mass on the true next token (so PPL ~ 1 if targets align).
    Quantized: the same logits plus noise whose size depends on a 'multiplier'."""

    model_name = "fake"
    max_model_len = 4096

    def __init__(self, kv_cache_dtype, noise=0.0):
        self.tokenizer = FakeTokenizer()
        self.kv_cache_dtype = kv_cache_dtype
        self.noise = noise
        self.calls = []

    def compute_prompt_logits(self, ids):
        self.calls.append(len(ids))
        n = len(ids)
        out = torch.zeros(n, 97)
        nxt = ids[1:] + [0]
        out[torch.arange(n), torch.tensor(nxt)] = 12.0
        if self.noise:
            g = torch.Generator().manual_seed(len(ids))
            out += self.noise * torch.randn(n, 97, generator=g)
        return out


def _fake_make_engine(model, kv_cache_dtype, overrides=None):
    if kv_cache_dtype == "auto":
        return FakeEngine("auto")
    mult = (overrides or {}).get("kv_scale_multiplier", 1.0)
    return FakeEngine(kv_cache_dtype, noise=0.05 * mult if kv_cache_dtype != "fp8_e5m2" else 0.1 * mult)


@pytest.fixture
def fake_engines(monkeypatch):
    monkeypatch.setattr(kld, "make_engine", _fake_make_engine)


def _parse(argv):
    p = argparse.ArgumentParser()
    add_kld_args(p)
    return p.parse_args(argv)


def test_cli_configs():
    a = _parse(["--kv-cache-dtype", "fp8_e4m3,fp8_e5m2", "--kv-scale-scheme", "per_tensor,per_head"])
    labels = [c.label for c in kld_configs(a)]
    assert labels == [
        "fp8_e4m3[kv_scale_scheme=per_tensor]",
        "fp8_e4m3[kv_scale_scheme=per_head]",
        "fp8_e5m2[kv_scale_scheme=per_tensor]",
        "fp8_e5m2[kv_scale_scheme=per_head]",
    ]
    # scales do not apply to an unquantized cache: bf16 runs once, unlabelled, beside the scaled fp8 runs
    a = _parse(["--kv-cache-dtype", "bf16,fp8", "--kv-scale-scheme", "per_tensor,per_head", "--calculate-kv-scales"])
    assert [c.label for c in kld_configs(a)] == [
        "bf16", "fp8[kv_scale_scheme=per_tensor,calculate_kv_scales=True]",
        "fp8[kv_scale_scheme=per_head,calculate_kv_scales=True]"]
    a = _parse(["--kv-cache-dtype", "fp8", "--kv-cache-dtype", "fp8_e5m2", "--kv-scale-multiplier", "100"])
    assert [c.overrides for c in kld_configs(a)] == [(("kv_scale_multiplier", 100.0),)] * 2
    a = _parse(["--ctx", "512,2048", "--engine-arg", "device=cpu", "--engine-arg", "block-size=32"])
    assert a.ctx == (512, 2048) and a.model is None
    assert dict(a.engine_arg) == {"device": "cpu", "block_size": 32}
    assert [c.label for c in kld_configs(a)] == ["fp8"]


def test_driver_single_config_json_is_flat(fake_engines, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    rc = kld_main(_parse(["--text", str(text), "--ctx", "64", "--max-tokens", "100", "--json", "--no-progress"]))
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    for k in ("mean_kld", "p99_kld", "top1_agreement", "ppl_base", "ppl_quant", "tokens_scored"):
        assert k in d
    assert d["tokens_scored"] == 100
    assert d["ctx"] == 64 and d["config"] == "fp8"
    # Targets line up with the logits: the baseline puts ~all mass on the true next token.
    assert d["ppl_base"] == pytest.approx(1.0, abs=1e-3)
    assert 0 < d["mean_kld"] < 0.01
    assert d["top1_agreement"] == 1.0


def test_driver_several_configs_and_contexts(fake_engines, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("lorem ipsum dolor sit amet " * 300)
    rc = kld_main(_parse(["--text", str(text), "--ctx", "32,64", "--kv-cache-dtype", "fp8_e4m3,fp8_e5m2",
                          "--max-tokens", "60", "--no-progress"]))
    assert rc == 0
    out = capsys.readouterr().out
    assert "====== KL divergence statistics ======" in out and "Same top p" in out
    assert out.count("fp8_e5m2") >= 3
    rep = kld.run_kld(None, text_path=text, ctxs=(32, 64),
                      configs=[QuantConfig("fp8_e4m3"), QuantConfig("fp8_e5m2")], max_tokens=60, progress=False)
    j = kld.report_to_json(rep)
    assert [(r["ctx"], r["config"]) for r in j["results"]] == [
        (32, "fp8_e4m3"), (32, "fp8_e5m2"), (64, "fp8_e4m3"), (64, "fp8_e5m2")]
    by = {(r["ctx"], r["config"]): r for r in j["results"]}
    assert all(r["tokens_scored"] == 60 for r in j["results"])
    assert by[(64, "fp8_e5m2")]["mean_kld"] > by[(64, "fp8_e4m3")]["mean_kld"]


def test_driver_broken_scale_is_large(fake_engines, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("abcdefghij klmnopqrst " * 300)
    ok, broken = QuantConfig("fp8"), QuantConfig("fp8", (("kv_scale_multiplier", 100.0),))
    rep = kld.run_kld(None, text_path=text, ctxs=(32,), configs=[ok, broken], max_tokens=60, progress=False)
    s_ok, s_bad = rep.runs[0].stats, rep.runs[1].stats
    assert s_bad["mean_kld"] > 100 * s_ok["mean_kld"]
    assert s_bad["top1_agreement"] < s_ok["top1_agreement"]


def test_missing_text(fake_engines, tmp_path, capsys):
    assert kld_main(_parse(["--text", str(tmp_path / "none.txt"), "--no-progress"])) == 2
    assert "not found" in capsys.readouterr().err


@pytest.fixture
def no_engine(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("an engine was built although the command cannot run")

    monkeypatch.setattr(kld, "make_engine", boom)


@pytest.mark.parametrize("argv, needle", [
    (["--ctx", "2"], "--ctx 2 is too short"),
    (["--ctx", "512,3"], "--ctx 3 is too short"),
    (["--kv-cache-dtype", "fp8,int4"], "unknown KV cache dtype 'int4'"),
    (["--kv-scale-scheme", "per_tensor,per_channel"], "--kv-scale-scheme must be one of per_tensor, per_head"),
    (["--kv-scale-multiplier", "0"], "--kv-scale-multiplier must be > 0"),
    (["--engine-arg", "block_sise=16"], "EngineArgs has no field 'block_sise'"),
    (["--ctx", "100000"], "--ctx 100000 exceeds the model's 8192 positions (max_position_embeddings); use --ctx <= 8192"),
    (["--ctx", "64,512"], "fewer than one window of ctx=512"),  # the prose is a few hundred tokens
    (["csa-ring-test", "--ctx", "64"], "'csa-ring-test' is a preset, which has no weights"),
    (["--engine-arg", "load_format=dummy"], "--load-format dummy gives random weights"),
])
def test_options_that_cannot_work_stop_before_any_engine(no_engine, capsys, argv, needle):
    """The baseline engine loads its weights first; a bad quantized config or window size is refused
    before that, with the message naming it."""
    assert kld_main(_parse(["--text", str(PROSE), "--no-progress", *argv])) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_a_checkpoint_without_a_tokenizer_stops_before_any_engine(no_engine, capsys, tmp_path):
    import json

    config = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=256, max_position_embeddings=256)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert kld_main(_parse([str(tmp_path), "--text", str(PROSE), "--ctx", "64", "--no-progress"])) == 2
    err = capsys.readouterr().err
    assert "needs the model's tokenizer" in err and "--engine-arg tokenizer=DIR" in err and "Traceback" not in err


def test_kv_cache_memory_takes_byte_sizes_like_the_engine_flags():
    assert _parse(["--kv-cache-memory", "16MiB"]).kv_cache_memory == 16 << 20
    assert _parse(["--kv-cache-memory", "8GB"]).kv_cache_memory == 8 * 10**9


# ---------------------------------------------------------------------------
# the real engine (SmolLM2-135M on CPU)
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_real_engine_fp8_close_and_broken_scale_detected():
    """SmolLM2-135M (embedded GGUF) on CPU, float32 baseline vs fp8 e4m3 KV, over
    two 64-token windows of English prose (62 scored tokens): fp8 is close but
    not identical; the same cache with every KV scale x100 (values under
    ~0.2 flush to zero) is caught as a much larger divergence."""
    ok = QuantConfig("fp8")
    broken = QuantConfig("fp8", (("kv_scale_multiplier", 100.0),))
    rep = kld.run_kld(None, text_path=PROSE, ctxs=(64,), configs=[ok, broken], max_tokens=62, progress=False,
                      common_overrides={"device": "cpu", "kv_cache_memory": 16 << 20})
    s_ok, s_bad = rep.runs[0].stats, rep.runs[1].stats
    assert s_ok["tokens_scored"] == s_bad["tokens_scored"] == 62
    # Measured: mean KLD 0.0055, top-1 agreement 97%, dPPL +3.9%, PPL 24.
    assert 0.0 < s_ok["mean_kld"] < 0.02, s_ok
    assert s_ok["top1_agreement"] >= 0.85, s_ok
    assert abs(s_ok["ppl_rel_change"]) < 0.08, s_ok
    assert 10.0 < s_ok["ppl_base"] < 200.0, s_ok  # a real language model on English text
    # Measured: mean KLD 0.045 (8x), p99 0.23, dPPL +11%.
    assert s_bad["mean_kld"] > 4 * s_ok["mean_kld"], (s_ok, s_bad)
    assert s_bad["mean_kld"] > 0.02 and s_bad["p99_kld"] > 0.1, s_bad
    j = kld.report_to_json(rep)
    assert [r["config"] for r in j["results"]] == ["fp8", "fp8[kv_scale_multiplier=100.0]"]

"""``--max-num-batched-tokens`` must hold ``--max-num-seqs`` tokens (a step gives every running sequence at
least one): both given and the budget smaller is refused before weights load; a budget given alone caps
the default ``--max-num-seqs``; ``--max-num-seqs`` given alone raises the default budget."""

from __future__ import annotations

import logging

import pytest
from fake_engine import serve_refused

from kvforge.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs
from kvforge.errors import ConfigError, PlanError


def test_both_given_and_the_budget_below_the_sequences_is_refused():
    with pytest.raises(ConfigError) as err:
        EngineArgs(max_num_batched_tokens=128, max_num_seqs=256)
    message = str(err.value)
    assert "--max-num-batched-tokens 128 is below --max-num-seqs 256" in message
    assert "raise --max-num-batched-tokens to at least 256" in message
    assert "lower --max-num-seqs to at most 128" in message


def test_a_budget_alone_caps_the_default_sequences_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="kvforge.config"):
        args = EngineArgs(max_num_batched_tokens=128)
    assert args.max_num_seqs == 128 and args.step_token_budget("cpu") == 128
    assert "--max-num-batched-tokens 128 is below the default --max-num-seqs 256" in caplog.text
    assert EngineArgs(max_num_batched_tokens=512).max_num_seqs == 256  # a larger budget leaves the default


@pytest.mark.parametrize("seqs, budget", [(8, 8), (8, 64), (None, None)])
def test_budgets_that_hold_the_sequences_are_kept(seqs, budget):
    args = EngineArgs(max_num_seqs=seqs, max_num_batched_tokens=budget)
    assert args.max_num_seqs == (seqs or 256)
    assert args.step_token_budget("cpu") == (budget or DEFAULT_MAX_NUM_BATCHED_TOKENS["cpu"])


def test_sequences_alone_raise_the_default_budget():
    args = EngineArgs(max_num_seqs=4096)
    assert args.step_token_budget("cpu") == 4096 and args.step_token_budget("cuda") == 8192
    assert EngineArgs().step_token_budget("cpu") == 2048 and EngineArgs().step_token_budget("cuda") == 8192


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "8 seqs", "0"])
def test_max_num_seqs_must_be_a_positive_integer(bad):
    with pytest.raises(ConfigError, match="--max-num-seqs must be an integer >= 1"):
        EngineArgs(max_num_seqs=bad)


def test_the_planner_takes_max_num_seqs_as_text_like_the_other_counts():
    import kvforge

    text = kvforge.plan("llama-3.1-8b", max_num_seqs="8", max_num_batched_tokens="4k", kv_cache_memory="8GiB",
                        max_model_len="4K")
    assert text == kvforge.plan("llama-3.1-8b", max_num_seqs=8, max_num_batched_tokens=4000, kv_cache_memory=8 << 30,
                                max_model_len=4096)


def test_serve_refuses_the_pair_before_weights(monkeypatch, capsys):
    err = serve_refused(monkeypatch, capsys, ["--max-num-batched-tokens", "128", "--max-num-seqs", "256"])
    assert "--max-num-batched-tokens 128 is below --max-num-seqs 256" in err


def test_the_engine_runs_at_most_the_budget_of_sequences():
    from kvforge.engine.llm_engine import LLMEngine
    from kvforge.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(device="cpu", max_model_len=64, max_num_batched_tokens=8,
                                                   progress=False))
    try:
        assert engine.scheduler.max_num_seqs == 8 and engine.scheduler.max_num_batched_tokens == 8
        for i in range(12):
            engine.add_request(str(i), [1, 2, 3, 4 + i], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        most, done = 0, 0
        while engine.has_unfinished_requests():
            done += sum(out.finished for out in engine.step())
            most = max(most, engine.scheduler.num_running)
        assert done == 12 and most <= 8
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kw, says", [(dict(gpu_memory_utilization=0.5), "--gpu-memory-utilization 0.5"),
                                      (dict(gpu_memory="4GB"), "--gpu-memory")])
def test_gpu_memory_flags_on_cpu_say_they_do_nothing(caplog, kw, says):
    """On CPU the KV cache is --kv-cache-memory (default 1 GiB): a utilization or a GPU memory given there is
    reported as having no effect (before any weight loads: here the plan then refuses a 131,072-token
    context in 1 GiB), not silently dropped; an invalid value gets its error alone."""
    from kvforge.engine.llm_engine import LLMEngine

    with caplog.at_level(logging.WARNING, logger="kvforge.engine"), pytest.raises(PlanError):
        LLMEngine.from_engine_args(EngineArgs(model="llama-3.1-8b", load_format="dummy", device="cpu", **kw))
    assert f"{says} has no effect on CPU" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvforge.engine"), pytest.raises(ConfigError, match="must be in"):
        LLMEngine.from_engine_args(EngineArgs(model="llama-3.1-8b", load_format="dummy", device="cpu",
                                              **{**kw, "gpu_memory_utilization": 1.5}))
    assert "no effect on CPU" not in caplog.text


def test_gpu_memory_on_cpu_is_no_device_to_check_against(caplog):
    """Beside --kv-cache-memory too, a GPU memory given on CPU changes nothing: no fit warning against it."""
    from kvforge import LLM

    with caplog.at_level(logging.WARNING):
        llm = LLM(device="cpu", gpu_memory="1GB", kv_cache_memory="64MiB", max_model_len=256)
    assert "--gpu-memory has no effect on CPU: the KV cache gets --kv-cache-memory (67,108,864 bytes)" in caplog.text
    assert llm.plan.capacity.kv_cache_memory == 64 << 20
    assert not any("exceed the device" in w for w in llm.plan.warnings)


def test_the_planner_takes_the_engines_rule(capsys):
    """``kvforge plan`` and ``kvforge.plan`` refuse the pair the engine refuses, and plan for the sequences
    the engine runs when only the budget is given (the activation reserve's split-attention partials grow
    with the sequences)."""
    import kvforge
    from kvforge.cli import main

    assert main(["plan", "--max-num-batched-tokens", "128", "--max-num-seqs", "256"]) == 2
    err = capsys.readouterr().err
    assert "--max-num-batched-tokens 128 is below --max-num-seqs 256" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="--max-num-batched-tokens 128 is below --max-num-seqs 256"):
        kvforge.plan(max_num_batched_tokens=128, max_num_seqs=256)
    budget_alone = kvforge.plan("llama-3.1-8b", device="cuda", gpu_memory=141 * 10**9, max_num_batched_tokens=128)
    engine_seqs = EngineArgs(max_num_batched_tokens=128).max_num_seqs
    assert budget_alone == kvforge.plan("llama-3.1-8b", device="cuda", gpu_memory=141 * 10**9,
                                        max_num_batched_tokens=128, max_num_seqs=engine_seqs)

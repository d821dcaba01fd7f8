"""``kvforge generate`` prompts: text, or token ids for models without a tokenizer; prompts that
cannot be encoded, and ``kvforge bench offline`` lengths that cannot fit, are refused before any
weight loads."""

from __future__ import annotations

import json

import pytest

import kvforge.llm
from kvforge.cli import main

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}


@pytest.fixture
def no_engine(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the engine was built although the prompts cannot work")

    monkeypatch.setattr(kvforge.llm, "LLM", boom)


@pytest.mark.parametrize("argv, needle", [
    (["generate", "gemma-3-1b", "--prompt", "hi"], "--prompt-token-ids"),
    (["generate", "llama-3.1-8b"], "--prompt-token-ids"),  # the default prompt is text too
    (["generate", "--skip-tokenizer-init", "--prompt", "hi"], "--skip-tokenizer-init"),
    (["generate", "--prompt", "hi", "--prompt-token-ids", "1,2"], "not both"),
    (["generate", "--chat", "--prompt-token-ids", "1,2"], "--chat"),
    (["generate", "--prompt-token-ids", "1,49152"], "--prompt-token-ids: prompt token ids must be integers in [0, 49152)"),
    (["generate", "--prompt", "hi", "--prompt", ""], "--prompt is empty"),
    (["generate", "--max-model-len", "64", "--prompt", "hi", "--prompt", " ".join(["word"] * 100)],
     "a prompt has 100 tokens but max-model-len is 64"),  # the embedded tokenizer: one token a word
    (["generate", "--max-model-len", "8", "--prompt-token-ids", "1,2,3,4,5,6,7,8"],
     "a prompt has 8 tokens but max-model-len is 8"),
    # 8 MiB of float32 KV at 46,080 bytes a token (30 layers x K and V x 3 KV heads x 64 x 4 bytes): 182 tokens,
    # 11 whole blocks of 16 = 176
    (["generate", "--max-model-len", "auto", "--kv-cache-memory", "8MiB", "--device", "cpu", "--prompt",
      " ".join(["word"] * 200)], "a prompt has 200 tokens but max-model-len is 176 (--max-model-len auto"),
])
def test_prompts_that_cannot_work_stop_before_the_engine(no_engine, capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("value", ["1,x", "1,,2", "-1,2", ""])
def test_malformed_token_ids_are_argparse_errors(no_engine, capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt-token-ids", value])
    assert exc.value.code == 2
    assert "--prompt-token-ids" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--presence-penalty", "3"), ("--repetition-penalty", "0")])
def test_bad_penalties_stop_before_the_engine(no_engine, capsys, flag, value):
    assert main(["generate", "--prompt", "hi", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag[2:].replace("-", "_") in err and "Traceback" not in err


def test_penalty_flags_reach_the_sampling_params(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    seen = []
    real = kvforge.llm.LLM.generate
    monkeypatch.setattr(kvforge.llm.LLM, "generate", lambda self, prompts, params, **kw: seen.append(params)
                        or real(self, prompts, params, **kw))
    code = main(["generate", str(tmp_path), "--load-format", "dummy", "--device", "cpu", "--max-model-len", "64",
                 "--prompt-token-ids", "1,2,3", "--max-tokens", "4", "--ignore-eos", "--no-progress",
                 "--presence-penalty", "0.5", "--frequency-penalty", "-1", "--repetition-penalty", "1.2"])
    assert code == 0
    p = seen[0]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.2)


def test_token_id_prompts_on_a_model_without_a_tokenizer(tmp_path, capsys, caplog):
    """Token-id prompts run; the plan is shown once (the engine's log), not again on stdout."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    with caplog.at_level("INFO"):
        code = main(["generate", str(tmp_path), "--load-format", "dummy", "--device", "cpu", "--max-model-len", "64",
                     "--prompt-token-ids", "1,2,3", "--prompt-token-ids", "7,8", "--max-tokens", "3",
                     "--ignore-eos", "--no-progress"])
    assert code == 0
    captured = capsys.readouterr()
    out = captured.out
    assert ">>> token ids [1, 2, 3]" in out and ">>> token ids [7, 8]" in out
    assert out.count("[3 tokens, finish: length]") == 2
    assert (out + captured.err + caplog.text).count("KV plan for ") == 1


@pytest.mark.parametrize("argv, needle", [
    (["--max-model-len", "256"], "over --max-model-len 256"),  # the default ranges reach 1024 + 1024
    (["--input-len", "10", "5"], "--input-len 10 5"),
    (["--output-len", "0", "5"], "--output-len 0 5"),
    # no --max-model-len: the embedded model's context length, read from its config before the engine
    (["--input-len", "8000", "8000", "--output-len", "500", "500"], "over --max-model-len 8192"),
])
def test_bench_offline_lengths_that_cannot_run_stop_before_the_engine(no_engine, capsys, argv, needle):
    assert main(["bench", "offline", "--load-format", "dummy", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("spelling", ["positional", "--model"])
def test_bench_offline_checks_lengths_against_the_named_models_context(no_engine, capsys, tmp_path, spelling):
    """The context is the named model's (256 tokens here), however the command line names it."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    named = [str(tmp_path)] if spelling == "positional" else ["--model", str(tmp_path)]
    assert main(["bench", "offline", *named, "--load-format", "dummy", "--input-len", "200", "200",
                 "--output-len", "100", "100"]) == 2
    assert "over --max-model-len 256" in capsys.readouterr().err


def test_bench_offline_checks_its_output_path_before_the_engine(no_engine, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "offline", "--load-format", "dummy", "--out", "/nonexistent/r.json"])
    assert exc.value.code == 2
    assert "argument --out: the folder '/nonexistent' does not exist" in capsys.readouterr().err


def test_an_unknown_compare_kv_dtype_stops_before_the_engine(no_engine, capsys):
    assert main(["generate", "--compare-kv-dtype", "int4", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "--compare-kv-dtype" in err and "'int4'" in err and "fp8_e5m2" in err and "Traceback" not in err


def test_compare_kv_dtype_refuses_a_sampling_temperature_before_the_engine(no_engine, capsys):
    assert main(["generate", "--compare-kv-dtype", "fp8", "--temperature", "0.9", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "--compare-kv-dtype compares greedy outputs" in err and "drop --temperature" in err


def test_compare_kv_dtype_frees_the_first_engine_before_building_the_second(tmp_path, monkeypatch, capsys):
    """On a GPU the first engine's KV pool holds the memory the second engine plans for, so it is shut down
    first."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    built = []

    class RecordingLLM(kvforge.llm.LLM):
        def __init__(self, *a, **k):
            built.append((self, [llm.engine.is_shut_down for llm, _ in built]))
            super().__init__(*a, **k)

    monkeypatch.setattr(kvforge.llm, "LLM", RecordingLLM)
    code = main(["generate", str(tmp_path), "--load-format", "dummy", "--device", "cpu", "--max-model-len", "64",
                 "--prompt-token-ids", "1,2,3", "--max-tokens", "3", "--ignore-eos", "--no-progress",
                 "--compare-kv-dtype", "bf16"])
    assert code == 0
    assert "float32 KV vs bfloat16 KV (greedy)" in capsys.readouterr().out
    assert [shut_down_before for _, shut_down_before in built] == [[], [True]]
    assert all(llm.engine.is_shut_down for llm, _ in built)


def test_compare_kv_dtype_runs_greedy_over_a_sampling_generation_config(tmp_path, monkeypatch, capsys):
    """The model's generation config samples; the comparison is of greedy outputs, so both runs take
    temperature 0."""
    import kvforge.generate_cmd as generate_cmd

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.9}))
    temperatures = []
    run = generate_cmd._run

    def recording_run(llm, prompts, params, chat):
        temperatures.append(params.temperature)
        return run(llm, prompts, params, chat)

    monkeypatch.setattr(generate_cmd, "_run", recording_run)
    code = main(["generate", str(tmp_path), "--load-format", "dummy", "--device", "cpu", "--max-model-len", "64",
                 "--prompt-token-ids", "1,2,3", "--max-tokens", "3", "--ignore-eos", "--no-progress",
                 "--compare-kv-dtype", "bf16"])
    assert code == 0 and temperatures == [0.0, 0.0]


@pytest.mark.parametrize("flag", ["--num-prompts", "--repetitions"])
def test_bench_offline_counts_below_one_are_usage_errors(no_engine, capsys, flag):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "offline", "--load-format", "dummy", flag, "0"])
    assert exc.value.code == 2
    assert f"argument {flag}: '0' must be >= 1" in capsys.readouterr().err


def test_bench_offline_runs_at_a_max_model_len_shorter_than_its_warm_up_prompts(tmp_path, capsys):
    """The warm-up's prompts are cut to the model length; they keep at least one token."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    out = tmp_path / "bench.json"
    assert main(["bench", "offline", str(tmp_path), "--load-format", "dummy", "--device", "cpu",
                 "--skip-tokenizer-init", "--kv-cache-memory", "1MiB", "--max-model-len", "8", "--num-prompts", "2",
                 "--input-len", "2", "2", "--output-len", "2", "2", "--no-progress", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["output_tokens"] == 4


@pytest.mark.parametrize("argv, takes_template", [([], True), (["--prompt", "The capital of France is"], False)],
                         ids=["default-question", "own-prompt"])
def test_the_default_question_takes_the_chat_template(monkeypatch, capsys, argv, takes_template):
    """Without --prompt, the built-in question goes through the embedded instruct model's chat template (as a
    bare completion it gets an empty answer); a prompt of one's own stays a completion unless --chat."""
    from kvforge.generate_cmd import DEFAULT_PROMPT

    chats = []
    real_chat = kvforge.llm.LLM.chat
    monkeypatch.setattr(kvforge.llm.LLM, "chat", lambda self, conversations, params, **kw: chats.append(conversations)
                        or real_chat(self, conversations, params, **kw))
    assert main(["generate", "--max-tokens", "8", "--no-progress", *argv]) == 0
    assert chats == ([[[{"role": "user", "content": DEFAULT_PROMPT}]]] if takes_template else [])
    out = capsys.readouterr().out
    answer = out.split("\n[", 1)[0].rsplit(">>>", 1)[-1].splitlines()[1:]  # the lines after the prompt's
    assert "".join(answer).strip(), out

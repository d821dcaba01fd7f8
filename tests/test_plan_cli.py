"""`kvforge plan` end to end: JSON keys, bad input -> one clear message and exit 2, torch-free."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvforge.cli import main

REQUIRED_KEYS = {
    "block_size", "block_size_reason", "kv_cache_dtype", "tensor_parallel_size", "bytes_per_token",
    "state_bytes_per_sequence", "layers", "groups", "num_blocks", "capacity_tokens", "max_concurrency",
    "weights_bytes_per_rank", "warnings", "baseline",
}
LAYER_KEYS = {"index", "kind", "backend", "kv_dtype", "query_dtype", "query_dtype_reason", "heads_per_rank",
              "kv_heads_per_rank", "bytes_per_token"}
GROUP_KEYS = {"kind", "layers", "block_size", "page_bytes", "page_bytes_unpadded", "padding_layers"}


def run(capsys, *argv):
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_has_every_documented_key(capsys):
    code, out, _ = run(capsys, "csa-ring-test", "-tp", "8", "--kv-cache-dtype", "fp8", "--kv-cache-memory", "8GiB",
                       "--json")
    assert code == 0
    d = json.loads(out)
    assert REQUIRED_KEYS <= d.keys()
    assert LAYER_KEYS <= d["layers"][0].keys() and GROUP_KEYS <= d["groups"][0].keys()
    assert d["block_size"] == 32 and d["tensor_parallel_size"] == 8
    # the baseline is the model dtype the CPU engine runs (float32), as the plan of `generate` would say
    assert d["baseline"]["kv_cache_dtype"] == "float32" and d["baseline"]["capacity_tokens"] > 0
    # each sequence takes a ring slot: the tokens are those of the slots' sequences where the blocks hold more
    assert d["capacity_tokens"] == min(d["num_blocks"] * 32, d["state_slots"] * d["max_model_len"])
    assert d["capacity_sequences"] == d["state_slots"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_no_memory_gives_null_capacity(capsys, device):
    code, out, _ = run(capsys, "llama-3.1-8b", "--device", device, "--json")
    d = json.loads(out)
    assert code == 0 and d["num_blocks"] is None and d["capacity_tokens"] is None and d["max_concurrency"] is None


def test_cpu_plan_without_memory_warns_when_the_cpu_engines_default_cannot_run_it(capsys):
    """The plan without memory holds (exit 0, no capacity); that the CPU engine's 1 GiB default would refuse it
    is said on stderr, with the fix, where a plan that fits gets no warning."""
    code, out, err = run(capsys, "llama-3.1-8b", "--json")
    assert code == 0 and json.loads(out)["num_blocks"] is None
    assert "warning: the CPU engine's default KV memory (1024 MiB) cannot run this plan" in err
    # A script reading the JSON sees the same warning among the plan's warnings.
    assert any(w.startswith("the CPU engine's default KV memory (1024 MiB) cannot run this plan")
               for w in json.loads(out)["warnings"])
    assert "lower --max-model-len to at most 4096" in err
    code, out, err = run(capsys, "llama-3.1-8b", "--max-model-len", "2048")
    assert code == 0 and "warning" not in err
    code, out, err = run(capsys, "llama-3.1-8b", "--device", "cuda")
    assert code == 0 and "warning: the CPU engine" not in err


def test_json_errors_are_json_on_stdout(capsys):
    code, out, err = run(capsys, "llama-3.1-8b", "--device", "cuda", "--block-size", "8", "--json")
    assert code == 2 and "error: --block-size 8 cannot work" in err
    error = json.loads(out)["error"]
    assert error["type"] == "PlanError" and "use --block-size 16" in error["message"]


@pytest.mark.parametrize("argv,says", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--max-model-len", "lots"], "argument --max-model-len: 'lots' is not a token count"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2: pipeline parallelism is not implemented"),
], ids=["unknown-flag", "bad-value", "refused-vllm-flag"])
def test_json_command_line_refusals_are_json_on_stdout(capsys, argv, says):
    """The parser's own refusals (exit 2 before any plan) also give a script reading stdout one object;
    stderr keeps the usual message."""
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "llama-3.1-8b", "--json", *argv])
    out = capsys.readouterr()
    assert exit_.value.code == 2 and says in out.err
    error = json.loads(out.out)["error"]
    assert error == {"type": "UsageError", "message": error["message"]} and error["message"].startswith(says)


def test_cpu_plan_without_memory_names_the_cpu_engines_default(capsys, tmp_path):
    """A plan is often made on one machine for another, so no memory flag means no capacity; on CPU the
    table says what the CPU engine would take, and that figure is the engine's: the plan given it has the
    block count of the engine built from the same flags."""
    from kvforge import LLM
    from kvforge.planner.inputs import DEFAULT_CPU_KV_CACHE_MEMORY

    code, out, _ = run(capsys, "llama-3.1-8b")
    assert code == 0 and "the CPU engine takes 1.00 GiB unless --kv-cache-memory sets another size" in " ".join(out.split())
    code, out, _ = run(capsys, "llama-3.1-8b", "--device", "cuda")
    assert code == 0 and "CPU engine" not in out
    config = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=256, max_position_embeddings=512,
                  rms_norm_eps=1e-5, torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, _ = run(capsys, str(tmp_path), "--kv-cache-memory", str(DEFAULT_CPU_KV_CACHE_MEMORY), "--json")
    planned = json.loads(out)
    engine = LLM(str(tmp_path), load_format="dummy", device="cpu", skip_tokenizer_init=True, progress=False)
    assert code == 0 and planned["num_blocks"] == engine.plan.num_blocks > 0
    assert planned["capacity_tokens"] == engine.plan.capacity_tokens


def test_embedded_model_plan(capsys):
    code, out, _ = run(capsys, "--json")
    d = json.loads(out)
    assert code == 0 and d["model"] == "SmolLM2-135M-Instruct" and len(d["layers"]) == 30
    assert d["layers"][0]["kv_heads_per_rank"] == 3


def test_table_output(capsys):
    code, out, _ = run(capsys, "gemma-3-1b", "--kv-cache-dtype", "fp8", "--gpu-memory", "80GB")
    assert code == 0 and "KV plan" in out and "padding layers 2" in out


def test_piped_table_keeps_whole_cells(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # stdout is captured: not a terminal
    code, out, _ = run(capsys, "gemma-3-27b", "--device", "cuda", "--kv-cache-dtype", "fp8", "--gpu-memory", "141GB")
    assert code == 0
    assert "…" not in out
    assert "sliding" in out and "triton_paged" in out and "fp8_e4m3" in out and "bfloat16" in out


@pytest.mark.parametrize("argv,needle", [
    (["llama-3.1-8b", "--kv-cache-dtype", "fp9"], "unknown KV cache dtype 'fp9'"),
    (["llama-3.1-8b", "-tp", "3"], "does not divide num_attention_heads 32"),
    (["no-such-model"], "neither a path that exists nor a preset"),
    (["csa-ring-test", "-tp", "8", "--kv-cache-dtype", "fp8", "--block-size", "16"], "6144 bytes"),
    (["llama-3.1-70b", "--device", "cuda", "--gpu-memory", "80GB"], "weights need"),
    (["llama-3.1-8b", "--max-model-len", "1000000"], "max_position_embeddings"),
    (["deepseek-v2-lite", "--device", "cuda", "--query-dtype", "fp8"], "KV cache is bfloat16 (not quantized)"),
])
def test_bad_input_exits_2_with_message(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("flags,query", [([], "bfloat16"), (["--query-dtype", "model"], "bfloat16"),
                                         (["--query-dtype", "fp8"], "fp8_e4m3")])
def test_fp8_mla_query_dtype_flag(capsys, flags, query):
    """DeepSeek-V2-Lite on CUDA with an fp8 latent cache: the model-dtype query unless --query-dtype fp8."""
    code, out, _ = run(capsys, "deepseek-v2-lite", "--device", "cuda", "--kv-cache-dtype", "fp8", *flags, "--json")
    assert code == 0
    assert {layer["query_dtype"] for layer in json.loads(out)["layers"]} == {query}


@pytest.mark.parametrize("flag,value", [("--block-size", "-16"), ("--block-size", "1.5"), ("--tensor-parallel-size", "0"),
                                        ("--kv-cache-memory", "lots"), ("--gpu-memory-utilization", "1.5")])
def test_bad_numbers_rejected_by_argparse(capsys, flag, value):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "llama-3.1-8b", flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_missing_and_malformed_config(tmp_path, capsys):
    code, _, err = run(capsys, str(tmp_path))
    assert code == 2 and "no config.json" in err
    (tmp_path / "config.json").write_text("{not json")
    code, _, err = run(capsys, str(tmp_path))
    assert code == 2 and "not valid JSON" in err
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    code, _, err = run(capsys, str(tmp_path))
    assert code == 2 and "unsupported architecture 'FooForCausalLM'" in err and "LlamaForCausalLM" in err
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    code, _, err = run(capsys, str(tmp_path))
    assert code == 2 and "missing required field" in err


def test_planner_imports_no_torch():
    code = ("import sys, kvforge; p = kvforge.plan('deepseek-v3', kv_cache_dtype='fp8', tensor_parallel_size=8); "
            "from kvforge.cli import main; main(['plan', 'qwen3-next-80b-a3b', '--json']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name,state,per_token", [
    # Qwen3-Next-80B: 36 Gated-DeltaNet layers of 32 x 128 x 128 + 3 x 8192 float32 elements; 12 full layers
    # x 2 KV heads x 512 elements per token. Kimi-Linear-48B: 20 KDA layers of 32 x 128 x 128 + 3 x 3 x 4096
    # float32 elements; 7 MLA layers x 576 elements per token.
    ("qwen3-next-80b-a3b", 36 * (32 * 128 * 128 + 3 * 8192) * 4, 12 * 2 * 512),
    ("kimi-linear-48b-a3b", 20 * (32 * 128 * 128 + 9 * 4096) * 4, 7 * 576),
])
def test_plan_shows_the_exact_fp8_gain_of_linear_attention_hybrids(capsys, name, state, per_token):
    L = 4096
    code, out, _ = run(capsys, name, "--device", "cuda", "--kv-cache-dtype", "fp8", "--kv-cache-memory", "40GiB",
                       "--max-model-len", str(L), "--json")  # the bf16 model dtype of a GPU run
    assert code == 0
    d = json.loads(out)
    exact = (state + L * per_token * 2) / (state + L * per_token)
    assert d["concurrency_gain_vs_baseline"] == exact and 1 < exact < 2
    assert d["state_dtype"] == "float32" and d["bytes_per_sequence"] == state + L * per_token
    code, out, _ = run(capsys, name, "--device", "cuda", "--kv-cache-dtype", "fp8", "--kv-cache-memory", "40GiB",
                       "--max-model-len", str(L))
    assert code == 0 and "concurrency gain (exact)" in out and "state dtype" in out


def test_plan_predicts_the_engines_cpu_dtype(capsys, smol_llm):
    """`kvforge plan` on CPU plans the model dtype the CPU engine runs (float32 unless --dtype says): the
    engine built with the same (default) flags plans the same KV dtype and bytes per token."""
    code, out, _ = run(capsys, "--json")
    assert code == 0
    d = json.loads(out)
    engine_plan = smol_llm(device="cpu").engine.plan
    assert {layer["kv_dtype"] for layer in d["layers"]} == {layer.kv_dtype for layer in engine_plan.layers}
    assert {layer.kv_dtype for layer in engine_plan.layers} == {"float32"}
    assert d["bytes_per_token"] == engine_plan.bytes_per_token
    code, out, _ = run(capsys, "--dtype", "bfloat16", "--json")
    assert code == 0 and d["bytes_per_token"] == 2 * json.loads(out)["bytes_per_token"]


def test_the_table_says_what_sliding_and_state_layers_hold(capsys):
    """Sliding layers hold a window, not bytes per token; every other layer of a 1:1 hybrid is a stepped range;
    the fixed bytes per sequence say what holds them; a state layer has no KV cache and no attention query."""
    code, out, _ = run(capsys, "gpt-oss-20b", "--device", "cuda", "--gpu-memory", "141GB")
    text = " ".join(out.split())
    assert code == 0 and "128-token window" in text and "0..22 every 2 (12)" in text
    assert "fixed bytes per sequence 3,538,944 (sliding windows 3,538,944)" in text
    code, out, _ = run(capsys, "qwen3-next-80b-a3b", "--device", "cuda", "--gpu-memory", "141GB", "-tp", "2")
    row = next(line for line in out.splitlines() if line.startswith("│ 0-2 "))
    assert "state float32" in row and "│ -" in row and "state 1,097,728 B/seq" in row
    assert row.split("│")[3].strip() == "-"  # no attention backend: the state update is routed per call
    assert "(linear-attention state 39,518,208)" in " ".join(out.split())


def test_the_table_names_the_scale_scheme_and_n_gram_speculation(capsys):
    """The text output says what --kv-scale-scheme and --num-speculative-tokens (n-gram: a proposer with no
    layers) planned, not only the JSON."""
    code, out, _ = run(capsys, "llama-3.1-8b", "--kv-cache-dtype", "fp8", "--kv-scale-scheme", "per_head",
                       "--num-speculative-tokens", "3")
    words = " ".join(out.split())  # the table wraps long cells at spaces, whatever the terminal's width
    assert code == 0 and "(scales: default, per-head)" in words
    assert "3 proposed tokens a step, verified in 4 rows a sequence" in words
    code, out, _ = run(capsys, "llama-3.1-8b", "--kv-cache-dtype", "fp8")
    words = " ".join(out.split())
    assert "(scales: default, per-tensor)" in words and "speculative decoding" not in words


def test_a_serve_command_line_plans_as_it_stands(capsys):
    """Flags of serve and generate that do not bear on the KV cache change nothing in the plan."""
    base = ["llama-3.1-8b", "--device", "cuda", "--gpu-memory", "80GB", "--kv-cache-dtype", "fp8", "--json"]
    code, plain, _ = run(capsys, *base)
    assert code == 0
    code, served, err = run(capsys, *base, "--load-format", "dummy", "--port", "9001", "--enforce-eager",
                            "--swap-space", "4", "--seed", "3", "--served-model-name", "m", "--temperature", "0.5",
                            "--enable-log-requests", "--disable-log-requests")
    assert code == 0 and err == ""
    assert json.loads(served) == json.loads(plain)


def test_plan_reserves_the_engines_step_without_chunked_prefill(capsys, smol_llm):
    """Without chunked prefill a prompt runs in one step: `kvforge plan` reserves activations for the step the
    engine built from the same flags reserves (max_model_len tokens here, not the 2,048-token budget)."""
    flags = dict(enable_chunked_prefill=False, max_model_len=4096, kv_cache_memory=256 << 20, device="cpu")
    code, out, _ = run(capsys, "--no-enable-chunked-prefill", "--max-model-len", "4096", "--kv-cache-memory", "256MiB",
                       "--json")
    engine_plan = smol_llm(**flags).engine.plan
    d = json.loads(out)
    assert code == 0 and d["activations"]["tokens"] == engine_plan.activations.tokens == 4096
    assert d["activations"]["bytes"] == engine_plan.activations.bytes and d["num_blocks"] == engine_plan.num_blocks


def test_prefix_caching_flag_reaches_the_plan(capsys):
    code, out, _ = run(capsys, "llama-3.1-8b", "--no-enable-prefix-caching", "--json")
    d = json.loads(out)
    assert code == 0 and d["prefix_caching"] is False and "--no-enable-prefix-caching" in d["prefix_caching_reason"]


def test_gpu_memory_on_cpu_plans_what_the_cpu_engine_sizes(capsys):
    """The CPU engine sizes its KV cache from --kv-cache-memory alone: --gpu-memory warns and changes nothing."""
    code, plain, _ = run(capsys, "--json")
    code2, given, err = run(capsys, "--gpu-memory", "8GiB", "--json")
    assert code == code2 == 0
    assert "--gpu-memory has no effect on CPU" in err
    given, plain = json.loads(given), json.loads(plain)
    assert given.pop("warnings") == ["--gpu-memory has no effect on CPU: the KV cache gets --kv-cache-memory "
                                     "(default 1 GiB)"] and plain.pop("warnings") == []
    assert given == plain  # the plan itself is the same


@pytest.mark.parametrize("argv,needle", [
    (["--tool-call-parser", "hermes"], "--tool-call-parser is read only with --enable-auto-tool-choice"),
    (["--long-prefill-token-threshold", "64", "--no-enable-chunked-prefill"], "needs chunked prefill"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
])
def test_serve_flags_are_checked_as_serve_checks_them(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2 and needle in err and "Traceback" not in err


def test_refused_vllm_flag_fails_at_parse_time(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--quantization", "awq"])
    assert exc.value.code == 2 and "--quantization awq" in capsys.readouterr().err


@pytest.mark.parametrize("dtype, low, high", [("fp8", "2^-6", "448"), ("fp8_e5m2", "2^-14", "57344")])
def test_default_scale_warning_names_both_ends_of_the_format(capsys, dtype, low, high):
    """Scale 1.0 loses precision below the format's smallest normal as well as saturating above its max."""
    code, out, _ = run(capsys, "llama-3.1-8b", "--device", "cuda", "--kv-cache-dtype", dtype, "--json")
    warning = next(w for w in json.loads(out)["warnings"] if "default scale 1.0" in w)
    assert code == 0 and f"smallest normal ({low})" in warning and f"above {high} saturate" in warning
    assert "--calculate-kv-scales" in warning


@pytest.mark.parametrize("model, note", [("gemma-3-1b", False), ("qwen3-next-80b-a3b", True)])
def test_exact_concurrency_gain_names_only_what_keeps_its_dtype(capsys, model, note):
    """Sliding windows shrink with the KV dtype; only linear-attention state slots keep theirs."""
    code, out, _ = run(capsys, model, "--device", "cuda", "--kv-cache-dtype", "fp8", "--kv-cache-memory", "40GB")
    line = next(x for x in out.splitlines() if "concurrency gain (exact)" in x)
    assert code == 0 and ("linear-attention state keeps its dtype" in line) == note
    assert "not halved" not in out


@pytest.mark.parametrize("argv, needle", [
    (["--max-num-batched-tokens", "100", "--no-enable-chunked-prefill"], "without chunked prefill"),
    (["--num-speculative-tokens", "4", "--max-num-batched-tokens", "4", "--max-num-seqs", "1"],
     "exceeds --max-num-batched-tokens 4"),
    (["csa-ring-test", "--async-scheduling"], "--async-scheduling is not supported for ring"),
])
def test_the_engines_config_checks_run_in_the_plan(capsys, argv, needle):
    """The engine's checks that need no model files (kvforge/engine/config_checks.py) refuse the line here too."""
    code, _, err = run(capsys, *argv)
    assert code == 2 and needle in err


def test_what_the_engine_does_not_run_yet_plans_with_a_warning(capsys):
    code, out, err = run(capsys, "csa-ring-test", "-tp", "2", "--json")
    assert code == 0 and json.loads(out)["tensor_parallel_size"] == 2
    assert "warning: kvforge serve and generate refuse this line: per-request rings" in err


def test_device_auto_plans_this_machines_gpu_as_the_engine_does(capsys, monkeypatch):
    """--device auto picks cuda where torch sees a GPU and plans that GPU's memory, as the engine reads it."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1, 80 * 10**9))
    code, out, _ = run(capsys, "llama-3.1-8b", "--device", "auto", "--json")
    code2, named, _ = run(capsys, "llama-3.1-8b", "--device", "cuda", "--gpu-memory", "80GB", "--json")
    auto = json.loads(out)
    assert code == code2 == 0 and auto["platform"] == "cuda"
    assert auto["capacity_tokens"] == json.loads(named)["capacity_tokens"] > 0


def test_pool_bytes_per_token_compare_with_the_baseline_and_max_model_len_below_2_is_refused(capsys):
    """The JSON's pool bytes (target + proposer) and the baseline's count the same layers, so their ratio is
    the KV dtypes' (fp8 against bf16: 1/2 for attention layers); a one-token context exits 2 at the plan."""
    argv = ["plan", "qwen3-next-80b-a3b", "--device", "cuda", "-tp", "4", "--kv-cache-memory", "40GiB",
            "--kv-cache-dtype", "fp8", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
            "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["pool_bytes_per_token"] == d["bytes_per_token"] + d["draft"]["bytes_per_token"]
    assert 2 * d["pool_bytes_per_token"] == d["baseline"]["pool_bytes_per_token"]
    assert main(["plan", "--max-model-len", "1"]) == 2
    assert "--max-model-len 1: a sequence needs at least 2 tokens" in capsys.readouterr().err


def test_a_one_token_context_from_the_config_is_named_as_the_configs(tmp_path, capsys):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 256, "max_position_embeddings": 1, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "the model's context length (1, from its config): a sequence needs at least 2 tokens" in err
    assert "use --max-model-len 2 or more" in err

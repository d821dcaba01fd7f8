"""Flag spellings a vLLM launch script passes: both forms of the boolean switches, human-readable token
counts for ``--max-model-len``, ``--kv-cache-memory-bytes`` and vLLM's KV dtype names. Parsed by the
real ``kvforge`` parser (no engine is built)."""

from __future__ import annotations

import argparse

import pytest

from kvforge.cli import build_parser
from kvforge.cli_args import token_count
from kvforge.errors import ConfigError
from kvforge.kv_dtypes import canonical_kv_dtype


def parse(command: str, *flags: str) -> argparse.Namespace:
    return build_parser(command).parse_args([command, *flags])


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_both_forms_of_the_boolean_switches(command):
    assert parse(command).enable_prefix_caching is True and parse(command).enable_chunked_prefill is True
    on = parse(command, "--enable-prefix-caching", "--enable-chunked-prefill")
    assert on.enable_prefix_caching is True and on.enable_chunked_prefill is True
    off = parse(command, "--no-enable-prefix-caching", "--no-enable-chunked-prefill")
    assert off.enable_prefix_caching is False and off.enable_chunked_prefill is False


@pytest.mark.parametrize("text,tokens", [("131072", 131072), ("128K", 131072), ("128k", 128000), ("25.6k", 25600),
                                         ("1M", 1 << 20), ("2m", 2_000_000), (" 4096 ", 4096)])
def test_token_counts_read_like_vllm(text, tokens):
    assert token_count(text) == tokens
    assert parse("plan", "--max-model-len", text).max_model_len == tokens


@pytest.mark.parametrize("text,message", [("4kb", "not a token count"), ("1.5K", "decimal multiplier"),
                                          ("0", ">= 1"), ("0.0001k", "whole number"), ("-1", "not a token count")])
def test_bad_token_counts_name_the_problem(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        token_count(text)


@pytest.mark.parametrize("command", ["generate", "serve", "plan"])
def test_trust_remote_code_is_accepted_and_reaches_the_engine_args(command):
    from kvforge.config import EngineArgs

    ns = parse(command, "--trust-remote-code")
    assert ns.trust_remote_code is True and parse(command).trust_remote_code is False
    assert parse(command, "--no-trust-remote-code").trust_remote_code is False  # vLLM's negative spelling
    if command != "plan":
        assert EngineArgs.from_cli_args(ns).trust_remote_code is True
    assert EngineArgs(trust_remote_code=True).trust_remote_code is True  # the Python API's keyword


def test_kv_cache_memory_bytes_is_the_same_flag():
    assert parse("plan", "--kv-cache-memory-bytes", "8GiB").kv_cache_memory == 8 << 30
    assert parse("plan", "--kv-cache-memory", "8GiB").kv_cache_memory == 8 << 30


@pytest.mark.parametrize("name,canonical", [("bfloat16", "bfloat16"), ("bf16", "bfloat16"), ("float16", "float16"),
                                            ("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")])
def test_kv_dtype_spellings(name, canonical):
    assert canonical_kv_dtype(name) == canonical


def test_an_unknown_kv_dtype_lists_the_vllm_spellings():
    with pytest.raises(ConfigError, match=r"bfloat16 \(bf16\), float16 \(fp16\), float32 \(fp32\), fp8 \(= fp8_e4m3\)"):
        canonical_kv_dtype("fp9")


@pytest.mark.parametrize("argv,expected", [
    (["serve", "--max_model_len=4096", "--tensor_parallel_size", "2"],
     ["serve", "--max-model-len=4096", "--tensor-parallel-size", "2"]),
    (["serve", "--stop_token=a_b", "--x"], ["serve", "--stop-token=a_b", "--x"]),  # the value keeps its underscores
    (["serve", "--chat-template", "my_template.jinja"], ["serve", "--chat-template", "my_template.jinja"]),
    (["bench", "--", "--not_a_flag_here"], ["bench", "--", "--not_a_flag_here"]),
])
def test_underscored_flag_names_read_as_dashed(argv, expected):
    from kvforge.cli_args import dashed_flag_names

    assert dashed_flag_names(argv) == expected


def test_the_command_line_takes_vllms_underscored_spellings(capsys):
    from kvforge.cli import main

    assert main(["plan", "--max_model_len=2048", "--kv_cache_dtype", "fp8", "--json"]) == 0
    import json

    plan = json.loads(capsys.readouterr().out)
    assert plan["max_model_len"] == 2048 and plan["kv_cache_dtype"] == "fp8_e4m3"

"""``kvforge bench offline`` reports the engine's counters over its timed runs (``engine_stats``) and the
warm-up's apart (``engine_stats_warmup``), so the warm-up's steps and tokens never count as measured work."""

from __future__ import annotations

import json

import pytest

from kvforge.bench.offline import stats_between, warm_up
from kvforge.cli import main

TINY = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, vocab_size=256, max_position_embeddings=1024,
            rms_norm_eps=1e-5, torch_dtype="float32")


def test_stats_between_subtracts_counters_and_keeps_state():
    before = {"num_steps": 10, "kv_blocks_used": 3, "kv_blocks_total": 64, "async_scheduling": False,
              "spec_decode": {"num_drafts": 4, "accepted_per_pos": [3, 1]}, "num_running": 2}
    after = {"num_steps": 25, "kv_blocks_used": 0, "kv_blocks_total": 64, "async_scheduling": False,
             "spec_decode": {"num_drafts": 9, "accepted_per_pos": [7, 2]}, "num_running": 0}
    assert stats_between(before, after) == {
        "num_steps": 15, "kv_blocks_used": 0, "kv_blocks_total": 64, "async_scheduling": False,
        "spec_decode": {"num_drafts": 5, "accepted_per_pos": [4, 1]}, "num_running": 0}
    assert stats_between({"spec_decode": None}, {"spec_decode": None}) == {"spec_decode": None}


def test_engine_stats_cover_the_timed_runs_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "bench.json"
    num_prompts, output_len, reps = 3, 6, 2
    assert main(["bench", "offline", str(tmp_path), "--load-format", "dummy", "--device", "cpu",
                 "--skip-tokenizer-init", "--kv-cache-memory", "4MiB", "--no-enable-prefix-caching",
                 "--num-prompts", str(num_prompts), "--input-len", "8", "16",
                 "--output-len", str(output_len), str(output_len), "--repetitions", str(reps),
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    timed, warm, runs = result["engine_stats"], result["engine_stats_warmup"], result["runs"]
    assert timed["generation_tokens_total"] == reps * num_prompts * output_len == sum(r["output_tokens"] for r in runs)
    assert timed["prompt_tokens_total"] == sum(r["input_tokens"] for r in runs)
    assert timed["num_steps"] == sum(r["steps"] for r in runs)
    for r in runs:  # the run's time by kind of step, from the engine's step log
        split = r["step_seconds"]
        assert split["prompt_steps"] >= 1 and split["prompt_steps"] + split["decode_steps"] == r["steps"]
        # each step's own time: together at most the run's time (time.monotonic vs perf_counter: 10 ms slack)
        assert 0 < split["prompt_seconds"] + split["decode_seconds"] <= r["seconds"] + 0.01
        assert 0 < split["first_prompt_step_seconds"] <= split["prompt_seconds"]
    # The warm-up: the three prompts warm_up() sends, 8 tokens each.
    warm_lengths = warm_up.__defaults__[0]
    assert warm["generation_tokens_total"] == len(warm_lengths) * 8
    assert warm["prompt_tokens_total"] == sum(warm_lengths)
    assert warm["num_steps"] > 0
    assert timed["kv_blocks_total"] == warm["kv_blocks_total"] > 0 and timed["kv_blocks_used"] == 0


@pytest.mark.parametrize("key", ["num_running", "kv_blocks_used"])
def test_state_keys_are_not_differenced(key):
    assert stats_between({key: 5}, {key: 2}) == {key: 2}


def test_warmup_runs_are_untimed_and_leave_the_timed_prompts_alone(tmp_path, capsys):
    """``--warmup-runs 1`` runs the whole workload once more before the timed runs, counted with the
    warm-up; the timed runs see the same workload (the same lengths) as without it."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    results = []
    for warmups in (0, 1):
        out = tmp_path / f"bench{warmups}.json"
        assert main(["bench", "offline", str(tmp_path), "--load-format", "dummy", "--device", "cpu",
                     "--skip-tokenizer-init", "--kv-cache-memory", "4MiB", "--no-enable-prefix-caching",
                     "--num-prompts", "3", "--input-len", "8", "16", "--output-len", "5", "5",
                     "--warmup-runs", str(warmups), "--out", str(out)]) == 0
        results.append(json.loads(out.read_text()))
    plain, warmed = results
    assert warmed["warmup_runs"] == 1 and plain["warmup_runs"] == 0
    captured = capsys.readouterr()
    assert "warm-up run 0:" in captured.err  # progress on stderr: stdout is the result's JSON alone
    decoder, text, seen = json.JSONDecoder(), captured.out.strip(), []
    while text:  # the two commands' results, one after the other, and nothing else
        obj, end = decoder.raw_decode(text)
        seen.append(obj["warmup_runs"])
        text = text[end:].strip()
    assert seen == [0, 1]
    extra = warmed["engine_stats_warmup"]["generation_tokens_total"] - plain["engine_stats_warmup"]["generation_tokens_total"]
    assert extra == 3 * 5  # one more pass over the three requests
    assert warmed["engine_stats"]["generation_tokens_total"] == plain["engine_stats"]["generation_tokens_total"] == 15
    assert warmed["engine_stats"]["prompt_tokens_total"] == plain["engine_stats"]["prompt_tokens_total"]


def test_profile_categories_take_the_engines_kernels_by_name():
    """The decode profile files each kernel the engine launches under its category, by the kernel's own name
    (so a renamed kernel that drops out of its category fails here)."""
    kernels = pytest.importorskip("kvforge.kernels.triton_small_m_linear")
    from kvforge.bench.offline import kernel_category
    from kvforge.kernels import gluon_fp8_decode, triton_cache_write, triton_paged_attention

    assert kernel_category(kernels._small_m_linear_kernel.__name__) == "gemm"
    assert kernel_category(kernels._sum_splits_kernel.__name__) == "gemm"
    assert kernel_category(triton_paged_attention._paged_attn_kernel.__name__) == "attention"
    assert kernel_category(triton_paged_attention._merge_splits_kernel.__name__) == "attention"
    assert kernel_category(gluon_fp8_decode._gluon_fp8_decode_warp_kernel.__name__) == "attention"
    assert kernel_category(triton_cache_write._write_kv_kernel.__name__) == "kv_write"
    assert kernel_category("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "gemm"  # a cuBLAS kernel's name
    assert kernel_category("triton_red_fused_add_rms_norm") == "other"
    from kvforge.kernels import (
        triton_causal_conv1d,
        triton_delta_gates,
        triton_expert_gemm,
        triton_expert_rows,
        triton_gated_delta_rule,
        triton_gated_rms_norm,
        triton_router_logits_topk,
        triton_router_topk,
    )

    assert kernel_category(triton_expert_gemm._expert_gemm_kernel.__name__) == "gemm"
    for fn in (triton_router_topk._router_topk_kernel, triton_router_logits_topk._router_logits_topk_kernel,
               triton_expert_rows._group_rows_kernel, triton_expert_rows._combine_rows_kernel):
        assert kernel_category(fn.__name__) == "moe_routing", fn.__name__
    for fn in (triton_gated_delta_rule._recurrent_kernel, triton_gated_delta_rule._chunk_prep_kernel,
               triton_gated_delta_rule._chunk_state_kernel,
               triton_causal_conv1d._conv1d_decode_kernel, triton_causal_conv1d._conv1d_prefill_kernel,
               triton_delta_gates._delta_gates_kernel, triton_gated_rms_norm._gated_rms_norm_kernel):
        assert kernel_category(fn.__name__) == "linear_attention", fn.__name__


def test_a_profile_lists_its_longest_kernels_per_step():
    from kvforge.bench.offline import top_kernels

    events = [("_router_topk_kernel", 260.0, 130), ("nvjet_tst_gemm", 5000.0, 650), ("_idle", 0.0, 3),
              ("_recurrent_kernel", 1000.0, 100)]
    rows = top_kernels(events, n_steps=5, limit=2)
    assert [r["name"] for r in rows] == ["nvjet_tst_gemm", "_recurrent_kernel"]
    assert rows[0] == {"name": "nvjet_tst_gemm", "category": "gemm", "ms_per_step": 1.0, "calls_per_step": 130.0}
    assert rows[1]["category"] == "linear_attention" and rows[1]["calls_per_step"] == 20.0


def test_a_sampled_workload_runs_and_is_recorded(tmp_path):
    """``--temperature`` > 0 sends every request down the sampler's random path (the default is greedy); the
    run still emits every requested token (ignore_eos) and the result says which it was."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "bench.json"
    assert main(["bench", "offline", str(tmp_path), "--load-format", "dummy", "--device", "cpu",
                 "--skip-tokenizer-init", "--kv-cache-memory", "4MiB", "--num-prompts", "3", "--input-len", "8", "16",
                 "--output-len", "5", "5", "--temperature", "0.8", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["temperature"] == 0.8 and result["engine_stats"]["generation_tokens_total"] == 15


def test_one_length_is_vllms_fixed_length_and_the_median_is_one_run(tmp_path, capsys):
    """``--input-len 12`` (vLLM's form) gives every prompt 12 tokens; the reported median is one run's
    figures (for two runs, the slower), so they agree with each other; a line on stderr sums it up."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "bench.json"
    assert main(["bench", "offline", str(tmp_path), "--load-format", "dummy", "--device", "cpu",
                 "--skip-tokenizer-init", "--kv-cache-memory", "4MiB", "--num-prompts", "3",
                 "--input-len", "12", "--output-len", "4", "--repetitions", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["input_len"] == [12, 12] and result["input_tokens"] == 3 * 12 and result["output_tokens"] == 3 * 4
    assert result["load_format"] == "dummy"
    slower = max(result["runs"], key=lambda r: r["seconds"])
    assert result["median"] == {k: slower[k] for k in result["median"]}
    err = capsys.readouterr().err
    assert f"throughput: {slower['requests_per_s']:.2f} requests/s" in err and "median of 2 runs" in err
    assert "dummy weights" in err


def test_three_lengths_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "offline", "--input-len", "1", "2", "3"])
    assert exc.value.code == 2 and "expected N or MIN MAX, got 3 values" in capsys.readouterr().err

"""``--cuda-graph-sizes``: the decode batch sizes captured as CUDA graphs. Checked before any weight loads
(positive integers, none above ``--max-num-seqs``), kept sorted without repeats, and passed to the runner;
a decode batch runs the smallest captured size that holds it (padded) and a larger one runs eagerly. The
graph path's static, padded inputs run on CPU here (``static_decode_on_cpu``, no capture), so the padding
to a named size is checked against eager decoding token for token (near-tie rule)."""

from __future__ import annotations

import argparse

import pytest
from fake_engine import serve_refused
from greedy_agreement import FP32_LOGIT_TOL, assert_outputs_agree

from kvforge import LLM, SamplingParams
from kvforge.config import EngineArgs
from kvforge.engine.cuda_graphs import default_capture_sizes
from kvforge.errors import ConfigError


def test_sizes_are_sorted_without_repeats():
    args = EngineArgs(cuda_graph_sizes=[8, 1, 4, 8], max_num_seqs=8)
    assert args.cuda_graph_sizes == (1, 4, 8) and args.graph_sizes() == [1, 4, 8]
    assert EngineArgs().cuda_graph_sizes is None and EngineArgs().graph_sizes() is None


@pytest.mark.parametrize("bad", [[], [0], [3, -1], [2.5], [True], "8"])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(ConfigError, match="--cuda-graph-sizes wants one or more positive batch sizes"):
        EngineArgs(cuda_graph_sizes=bad)


def test_a_size_above_max_num_seqs_is_refused_naming_both():
    with pytest.raises(ConfigError) as err:
        EngineArgs(cuda_graph_sizes=[16, 512], max_num_seqs=256)
    assert "--cuda-graph-sizes 512 exceeds --max-num-seqs 256" in str(err.value)


def test_the_cli_flag_takes_a_list():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--cuda-graph-sizes", "24", "8", "16", "--max-num-seqs", "32"]))
    assert args.cuda_graph_sizes == (8, 16, 24)
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graph-sizes", "0"])


def test_serve_refuses_a_bad_size_before_weights(monkeypatch, capsys):
    err = serve_refused(monkeypatch, capsys, ["--cuda-graph-sizes", "300"])
    assert "--cuda-graph-sizes 300 exceeds --max-num-seqs 256" in err


def test_the_runner_pads_decode_batches_to_the_named_sizes(monkeypatch):
    """Five sequences with sizes (3, 6): the batch of five runs the size-6 graph path (one padding row), and
    once two have finished the batch of three runs size 3; tokens follow eager decoding."""
    import kvforge.engine.llm_engine as llm_engine

    prompts = [{"prompt_token_ids": [1 + i, 7, 3 + 2 * i, 11, 5][: 2 + i]} for i in range(5)]
    lens = [12, 12, 12, 6, 6]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in lens]
    eager = LLM(device="cpu", progress=False, enforce_eager=True).generate(prompts, params, use_tqdm=False)

    built = []

    class StaticDecodeRunner(llm_engine.ModelRunner):
        def __init__(self, *a, **kw):
            built.append(kw.get("graph_sizes"))
            super().__init__(*a, **{**kw, "static_decode_on_cpu": True})

    monkeypatch.setattr(llm_engine, "ModelRunner", StaticDecodeRunner)
    llm = LLM(device="cpu", progress=False, cuda_graph_sizes=[6, 3], max_num_seqs=8)
    assert built == [[3, 6]] and llm.engine.runner.graphs.sizes == [3, 6]
    padded = llm.generate(prompts, params, use_tqdm=False)
    assert_outputs_agree(padded, eager, FP32_LOGIT_TOL)
    stats = llm.engine.stats()
    assert stats["graph_steps"] >= 10, stats


@pytest.mark.parametrize(
    "max_num_seqs, expected",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (4, [1, 2, 4]),
        (20, [1, 2, 4, 8, 16, 20]),
        (256, [1, 2, 4, *range(8, 257, 8)]),
        (300, [1, 2, 4, *range(8, 257, 8), 272, 288, 300]),
    ],
)
def test_the_default_sizes_step_by_eight_then_sixteen(max_num_seqs, expected):
    # Written out independently of the function: 1, 2, 4, multiples of 8 to 256, of 16 beyond, then the cap.
    assert default_capture_sizes(max_num_seqs) == expected

"""vLLM launch flags (kvforge/cli_vllm_flags.py, ``--chat-template``, ``--enable-log-requests``): a vLLM launch
line either runs, with each flag doing what it says, or stops at parse time naming the flag and the fix."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine, serve_refused  # noqa: E402

from kvforge.server.cli import add_serve_args  # noqa: E402


def _parse(argv):
    return add_serve_args(argparse.ArgumentParser(prog="kvforge serve")).parse_args(argv)


def test_flags_without_effect_and_neutral_values_parse():
    ns = _parse(["--disable-log-requests", "--disable-log-stats", "--swap-space", "16", "--uvicorn-log-level",
                 "warning", "-pp", "1", "--data-parallel-size", "1", "--generation-config", "vllm",
                 "--max-logprobs", "20", "--disable-frontend-multiprocessing", "--trust-remote-code",
                 "--max-seq-len-to-capture", "8192", "--disable-custom-all-reduce", "-O3", "--tokenizer-mode", "auto",
                 "--limit-mm-per-prompt", "{}", "--guided-decoding-backend", "xgrammar", "--response-role",
                 "assistant", "--structured-outputs-config", '{"backend": "xgrammar", "disable_fallback": true}',
                 "--hf-token", "hf_x", "--api-server-count", "1", "--distributed-executor-backend", "mp",
                 "--disable-fastapi-docs", "--log-config-file", "x.json", "--cpu-offload-gb", "0", "--logprobs-mode",
                 "raw_logprobs", "--max-num-partial-prefills", "1", "--kv-offloading-size", "0.0",
                 "--collect-detailed-traces", "model,worker", "--enable-server-load-tracking", "--task", "generate",
                 "--runner", "auto", "--enable-reasoning", "--num-scheduler-steps", "1", "--preemption-mode",
                 "recompute", "--use-v2-block-manager", "--worker-cls", "auto"])
    assert not any(k.startswith("vllm_") for k in vars(_parse(["--hf-token"])))  # vLLM's bare form too
    assert not any(k.startswith("vllm_") for k in vars(ns))  # nothing reaches the engine


def test_model_as_vllm_spells_it():
    from kvforge.cli_args import model_argument
    from kvforge.config import EngineArgs
    from kvforge.errors import ConfigError

    assert model_argument(_parse(["--model", "llama-3.1-8b"])) == "llama-3.1-8b"
    assert model_argument(_parse(["llama-3.1-8b", "--model", "llama-3.1-8b"])) == "llama-3.1-8b"
    assert model_argument(_parse([])) is None
    assert EngineArgs.from_cli_args(_parse(["--model", "qwen3-8b", "--device", "cpu"])).model == "qwen3-8b"
    with pytest.raises(ConfigError, match="MODEL 'qwen3-8b' and --model 'llama-3.1-8b' name two models"):
        model_argument(_parse(["qwen3-8b", "--model", "llama-3.1-8b"]))


@pytest.mark.parametrize("argv, says", [
    (["--quantization", "awq"], "--quantization awq: kvforge loads unquantized safetensors"),
    (["-q", "fp8"], "-q fp8: kvforge loads unquantized"),
    (["-pp", "2"], "pipeline parallelism is not implemented; use --tensor-parallel-size; --pipeline-parallel-size accepts "
                      "only 1, which changes nothing"),
    (["--override-generation-config", "{}"], "the sampling defaults come from --generation-config"),
    (["--structured-outputs-config", '{"backend": "guidance"}'], "structured outputs run on xgrammar"),
    (["--structured-outputs-config", '{"disable_any_whitespace": true}'], "send disable_any_whitespace"),
    (["--guided-decoding-backend", "outlines"], "--guided-decoding-backend accepts only auto or xgrammar"),
    (["--download-dir", "/x"], "kvforge never downloads weights"),
    (["--revision", "main"], "check out the revision there"),
    (["--tokenizer-mode", "mistral"], "leave --tokenizer-mode at auto or hf; --tokenizer-mode accepts only auto or hf"),
    (["--ssl-keyfile", "k.pem"], "TLS is not served"),
    (["--response-role", "user"], "--response-role accepts only assistant"),
    (["--lora-modules", "sql=/loras/sql"], "LoRA adapters are not supported"),
    (["--uds", "/tmp/kvforge.sock"], "the server listens on TCP"),
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend accepts only mp"),
    (["--cpu-offload-gb", "8"], "weights and KV stay on the GPU"),
    (["--kv-offloading-size", "4"], "--kv-offloading-size accepts only 0"),  # the name given, of two
    (["--num-gpu-blocks-override", "1000"], "--kv-cache-memory"),
    (["--enable-sleep-mode"], "sleep mode is not implemented"),
    (["--config", "c.yaml"], "YAML file of flags is not read"),
    (["--mamba-ssm-cache-dtype", "float32"], "the linear-attention state's dtype is --state-dtype"),
    (["--mamba-cache-dtype", "auto"], "model (the model dtype, vLLM's auto)"),
    (["--task", "embed"], "kvforge serves text generation; --task accepts only auto or generate"),
    (["--runner", "pooling"], "--runner accepts only auto or generate"),
    (["--num-scheduler-steps", "8"], "--async-scheduling overlaps"),
    (["--preemption-mode", "swap"], "recomputed, never swapped"),
    (["--kv-sharing-fast-prefill"], "KV sharing across layers is not implemented"),
])
def test_flags_that_would_change_what_is_served_stop_at_parse_time(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_log_requests(caplog):
    import json
    import urllib.error
    import urllib.request

    from kvforge.server.app import ServerThread, create_app

    assert _parse(["--enable-log-requests"]).enable_log_requests and not _parse([]).enable_log_requests
    with ServerThread(create_app(FakeEngine(), log_requests=True)) as srv, caplog.at_level("INFO", "kvforge.server"):
        body = json.dumps({"prompt": ["a", "b"], "n": 2, "max_tokens": 3}).encode()
        req = urllib.request.Request(srv.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
    assert "request /v1/completions: 2 prompt(s) x n=2, max_tokens 3, stream False" in caplog.text
    caplog.clear()
    with ServerThread(create_app(FakeEngine(max_model_len=64), log_requests=True)) as srv, \
            caplog.at_level("INFO", "kvforge.server"):
        body = json.dumps({"prompt": "a", "max_tokens": 1000}).encode()  # past the context: refused
        req = urllib.request.Request(srv.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 400
    assert "request /v1/completions" not in caplog.text  # only requests the engine took are logged


def test_chat_template_file_or_text_replaces_the_tokenizers(tmp_path):
    from kvforge.llm import LLM

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    long_template = "{# " + "a comment longer than a file name may be " * 8 + "#}" + template  # > 255 bytes
    assert len(long_template) > 255
    for value in (str(path), template, long_template):
        llm = LLM(device="cpu", chat_template=value, max_model_len=256, kv_cache_memory=64 << 20)
        text = llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        assert text == "<user>hi<a>"
        llm.shutdown()


@pytest.mark.parametrize("value, says", [("not a template", "neither a file nor a jinja template"),
                                         ("{% for %}", "does not compile")])
def test_a_bad_chat_template_stops_before_weights(monkeypatch, capsys, value, says):
    err = serve_refused(monkeypatch, capsys, ["--chat-template", value])
    assert "--chat-template" in err and says in err


def test_log_outputs_clipped(caplog):
    import json
    import urllib.request

    from fake_engine import ScriptedEngine

    from kvforge.server.app import ServerThread, create_app

    ns = _parse(["--enable-log-outputs", "--max-log-len", "5"])
    assert ns.enable_log_outputs and ns.max_log_len == 5
    with ServerThread(create_app(ScriptedEngine("hello world"), log_outputs=True, max_log_len=5)) as srv, \
            caplog.at_level("INFO", "kvforge.server"):
        body = json.dumps({"prompt": "a", "max_tokens": 20}).encode()
        req = urllib.request.Request(srv.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["choices"][0]["text"] == "hello world"
    (line,) = [r.getMessage() for r in caplog.records if "output of /v1/completions" in r.getMessage()]
    assert "'hello' (finish stop, 12 tokens)" in line  # 11 characters and the end-of-sequence token

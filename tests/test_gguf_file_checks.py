"""GGUF files: every ggml type the loader reads, and the files it refuses, each with one clear error.

Small files written with ``gguf.GGUFWriter`` (no real weights):

* every type ``gguf.quants`` dequantizes comes out of the loader equal, element for element, to
  ``gguf.quants.dequantize`` of the stored bytes (quantized from random floats where gguf can quantize the
  type, random blocks otherwise); F32, F16 and BF16 equal the stored values;
* a tensor of a type the loader cannot read, a header cut short, rows that are not whole blocks, a path
  that is missing or a directory: a ConfigError (``error: ...`` from the CLI) naming the file and what is
  wrong, raised with the config, before any model is built;
* metadata: a Gemma 3 ``sliding_window_pattern`` of 0 makes every layer slide (llama.cpp's reading); a rope
  scaling type kvforge does not implement is refused; a GGUF file is recognised by its magic whatever its name.
* a part of a split GGUF (``split.count`` > 1) is refused, naming the merge command.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from kvforge.errors import ConfigError  # noqa: E402

Q = gguf.GGMLQuantizationType
HIDDEN, FF, VOCAB = 256, 256, 32


def _dequantizable() -> list:
    """The ggml types gguf.quants dequantizes (probed on one all-zero block)."""
    out = []
    for t in Q:
        if t not in gguf.GGML_QUANT_SIZES:
            continue
        try:
            gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[t][1]), dtype=np.uint8), t)
        except NotImplementedError:
            continue
        out.append(t)
    return out


DEQUANTIZABLE = _dequantizable()
NOT_DEQUANTIZABLE = [t for t in Q if t in gguf.GGML_QUANT_SIZES and t not in DEQUANTIZABLE]


def _stored(t, rows: int, cols: int, rng) -> np.ndarray:
    """A ``rows x cols`` tensor of type ``t`` as GGUFWriter takes it: floats for F32/F16, else packed bytes."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if t == Q.F32:
        return x
    if t == Q.F16:
        return x.astype(np.float16)
    try:
        return gguf.quants.quantize(x, t)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[t]
        return rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)


def _add(w, name: str, t, data: np.ndarray) -> None:
    if t in (Q.F32, Q.F16):
        w.add_tensor(name, data)
    else:
        w.add_tensor(name, data, raw_dtype=t)


def _write_llama(path, ffn_up_type=Q.F32, meta: dict | None = None, shapes: dict | None = None) -> dict:
    """A one-layer llama GGUF (hidden 256: whole 256-element blocks) with F32 tensors but ``ffn_up`` of
    ``ffn_up_type``; ``shapes`` replaces or adds tensors' shapes. Returns what was stored per tensor name."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    for key, value in (meta or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_float32(key, value)
    stored = {}
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_v.weight": (HIDDEN, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
              "blk.0.ffn_gate.weight": (FF, HIDDEN), "blk.0.ffn_up.weight": (FF, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FF), **(shapes or {})}
    for name, shape in shapes.items():
        t = ffn_up_type if name == "blk.0.ffn_up.weight" else Q.F32
        data = _stored(t, int(np.prod(shape[:-1])), shape[-1], rng)
        stored[name] = (t, data.reshape(*shape[:-1], -1))
        _add(w, name, t, stored[name][1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


# ---------------------------------------------------------------------------
# Types
# ---------------------------------------------------------------------------


def test_every_dequantizable_type_loads_as_gguf_dequantizes_it(tmp_path):
    """One tensor per type (3 rows of 512 elements, through the loader's own iterator): equal, NaN for NaN,
    to ``gguf.quants.dequantize`` of its bytes; F32/F16/BF16 keep their dtype and values."""
    import torch

    from kvforge.weights.gguf_loader import iterate_gguf

    rng = np.random.default_rng(1)
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    stored = {}
    for i, t in enumerate(DEQUANTIZABLE):
        stored[i] = (t, _stored(t, 3, 512, rng))
        _add(w, f"blk.{i}.ffn_up.weight", t, stored[i][1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    with np.errstate(all="ignore"):  # random blocks hold some inf/NaN scales
        got = dict(iterate_gguf(str(path), config={"num_attention_heads": 1}, progress=False))
        assert len(got) == len(DEQUANTIZABLE) >= 25
        for i, (t, data) in stored.items():
            tensor = got[f"model.layers.{i}.mlp.up_proj.weight"]
            assert tuple(tensor.shape) == (3, 512), t.name
            if t == Q.BF16:
                assert tensor.dtype == torch.bfloat16
            want = data if t in (Q.F32, Q.F16) else gguf.quants.dequantize(data, t)
            assert np.array_equal(tensor.float().numpy(), want.astype(np.float32), equal_nan=True), t.name


@pytest.mark.parametrize("qtype", NOT_DEQUANTIZABLE, ids=lambda t: t.name)
def test_a_type_the_loader_cannot_read_is_refused_with_the_config(tmp_path, qtype):
    """The plan's config read names the tensor, its type, the types that are read and the fix; the model is
    never built."""
    from kvforge.spec.load import load_model_spec
    from kvforge.weights import load_config

    path = tmp_path / "m.gguf"
    _write_llama(path, ffn_up_type=qtype)
    for read in (load_config, lambda p: load_model_spec(str(p))):
        with pytest.raises(ConfigError) as info:
            read(path)
        msg = str(info.value)
        assert f"tensor blk.0.ffn_up.weight of ggml type {qtype.name}" in msg
        assert "cannot dequantize" in msg and "Q4_K" in msg and "; fix: convert" in msg


def test_the_same_file_with_a_readable_type_loads(tmp_path):
    from kvforge.weights import load_config

    path = tmp_path / "m.gguf"
    _write_llama(path, ffn_up_type=Q.Q8_0)
    assert load_config(path)["hidden_size"] == HIDDEN


# ---------------------------------------------------------------------------
# Damaged files and bad paths
# ---------------------------------------------------------------------------


def _header_size(path) -> int:
    from kvforge.weights.gguf_config import GGUFHeader

    return min(t.offset for t in GGUFHeader(str(path)).tensors.values())


def test_a_header_cut_short_is_one_clear_error(tmp_path):
    """A file that ends inside its magic-and-counts, its metadata or its tensor directory: 'is truncated'."""
    from kvforge.weights.gguf_config import GGUFHeader

    path = tmp_path / "m.gguf"
    _write_llama(path)
    data = path.read_bytes()
    end = _header_size(path)
    cut = tmp_path / "cut.gguf"
    for n in (5, 8, 20, 30, end // 3, end // 2, end - 40):  # the directory ends before the padding to 32
        cut.write_bytes(data[:n])
        with pytest.raises(ConfigError, match=rf"cut\.gguf is truncated: its header .* more than {n} bytes"):
            GGUFHeader(str(cut))


def test_rows_that_are_not_whole_blocks_are_refused_by_the_header(tmp_path):
    """A Q4_0 tensor whose rows (48 elements) are not whole 32-element blocks, though its 96 elements are."""
    import struct

    from kvforge.weights.gguf_config import GGUFHeader

    path = tmp_path / "rows.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(np.ones((3, 32), np.float32), Q.Q4_0),
                 raw_dtype=Q.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(path.read_bytes())
    at = data.index(b"blk.0.ffn_up.weight") + len("blk.0.ffn_up.weight")
    assert struct.unpack_from("<IQQ", data, at) == (2, 32, 3)
    struct.pack_into("<QQ", data, at + 4, 48, 2)
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"blk\.0\.ffn_up\.weight has rows of 48 elements, not a whole number"):
        GGUFHeader(str(path))


def test_a_missing_path_or_a_directory_is_a_config_error(tmp_path):
    from kvforge.weights.gguf_config import GGUFHeader

    (tmp_path / "dir.gguf").mkdir()
    for name in ("missing.gguf", "dir.gguf"):
        with pytest.raises(ConfigError, match=rf"cannot read GGUF file .*{name}"):
            GGUFHeader(str(tmp_path / name))


@pytest.mark.parametrize("command", ["generate", "plan"])
def test_cli_reports_bad_gguf_files_in_one_line(tmp_path, capsys, command):
    """``kvforge generate|plan FILE``: a missing .gguf, a header cut short and an unreadable tensor type each
    end in ``error: ...`` and exit status 2."""
    from kvforge.cli import main

    whole = tmp_path / "whole.gguf"
    _write_llama(whole, ffn_up_type=Q.Q8_1)
    (tmp_path / "cut.gguf").write_bytes(whole.read_bytes()[:100])
    cases = {"missing.gguf": "missing.gguf", "cut.gguf": "is truncated", "whole.gguf": "of ggml type Q8_1"}
    for name, expected in cases.items():
        argv = [command, str(tmp_path / name)] + (["--prompt", "hi", "--device", "cpu"] if command == "generate"
                                                  else [])
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("error: ") and expected in err and "Traceback" not in err, err


# ---------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------


def test_unknown_rope_scaling_type_is_refused(tmp_path):
    from kvforge.weights import load_config

    path = tmp_path / "m.gguf"
    _write_llama(path, meta={"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(ConfigError, match=r"llama\.rope\.scaling\.type 'longrope' is not supported"):
        load_config(path)
    _write_llama(path, meta={"llama.rope.scaling.type": "none"})
    assert "rope_scaling" not in load_config(path)


def _write_gemma3_header(path, pattern) -> None:
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in (("context_length", 1024), ("embedding_length", 256), ("block_count", 7),
                       ("feed_forward_length", 512), ("attention.head_count", 1), ("attention.head_count_kv", 1),
                       ("attention.key_length", 256), ("attention.sliding_window", 64), ("vocab_size", 256)):
        w.add_uint32(f"gemma3.{key}", value)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(("pattern", "full"), [(None, [5]), (3, [2, 5]), (1, list(range(7))), (0, []),
                                               ([True, False] * 3 + [True], [1, 3, 5])])
def test_gemma3_sliding_window_pattern(tmp_path, pattern, full):
    """llama.cpp's reading: n means every n-th layer is full (6 without the key), 0 that every layer slides; a
    list holds one bool per layer, true for sliding."""
    from kvforge.weights import load_config

    path = tmp_path / "g.gguf"
    _write_gemma3_header(path, pattern)
    types = load_config(path)["layer_types"]
    assert [i for i, t in enumerate(types) if t == "full_attention"] == full
    assert len(types) == 7


def test_a_gguf_file_is_recognised_whatever_its_name(tmp_path):
    """The model argument is a GGUF file by its magic (a file without the .gguf suffix); a binary file that
    is neither GGUF nor JSON is one clear error."""
    from kvforge.spec.load import load_model_spec

    path = tmp_path / "model-blob"
    _write_llama(path)
    assert load_model_spec(str(path)).hf_config["hidden_size"] == HIDDEN
    other = tmp_path / "weights.bin"
    other.write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(ConfigError, match=r"weights\.bin is neither a GGUF file nor a JSON config"):
        load_model_spec(str(other))


def test_a_part_of_a_split_gguf_is_refused_with_the_fix(tmp_path):
    """gguf-split parts (``split.count`` > 1) each hold some tensors: the first part's directory lacks
    ``output.weight`` of an untied model, so reading it alone would tie the embeddings. Each part is refused."""
    from kvforge.weights import load_config

    try:
        w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama", split_max_tensors=2)
    except TypeError:
        pytest.skip("this gguf package writes no split files")
    w.add_block_count(1)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(4)
    for name, shape in (("token_embd.weight", (VOCAB, HIDDEN)), ("output_norm.weight", (HIDDEN,)),
                        ("output.weight", (VOCAB, HIDDEN))):
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) == 2
    for i, part in enumerate(parts):
        with pytest.raises(ConfigError, match=rf"is part {i + 1} of a GGUF split into 2 files.*llama-gguf-split --merge"):
            load_config(part)


def test_a_gguf_without_a_tokenizer_runs_on_token_ids(tmp_path):
    """Like a model directory without tokenizer files: token-id prompts run, a text prompt is refused with the
    fixes (a tokenizer through --tokenizer, or ids)."""
    from kvforge import LLM, SamplingParams
    from kvforge.errors import InvalidRequestError

    path = tmp_path / "m.gguf"
    _write_llama(path)
    with LLM(str(path), device="cpu", max_model_len=64, kv_cache_memory=1 << 20, use_tqdm=False) as llm:
        assert llm.engine.tokenizer is None
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0.0, max_tokens=2))[0]
        assert len(out.outputs[0].token_ids) == 2
        with pytest.raises(InvalidRequestError, match="no tokenizer.*--tokenizer.*prompt_token_ids"):
            llm.generate("hello", SamplingParams(max_tokens=2))


@pytest.mark.parametrize("alignment", [0, 24])
def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path, alignment):
    from kvforge.weights import load_config

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("general.alignment", alignment)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=f"general.alignment is {alignment}, not a power of two"):
        load_config(path)


def test_a_missing_norm_epsilon_is_refused(tmp_path):
    """llama.cpp requires the RMS-norm epsilon; a default would be wrong for some families (Gemma's is 1e-6)."""
    from kvforge.weights import load_config

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(4)
    w.add_vocab_size(VOCAB)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"lacks llama\.attention\.layer_norm_rms_epsilon"):
        load_config(path)


@pytest.mark.parametrize("shapes, message", [
    ({"blk.0.attn_k.weight": (HIDDEN // 2, HIDDEN)},
     r"blk\.0\.attn_k\.weight has shape \[128, 256\] where \[256, 256\] was expected"),
    ({"token_embd.weight": (VOCAB + 8, HIDDEN)}, r"token_embd\.weight has shape \[40, 256\] where \[32, 256\]"),
    ({"blk.0.ffn_down.weight": (HIDDEN, 2 * FF)}, r"ffn_down\.weight has shape \[256, 512\]"),
    ({"blk.1.attn_q.weight": (HIDDEN, HIDDEN)}, r"blk\.1\.attn_q\.weight is of layer 1, past the 1 layers"),
])
def test_tensors_that_contradict_the_metadata_are_refused_before_the_model_is_built(tmp_path, shapes, message):
    """llama.cpp requires every tensor's shape to be the metadata's; so does kvforge, from the header alone,
    so that such a file fails before any model or KV cache exists (it used to fail inside the load)."""
    from kvforge import LLM
    from kvforge.weights import load_config

    path = tmp_path / "m.gguf"
    _write_llama(path, shapes=shapes)
    with pytest.raises(ConfigError, match=message + r".*metadata gives hidden 256, 4 heads and 4 KV heads of 64"):
        load_config(path)
    with pytest.raises(ConfigError, match=message):
        LLM(str(path), device="cpu", skip_tokenizer_init=True)

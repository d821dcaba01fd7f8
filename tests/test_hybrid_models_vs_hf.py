"""Gemma 3 and gpt-oss vs transformers on tiny random checkpoints (float32, CPU).

Each config is built in transformers with a fixed seed, random (non-default)
norm weights, biases and sinks, saved with ``save_pretrained`` (safetensors)
and loaded with our loader. Our model runs over a paged cache with the
reference attention (tests/paged_reference.py: sliding windows and sinks from
the model), on prompts 3-4x the 16-token window so the window cuts: two
prompts prefilled together, then decode steps; and the same prompts prefilled
in chunks that straddle the window edge. Every logit row is compared with the
transformers forward of the whole sequence: max |ours - hf| <= 1e-4 * max(1,
max |hf|).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_reference import PagedReferenceAttention, run_steps  # noqa: E402
from tiny_checkpoints import HYBRID_CASES as CASES  # noqa: E402
from tiny_checkpoints import VOCAB, WINDOW, load_ours, make_checkpoint  # noqa: E402

from kvforge.errors import ConfigError  # noqa: E402
from kvforge.models.registry import build_model  # noqa: E402
from kvforge.spec.architectures import spec_from_hf_config  # noqa: E402
from kvforge.weights import load_config, load_weights  # noqa: E402

REL_TOL = 1e-4
PROMPT_LENS = (57, 44)  # 3.5x and 2.75x the window
DECODE_STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sequences(n_extra: int):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n + n_extra,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_logits(hf, seqs):
    with torch.no_grad():
        return [hf(input_ids=torch.tensor([s])).logits[0].float() for s in seqs]


def _worst(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_logits_match_transformers(case, tmp_path):
    hf, _ = make_checkpoint(case, tmp_path)
    ours = load_ours(tmp_path)
    assert [ours.sliding_window(i) for i in range(4)] == (
        [WINDOW, WINDOW, None, WINDOW] if case == "gemma3" else [WINDOW, None, WINDOW, None])
    seqs = _sequences(DECODE_STEPS)
    ref = _hf_logits(hf, seqs)
    p0, p1 = PROMPT_LENS
    steps = [[(0, seqs[0][:p0]), (1, seqs[1][:p1])]]
    steps += [[(0, [seqs[0][p0 + j]]), (1, [seqs[1][p1 + j]])] for j in range(DECODE_STEPS)]
    got = run_steps(ours, PagedReferenceAttention(ours), steps)
    worst = max(_worst(got[0][:p0], ref[0][:p0]), _worst(got[0][p0:], ref[1][:p1]))
    for j in range(DECODE_STEPS):
        worst = max(worst, _worst(got[j + 1][0], ref[0][p0 + j]), _worst(got[j + 1][1], ref[1][p1 + j]))
    assert worst <= REL_TOL, f"{case}: relative max error {worst:.3g}"
    assert float(ref[0].abs().max()) > 0.5  # the logits are not trivially small


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_across_the_window_edge(case, tmp_path):
    hf, _ = make_checkpoint(case, tmp_path)
    ours = load_ours(tmp_path)
    seq = _sequences(0)[0]
    ref = _hf_logits(hf, [seq])[0]
    cuts = [0, 13, 17, 31, 50, len(seq)]  # chunks end at 13 < 16 < 17, 31 < 32, ...
    steps = [[(0, seq[a:b])] for a, b in zip(cuts, cuts[1:])]
    got = torch.cat(run_steps(ours, PagedReferenceAttention(ours, block_size=4), steps))
    assert _worst(got, ref) <= REL_TOL


def test_sinks_matter_and_window_matters(tmp_path):
    """The comparison above would fail without sinks or without the window (so it tests both)."""
    hf, _ = make_checkpoint("gpt-oss", tmp_path)
    ours = load_ours(tmp_path)
    seq = _sequences(0)[0]
    ref = _hf_logits(hf, [seq])[0]
    no_sinks = PagedReferenceAttention(ours)
    no_sinks.model = SimpleNamespace(softmax_scale=ours.softmax_scale, sliding_window=ours.sliding_window)
    got = run_steps(ours, no_sinks, [[(0, seq)]])[0]
    assert _worst(got, ref) > 1e-2
    no_window = PagedReferenceAttention(ours)
    no_window.model = SimpleNamespace(softmax_scale=ours.softmax_scale, sliding_window=lambda i: None,
                                      attention_sinks=ours.attention_sinks)
    got = run_steps(ours, no_window, [[(0, seq)]])[0]
    assert _worst(got, ref) > 1e-2


def test_spec_and_model_agree_on_layers(tmp_path):
    for case in CASES:
        _, cfg = make_checkpoint(case, tmp_path / case)
        spec = spec_from_hf_config(cfg, name=case, source="test")
        ours = build_model(cfg, torch.float32, "meta")
        assert [layer.sliding_window for layer in spec.layers] == [ours.sliding_window(i) for i in range(4)]
        assert all(layer.sinks == (case == "gpt-oss") for layer in spec.layers)


def test_gpt_oss_checkpoint_without_sinks_is_one_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    make_checkpoint("gpt-oss", tmp_path)
    (f,) = tmp_path.glob("*.safetensors")
    tensors = {k: v for k, v in load_file(f).items() if not k.endswith("self_attn.sinks")}
    save_file(tensors, f, metadata={"format": "pt"})
    ours = build_model(load_config(tmp_path), torch.float32, "cpu")
    with pytest.raises(ConfigError, match="no attention sinks .* for 4 of 4 layers"):
        load_weights(ours, tmp_path, "auto", progress=False)


def test_gemma3_attention_softcapping_refused_before_weights(tmp_path):
    _, cfg = make_checkpoint("gemma3", tmp_path)
    cfg["attn_logit_softcapping"] = 50.0
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        build_model(cfg, torch.float32, "meta")


def test_multimodal_gemma3_checkpoint_runs_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint: the plan and the model use text_config, the
    language-model tensors load by their text names, vision tensors are skipped; text-only logits
    equal the multimodal transformers model's."""
    from tiny_checkpoints import GEMMA3

    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    # Released Gemma 3 checkpoints have no final soft-capping (and transformers' multimodal class would not
    # apply it); it is tested on the text model above.
    text = transformers.Gemma3TextConfig(**{**GEMMA3, "final_logit_softcapping": None})
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(4)
    hf = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((0.2 if "norm" in name else 0.08) * torch.randn_like(p))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = load_config(tmp_path)
    assert cfg["architectures"] == ["Gemma3ForConditionalGeneration"]
    spec = spec_from_hf_config(cfg, name="mm", source="test")
    assert spec.architecture == "Gemma3ForCausalLM"
    assert [layer.sliding_window for layer in spec.layers] == [WINDOW, WINDOW, None, WINDOW]
    ours = build_model(cfg, torch.float32, "cpu")
    load_weights(ours, tmp_path, "auto", progress=False)
    seq = _sequences(0)[0]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([seq])).logits[0].float()
    got = run_steps(ours, PagedReferenceAttention(ours), [[(0, seq[:30])], [(0, seq[30:])]])
    assert _worst(torch.cat(got), ref) <= REL_TOL


def test_gpt_oss_grouped_experts_match_transformers(tmp_path, monkeypatch):
    """The capturable grouped-GEMM experts path (CUDA; run here on CPU, where torch._grouped_mm works)
    gives transformers' logits too, and so does an expert share with other ranks' slots zeroed."""
    from kvforge.models.gpt_oss import GptOssExperts
    from kvforge.models.grouped_mm import grouped_mm_problem

    if grouped_mm_problem("cpu", torch.float32):
        pytest.skip(f"torch._grouped_mm unusable on CPU: {grouped_mm_problem('cpu', torch.float32)}")
    hf, _ = make_checkpoint("gpt-oss", tmp_path)
    ours = load_ours(tmp_path)
    monkeypatch.setattr(GptOssExperts, "forward", GptOssExperts.grouped)
    seq = _sequences(0)[0]
    ref = _hf_logits(hf, [seq])[0]
    got = run_steps(ours, PagedReferenceAttention(ours), [[(0, seq[:30])], [(0, seq[30:])]])
    assert _worst(torch.cat(got), ref) <= REL_TOL
    # Two halves of the experts (as two ranks hold them) add up to all of them.
    full = ours.model.layers[0].mlp.experts
    x = torch.randn(9, full.gate_up_proj.shape[1], generator=torch.Generator().manual_seed(2))
    weights, ids = ours.model.layers[0].mlp.router(x)
    halves = []
    for first in (0, 3):
        part = GptOssExperts(ours.args, num_local=3, first=first)
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            getattr(part, name).data.copy_(getattr(full, name).data[first:first + 3])
        halves.append(part.grouped(x, weights, ids))
    want = full.loop(x, weights, ids)
    assert (halves[0] + halves[1] - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())

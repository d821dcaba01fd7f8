"""Qwen3-Next and Kimi-Linear vs transformers on tiny random checkpoints (float32, CPU).

Each config (tests/tiny_checkpoints.py) is built in transformers with a fixed seed, random
(non-default) weights (norms around their neutral value, conv kernels, router biases), saved with
``save_pretrained`` (safetensors) and loaded with our loader. transformers' torch fallbacks are the reference (no
fla / causal-conv1d kernels are installed). Our model runs over a test-built state: a paged cache
for full attention, a latent cache for MLA and one state slot per sequence for the linear layers
(tests/state_slot_reference.py), with the PyTorch delta rule.

Checks: the linear-attention layers alone against transformers' layers (same weights, a prompt
then a continuation with transformers' cache); two prompts of different lengths prefilled together
then decoded together, each logit row against transformers' forward of the whole sequence; one
prompt prefilled in chunks across steps (so states are carried through slots); greedy tokens of
a batch of prompts of different lengths against transformers' ``generate`` (near-tie rule of
tests/greedy_agreement.py); a preempted sequence recomputed in a reused slot. Bound:
max |ours - hf| <= 1e-4 * max(1, max |hf|) (float32 on both sides; the delta rule's chunked and
recurrent forms differ from transformers' only in summation order, tests/test_gated_delta_rule.py).
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from linear_attention_setup import one_torch_thread  # noqa: F401 (autouse fixture)

transformers = pytest.importorskip("transformers")

from greedy_agreement import assert_greedy_agrees, top2_margins  # noqa: E402
from paged_reference import run_steps  # noqa: E402
from state_slot_reference import StateSlotAttention  # noqa: E402
from tiny_checkpoints import CASES as CHECKPOINTS  # noqa: E402
from tiny_checkpoints import LINEAR_ATTENTION_CASES as CASES  # noqa: E402
from tiny_checkpoints import LINEAR_VOCAB as VOCAB  # noqa: E402
from tiny_checkpoints import load_ours, make_checkpoint  # noqa: E402

from kvforge.errors import ConfigError  # noqa: E402

REL_TOL = 1e-4
PROMPT_LENS = (70, 23)  # the first is longer than one 64-token chunk of the reference
DECODE_STEPS = 4


def _sequences(n_extra: int):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n + n_extra,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_logits(hf, seqs):
    with torch.no_grad():
        return [hf(input_ids=torch.tensor([s])).logits[0].float() for s in seqs]


def _worst(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_logits_match_transformers(case, tmp_path):
    _check_prefill_and_decode(case, tmp_path)


@pytest.mark.parametrize("case", list(CASES))
def test_fused_kernels_match_transformers(case, tmp_path, monkeypatch):
    """The fused kernels in Triton's interpreter: the gated norm and the delta-rule gates of every linear
    layer, the norms, rope and SiLU, and the routers (Kimi-Linear's grouped sigmoid: 4 groups, 2 kept, a
    correction bias; Qwen3-Next's softmax top-k). Kimi's prompt steps take the logits product and the choice
    kernel, its two-token decode steps the one-launch kernel. The logits stay within the bound above."""
    device = pytest.importorskip("triton_kernel_device")
    if not device.INTERPRETED:
        pytest.skip("the model runs on CPU here: kernels run on CPU tensors only in Triton's interpreter")
    from kvforge.kernels import (
        triton_delta_gates,
        triton_gated_rms_norm,
        triton_router_logits_topk,
        triton_router_topk,
    )
    from kvforge.models import layers, router_topk

    calls = dict.fromkeys(["gated norm", "gates", "choice", "one launch"], 0)

    def count(module, name, key):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    monkeypatch.setattr(router_topk, "TRITON_ROUTER", True)
    monkeypatch.setattr(router_topk, "TRITON_ROUTER_DEVICES", ("cpu",))
    monkeypatch.setattr(layers, "FUSED_KERNELS", True)
    monkeypatch.setattr(layers, "FUSED_DEVICES", ("cpu",))
    count(triton_gated_rms_norm, "gated_rms_norm", "gated norm")
    count(triton_delta_gates, "delta_gates", "gates")
    count(triton_router_topk, "router_topk", "choice")
    count(triton_router_logits_topk, "router_logits_topk", "one launch")
    with torch.no_grad():  # the kernels serve inference only
        _check_prefill_and_decode(case, tmp_path)
    steps = 1 + DECODE_STEPS
    linear_layers = 3  # tests/tiny_checkpoints.py: three linear-attention layers in both
    assert calls["gated norm"] == calls["gates"] == linear_layers * steps
    if case == "kimi-linear":  # two sparse layers: the choice kernel in the prompt step, one launch after
        assert (calls["choice"], calls["one launch"]) == (2, 2 * DECODE_STEPS)
    else:  # three MoE layers (mlp_only_layers=[1]), logits from the gate's product
        assert (calls["choice"], calls["one launch"]) == (3 * steps, 0)


def _check_prefill_and_decode(case, tmp_path):
    hf, _ = make_checkpoint(case, tmp_path)
    ours = load_ours(tmp_path)
    seqs = _sequences(DECODE_STEPS)
    ref = _hf_logits(hf, seqs)
    p0, p1 = PROMPT_LENS
    steps = [[(0, seqs[0][:p0]), (1, seqs[1][:p1])]]
    steps += [[(0, [seqs[0][p0 + j]]), (1, [seqs[1][p1 + j]])] for j in range(DECODE_STEPS)]
    got = run_steps(ours, StateSlotAttention(ours), steps)
    worst = max(_worst(got[0][:p0], ref[0][:p0]), _worst(got[0][p0:], ref[1][:p1]))
    for j in range(DECODE_STEPS):
        worst = max(worst, _worst(got[j + 1][0], ref[0][p0 + j]), _worst(got[j + 1][1], ref[1][p1 + j]))
    assert worst <= REL_TOL, f"{case}: relative max error {worst:.3g}"
    assert float(ref[0].abs().max()) > 0.5  # the logits are not trivially small


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # transformers' empty experts
@pytest.mark.parametrize("overrides", [{"tie_word_embeddings": True}, {"num_shared_experts": 0}])
def test_kimi_linear_config_edges_load_as_transformers_builds_them(overrides, tmp_path):
    """transformers never ties Kimi-Linear's LM head to the embedding (its save_pretrained writes lm_head.weight
    even where the config says tie_word_embeddings): the head loaded is the checkpoint's. Without shared
    experts it saves their zero-width tensors, which hold nothing to load. The logits match either way."""
    hf, config = make_checkpoint("kimi-linear", tmp_path, **overrides)
    if "tie_word_embeddings" in overrides:
        assert config["tie_word_embeddings"] is True
        assert not torch.equal(hf.lm_head.weight, hf.get_input_embeddings().weight)  # two weights in the reference
    ours = load_ours(tmp_path)
    seq = _sequences(0)[1]
    got = torch.cat(run_steps(ours, StateSlotAttention(ours), [[(0, seq)]]))
    assert _worst(got, _hf_logits(hf, [seq])[0]) <= REL_TOL


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_carries_the_state_across_steps(case, tmp_path):
    hf, _ = make_checkpoint(case, tmp_path)
    ours = load_ours(tmp_path)
    seq = _sequences(0)[0]
    ref = _hf_logits(hf, [seq])[0]
    cuts = [0, 1, 3, 30, 31, 69, len(seq)]  # pieces shorter than the conv kernel, single tokens, long ones
    steps = [[(0, seq[a:b])] for a, b in zip(cuts, cuts[1:])]
    got = torch.cat(run_steps(ours, StateSlotAttention(ours, block_size=4), steps))
    assert _worst(got, ref) <= REL_TOL


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_batch_of_different_lengths_equals_transformers_generate(case, tmp_path):
    hf, _ = make_checkpoint(case, tmp_path)
    ours = load_ours(tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 19, 1)]
    new = 6
    want, margins, tols = [], [], []
    for p in prompts:
        with torch.no_grad():
            run = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        logits = torch.cat(run.logits)
        want.append(run.sequences[0, len(p):].tolist())
        margins.append(top2_margins(logits))
        tols.append(REL_TOL * max(1.0, logits.abs().max().item()))
    attn = StateSlotAttention(ours)
    got = [[] for _ in prompts]
    feed = {i: p for i, p in enumerate(prompts)}
    with torch.no_grad():
        for _ in range(new):
            ids = [t for i in feed for t in feed[i]]
            pos = attn.step(list(feed), [len(feed[i]) for i in feed])
            logits = ours.compute_logits(ours(torch.tensor(ids), pos, attn))
            ends = torch.tensor([len(f) for f in feed.values()]).cumsum(0) - 1
            for i, tok in zip(list(feed), logits[ends].argmax(-1).tolist()):
                got[i].append(tok)
                feed[i] = [tok]
    for i in range(len(prompts)):  # near-tie rule (tests/greedy_agreement.py) at this file's logit tolerance
        assert_greedy_agrees(got[i], want[i], margins[i], tols[i], what=f"prompt {i}")


@pytest.mark.parametrize("case", list(CASES))
def test_linear_attention_layer_matches_transformers_layer_with_its_cache(case, tmp_path):
    """One linear layer with transformers' weights: a prompt, then a continuation through both caches."""
    hf, config = make_checkpoint(case, tmp_path)
    ours = load_ours(tmp_path)
    hf_layer = hf.model.layers[0]
    hf_mixer = hf_layer.linear_attn if case == "qwen3-next" else hf_layer.self_attn
    our_layer = ours.model.layers[0]
    our_mixer = our_layer.linear_attn if case == "qwen3-next" else our_layer.self_attn
    cache = transformers.DynamicCache(config=hf.config)
    attn = StateSlotAttention(ours)
    x = 0.5 * torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(0))
    # transformers 5.x releases name the mixer's cache argument differently; the forward swallows unknown
    # keywords (**kwargs), so a wrong name would silently run without the cache.
    params = inspect.signature(type(hf_mixer).forward).parameters
    cache_arg = next((n for n in ("cache", "cache_params", "past_key_values") if n in params), None)
    assert cache_arg is not None, f"{type(hf_mixer).__name__}.forward takes no cache argument: {list(params)}"
    with torch.no_grad():
        for a, b in [(0, 9), (9, 10), (10, 12)]:
            want = hf_mixer(x[:, a:b], **{cache_arg: cache})
            attn.step([0], [b - a])
            got = (our_mixer(x[0, a:b], attn) if case == "qwen3-next"
                   else our_mixer(None, x[0, a:b], attn, None))
            assert _worst(got, want[0]) <= REL_TOL, (a, b)


def test_missing_conv_weight_names_the_tensor(tmp_path):
    make_checkpoint("qwen3-next", tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.linear_attn.conv1d.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"lacks 1 tensor.*model\.layers\.0\.linear_attn\.conv1d\.weight"):
        load_ours(tmp_path)


def test_a_short_input_projection_names_the_tensor_and_both_shapes(tmp_path):
    """The two input projections are regrouped into one stacked product at load; a truncated one is named
    with its shape and the model's before any regrouping."""
    make_checkpoint("qwen3-next", tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    rows, hidden = tensors[name].shape
    tensors[name] = tensors[name][:-4].clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"{name}: checkpoint shape \({rows - 4}, {hidden}\) != model shape "
                                          rf"\({rows}, {hidden}\)"):
        load_ours(tmp_path)


def test_an_input_projection_on_a_full_attention_layer_has_no_place(tmp_path):
    make_checkpoint("qwen3-next", tmp_path)
    from safetensors.torch import load_file, save_file

    full = load_ours(tmp_path).args.layer_types.index("full_attention")
    tensors = load_file(tmp_path / "model.safetensors")
    stray = f"model.layers.{full}.linear_attn.in_proj_qkvz.weight"
    tensors[stray] = tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"].clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"have no place.*{stray}"):
        load_ours(tmp_path)


@pytest.mark.parametrize("case", list(CASES))
def test_state_layouts_and_layer_kinds_match_the_plan_spec(case, tmp_path):
    """Per linear layer, the model's state elements equal the planner's; MLA / attention layers sit where the
    spec puts its attention layers."""
    from kvforge.spec.architectures import spec_from_hf_config

    _, config = make_checkpoint(case, tmp_path)
    ours = load_ours(tmp_path)
    spec = spec_from_hf_config(config, name=case, source="test")
    state_layers = {x.index: x.state_elements for x in spec.layers if x.kind == "state"}
    assert state_layers == {i: lay.elements for i, lay in ours.linear_state_layouts().items()}
    attention_kind = {"qwen3-next": "full", "kimi-linear": "mla"}[case]
    want = ["state" if t == "linear_attention" else attention_kind for t in CHECKPOINTS[case][2]["layer_types"]]
    assert [x.kind for x in spec.layers] == want


@pytest.mark.parametrize("case", list(CASES))
def test_triton_kernels_in_the_model_match_transformers(case, tmp_path, monkeypatch):
    """The same model with its state operations on the Triton kernels (Triton's CPU interpreter here; the
    GPU covers them in tests/test_triton_gated_delta_rule.py): prefill of two prompts, then decode steps."""
    device = pytest.importorskip("triton_kernel_device")
    if not device.INTERPRETED:
        pytest.skip("the model runs on CPU here: kernels run on CPU tensors only in Triton's interpreter")
    device.skip_unless_loaded_loop_bounds_work()
    from kvforge.attention import linear_state

    monkeypatch.setattr(linear_state, "KERNEL_DEVICES", ("cuda", "cpu"))
    hf, _ = make_checkpoint(case, tmp_path)
    ours = load_ours(tmp_path)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, VOCAB, (n + 2,), generator=g).tolist() for n in (11, 4)]
    ref = _hf_logits(hf, seqs)
    steps = [[(0, seqs[0][:11]), (1, seqs[1][:4])]] + [[(0, [seqs[0][11 + j]]), (1, [seqs[1][4 + j]])] for j in range(2)]
    got = run_steps(ours, StateSlotAttention(ours), steps)
    worst = max(_worst(got[0][:11], ref[0][:11]), _worst(got[0][11:], ref[1][:4]))
    for j in range(2):
        worst = max(worst, _worst(got[j + 1][0], ref[0][11 + j]), _worst(got[j + 1][1], ref[1][4 + j]))
    assert worst <= REL_TOL, f"{case}: relative max error {worst:.3g}"


def test_partial_rotary_factor_of_rope_parameters_wins_over_a_top_level_one(tmp_path):
    """Some transformers versions write Qwen3-Next's class default ``partial_rotary_factor: 0.25`` at the top
    level of config.json next to the model's own value in ``rope_parameters`` (0.5 here), and rotate by the
    latter. Position 0 is the same under any factor (no rotation), so the logits after it are compared."""
    hf, saved = make_checkpoint("qwen3-next", tmp_path)
    assert saved["rope_parameters"]["partial_rotary_factor"] == 0.5
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**saved, "partial_rotary_factor": 0.25}, f)
    reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    seq = _sequences(0)[1][:12]
    ref = _hf_logits(reread, [seq])[0]
    assert torch.equal(ref, _hf_logits(hf, [seq])[0])  # transformers rotates by rope_parameters' factor
    ours = load_ours(tmp_path)
    assert ours.model.rotary.rotary_dim == ours.head_dim // 2
    got = run_steps(ours, StateSlotAttention(ours), [[(0, seq)]])[0]
    assert _worst(got, ref) <= REL_TOL


@pytest.mark.parametrize("case", list(CASES))
def test_a_preempted_sequence_recomputes_its_state_in_a_reused_slot(case, tmp_path):
    """Preemption drops a sequence's slot; its recompute (prompt + generated tokens as one new prefill) lands
    in a slot another sequence has just written, and must start from zeros, not from that slot."""
    hf, _ = make_checkpoint(case, tmp_path)
    ours = load_ours(tmp_path)
    a, b = _sequences(6)
    ref_a = _hf_logits(hf, [a[:30]])[0]
    attn = StateSlotAttention(ours, num_slots=2)
    run_steps(ours, attn, [[(0, a[:20]), (1, b[:10])], [(0, a[20:21]), (1, b[10:11])]])
    attn.preempt(0)  # preempted: its slot goes back, sequence 2 takes it and writes its state there
    run_steps(ours, attn, [[(2, b[:5]), (1, b[11:12])]])
    attn.preempt(2)
    got = run_steps(ours, attn, [[(0, a[:29]), (1, b[12:13])], [(0, a[29:30])]])
    assert _worst(got[0][:29], ref_a[:29]) <= REL_TOL and _worst(got[1][0], ref_a[29]) <= REL_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("paths", ["all-kernels", "state-ops-in-torch", "elementwise-in-torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_float32_logits_match_transformers(case, paths, tmp_path, monkeypatch):
    """On CUDA (the state operations on the Triton kernels, MoE as grouped GEMMs where they work): prefill of
    two prompts together, then decode steps, float32, against transformers' CPU forward. ``paths`` moves one
    group of kernels back to PyTorch on the same device (the state operations: conv1d and delta rule; the fused
    norm / rope / SiLU kernels), so a mismatch names the kernels that cause it."""
    from state_slot_reference import run_steps_on_device

    from kvforge.attention import linear_state
    from kvforge.models import layers

    if paths == "state-ops-in-torch":
        monkeypatch.setattr(linear_state, "KERNEL_DEVICES", ())
    elif paths == "elementwise-in-torch":
        monkeypatch.setattr(layers, "FUSED_KERNELS", False)

    hf, _ = make_checkpoint(case, tmp_path)
    ours = load_ours(tmp_path).to("cuda")
    seqs = _sequences(DECODE_STEPS)
    ref = _hf_logits(hf, seqs)
    p0, p1 = PROMPT_LENS
    steps = [[(0, seqs[0][:p0]), (1, seqs[1][:p1])]]
    steps += [[(0, [seqs[0][p0 + j]]), (1, [seqs[1][p1 + j]])] for j in range(DECODE_STEPS)]
    got = run_steps_on_device(ours, StateSlotAttention(ours, device="cuda"), steps)
    worst = max(_worst(got[0][:p0], ref[0][:p0]), _worst(got[0][p0:], ref[1][:p1]))
    for j in range(DECODE_STEPS):
        worst = max(worst, _worst(got[j + 1][0], ref[0][p0 + j]), _worst(got[j + 1][1], ref[1][p1 + j]))
    assert worst <= REL_TOL, f"{case}: relative max error {worst:.3g}"

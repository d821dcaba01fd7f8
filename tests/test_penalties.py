"""Repetition, presence and frequency penalties (kvforge/engine/penalties.py) against independent references:
transformers' ``RepetitionPenaltyLogitsProcessor`` and ``generate(repetition_penalty=...)``, and OpenAI's
presence/frequency formula written out per token in float64.

Exactness: rows without a penalty are copied, so they stay bitwise equal. Penalized rows are float32
arithmetic of the same operations as the references (one division or multiplication, then a subtraction
of float32 products), compared within 1e-6 relative. Engine runs whose batches differ (speculative
verification rows, async scheduling's extra rows) compare greedy tokens by the near-tie rule of
tests/greedy_agreement.py over the penalized logits' margins.
"""

from __future__ import annotations

import pytest
import torch
from greedy_agreement import FP32_LOGIT_TOL, assert_greedy_agrees, top2_margins
from test_verify_graphs import OracleProposer

from kvforge import LLM, SamplingParams
from kvforge.engine.penalties import apply_penalties
from kvforge.engine.sampler import Sampler
from kvforge.errors import InvalidRequestError

transformers = pytest.importorskip("transformers")

VOCAB = 256  # the oracle proposer of tests/test_verify_graphs.py proposes ids below 256


def reference(logits: torch.Tensor, params: list[SamplingParams], histories) -> torch.Tensor:
    """Per token, in float64: repetition over prompt and output, then OpenAI's presence/frequency."""
    out = logits.double().clone()
    for i, (p, (prompt, output)) in enumerate(zip(params, histories)):
        for t in range(out.shape[1]):
            c = output.count(t)
            if t in prompt or c:
                r = p.repetition_penalty
                out[i, t] = out[i, t] / r if out[i, t] > 0 else out[i, t] * r
            out[i, t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    return out


def _case(seed=0, rows=4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    histories = [(torch.randint(0, VOCAB, (int(n),), generator=g).tolist(),
                  torch.randint(0, VOCAB, (int(m),), generator=g).tolist())
                 for n, m in zip(torch.randint(1, 30, (rows,), generator=g), torch.randint(0, 40, (rows,), generator=g))]
    return logits, histories


def test_repetition_penalty_matches_transformers():
    logits, histories = _case()
    params = [SamplingParams(repetition_penalty=r) for r in (1.3, 0.7, 1.0, 2.0)]
    got = apply_penalties(logits, params, histories)
    for i, (p, (prompt, output)) in enumerate(zip(params, histories)):
        proc = transformers.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        want = proc(torch.tensor([prompt + output]), logits[i:i + 1].clone())[0]
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=0)


def test_presence_and_frequency_follow_openais_formula():
    logits, histories = _case(seed=1, rows=5)
    params = [SamplingParams(presence_penalty=0.5), SamplingParams(frequency_penalty=1.5),
              SamplingParams(presence_penalty=-1.0, frequency_penalty=0.25, repetition_penalty=1.2),
              SamplingParams(), SamplingParams(frequency_penalty=-2.0)]
    got = apply_penalties(logits, params, histories)
    torch.testing.assert_close(got.double(), reference(logits, params, histories), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3], logits[3])  # no penalty: the row is copied
    assert got.data_ptr() != logits.data_ptr()  # the input is left as it was


def test_no_penalty_returns_the_logits_themselves():
    logits, histories = _case(seed=2)
    assert apply_penalties(logits, [SamplingParams()] * 4, histories) is logits


def test_a_pending_token_counts_as_one_more_output_token():
    logits, histories = _case(seed=3)
    params = [SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5)] * 4
    pending = torch.tensor([5, -1, 7, 7])
    got = apply_penalties(logits, params, histories, pending)
    appended = [(p, o + ([int(t)] if t >= 0 else [])) for (p, o), t in zip(histories, pending)]
    torch.testing.assert_close(got, apply_penalties(logits, params, appended), rtol=0, atol=0)
    torch.testing.assert_close(got.double(), reference(logits, params, appended), rtol=1e-6, atol=1e-6)


def test_sampler_picks_from_penalized_logits_and_reports_raw_logprobs():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    params = [SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=1)]
    out = Sampler().sample(logits, params, histories=[([3], [0])])
    assert out.token_ids.tolist() == [1]  # 5 - 2 < 4
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert out.logprobs[0] == pytest.approx({0: raw[0].item(), 1: raw[1].item()}, rel=1e-6)
    with pytest.raises(ValueError, match="token ids"):
        Sampler().sample(logits, params)


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.01), ("frequency_penalty", -2.5),
                                          ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
                                          ("presence_penalty", True)])
def test_out_of_range_penalties_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field


# ---- the engine --------------------------------------------------------------------------------------

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5)
KW = dict(dtype="float32", block_size=4, skip_tokenizer_init=True, kv_cache_memory=1 << 22, progress=False,
          device="cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)).eval().float()
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


def _prompts(seed=4):
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    return [motif * 4, torch.randint(0, VOCAB, (17,), generator=g).tolist(), motif[:3] * 5]


def test_engine_repetition_penalty_matches_transformers_generate(tiny):
    path, hf = tiny
    llm = LLM(path, **KW)
    prompts = _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.4),
                        use_tqdm=False)
    for k, (p, out) in enumerate(zip(prompts, outs)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                              repetition_penalty=1.4, eos_token_id=None, pad_token_id=0, output_scores=True,
                              return_dict_in_generate=True)
        expect = ref.sequences[0, len(p):].tolist()
        assert_greedy_agrees(out.outputs[0].token_ids, expect, top2_margins(torch.cat(ref.scores)), 1e-4,
                             what=f"prompt {k}")
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in outs]  # it did something


def _penalized_margins(llm, prompt, tokens, params):
    """Top-2 margins of the penalized logits at each generated position (teacher-forced raw logits,
    penalized by the float64 reference)."""
    raw = llm.engine.compute_prompt_logits(prompt + tokens[:-1])[len(prompt) - 1:]
    hist = [(prompt, tokens[:j]) for j in range(len(tokens))]
    return top2_margins(reference(raw, [params] * len(tokens), hist))


PENALIZED = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=0.8,
                           presence_penalty=0.3, repetition_penalty=1.2)


@pytest.mark.parametrize("engine_kw", [dict(async_scheduling=True), dict(num_speculative_tokens=3)],
                         ids=["async", "speculative"])
def test_engine_modes_agree_with_the_synchronous_engine(tiny, engine_kw):
    """Overlapped scheduling samples before the previous token reaches the host (it must count it);
    speculative verification penalizes each row by the proposals before it (the proposer here offers the
    synchronous run's own tokens, one of them wrong every third step: acceptances and rejections). Both
    must produce the synchronous engine's greedy tokens."""
    path, _ = tiny
    sync = LLM(path, **KW)
    other = LLM(path, **KW, **engine_kw)
    prompts = _prompts()
    want = sync.generate([{"prompt_token_ids": p} for p in prompts], PENALIZED, use_tqdm=False)
    if "num_speculative_tokens" in engine_kw:
        other.engine.proposer = OracleProposer(3, {tuple(p): list(w.outputs[0].token_ids)
                                                   for p, w in zip(prompts, want)})
    got = other.generate([{"prompt_token_ids": p} for p in prompts], PENALIZED, use_tqdm=False)
    for k, (p, g, w) in enumerate(zip(prompts, got, want)):
        ref_tokens = list(w.outputs[0].token_ids)
        assert_greedy_agrees(list(g.outputs[0].token_ids), ref_tokens,
                             _penalized_margins(sync, p, ref_tokens, PENALIZED), FP32_LOGIT_TOL, what=f"prompt {k}")
    if "num_speculative_tokens" in engine_kw:
        assert other.engine.spec_counters.num_accepted_tokens > 0, "no proposal was accepted: the case tests nothing"


def test_sequence_token_arrays_follow_the_lists_as_they_grow():
    from kvforge.engine.sequence import Sequence

    seq = Sequence("r", [5, 6, 7])
    for round_size in (0, 1, 15, 1, 40, 3):
        for _ in range(round_size):
            seq.append_token(100 + len(seq.output_token_ids))
        prompt, output = seq.token_arrays()
        assert prompt.tolist() == [5, 6, 7] and output.tolist() == seq.output_token_ids
        assert output.dtype.name == "int64"

"""What the engine checks about speculation before any weight loads: the method against the model,
the proposal count against the plan and the step budget, and the scheduling mode.

Rollback of rejected tokens is exact for paged KV (full, sliding, MLA: positions past
``num_computed_tokens`` are simply rewritten later), for rings (the plan gives each ring one extra
row per speculative token, so the rows of rejected positions never overwrite a row still in use) and
for linear-attention state (a verifying sequence's slot keeps the state before the step, and the
accepted rows are replayed onto it from the verify rows the plan sizes; kvforge/attention/linear_state.py).
"""

from __future__ import annotations

from kvforge.errors import ConfigError
from kvforge.planner.kv_plan import KVPlan
from kvforge.spec.model_spec import ModelSpec
from kvforge.speculative.config import SpeculativeConfig
from kvforge.speculative.mtp_spec import check_mtp_target

#: Config keys of special tokens a draft must share with its target (where both configs name them).
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def check_speculative(config: SpeculativeConfig, spec: ModelSpec, plan: KVPlan, *, max_num_batched_tokens: int) -> None:
    """Raise ConfigError naming the problem and the fix when the engine cannot speculate as configured."""
    k = config.num_speculative_tokens
    if config.method == "mtp":
        check_mtp_target(spec)
        if plan.draft is None:
            raise ConfigError("--speculative-config method mtp needs a plan with the checkpoint's MTP layer "
                              "(resolve(..., proposer_layers=kvforge.speculative.mtp_spec.mtp_proposer_layers(spec))); "
                              "the engine plans it from the config")
    if config.method == "draft_model":
        if plan.draft is None:
            raise ConfigError("--speculative-config method draft_model needs a plan made with the draft model "
                              "(resolve(..., draft_spec=...)); the engine plans it from the config's \"model\"")
    if plan.num_speculative_tokens != k:
        raise ConfigError(f"the plan reserves room for {plan.num_speculative_tokens} speculative tokens but "
                          f"{k} are configured; plan with --num-speculative-tokens {k}")
    if k + 1 > max_num_batched_tokens:
        raise ConfigError(f"num_speculative_tokens {k} + 1 exceeds --max-num-batched-tokens "
                          f"{max_num_batched_tokens}: a decoding sequence could never verify all its proposals; "
                          f"lower num_speculative_tokens to at most {max_num_batched_tokens - 1}")
    if k + 2 > plan.max_model_len:
        raise ConfigError(f"num_speculative_tokens {k} leaves no room in max-model-len {plan.max_model_len} "
                          f"(a prompt token, {k} proposals and the next token must fit); lower it to at most "
                          f"{plan.max_model_len - 2}")


def check_draft_model(target: ModelSpec, draft: ModelSpec, max_model_len: int) -> None:
    """Raise ConfigError when ``draft`` cannot propose for ``target`` (checked from configs, before any weight):
    its vocabulary must be the target's (same size; the same special token ids where both configs name them),
    its KV must roll back (no linear-attention state, no rings: rejected proposals' state could not be
    undone), and its max_position_embeddings must cover ``max_model_len``."""
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"the draft model {draft.name} has a vocabulary of {draft.vocab_size} tokens but the target "
                          f"{target.name} has {target.vocab_size}: a draft must share the target's tokenizer; use a "
                          f"draft of the target's family")
    for key in SPECIAL_TOKEN_KEYS:
        mine, theirs = draft.hf_config.get(key), target.hf_config.get(key)
        if mine is not None and theirs is not None and mine != theirs:
            raise ConfigError(f"the draft model {draft.name} has {key} {mine} but the target {target.name} has "
                              f"{theirs}: a draft must share the target's tokenizer; use a draft of the target's "
                              f"family")
    kinds = {layer.kind for layer in draft.layers}
    if "state" in kinds or draft.rings:
        what = "linear-attention state" if "state" in kinds else "per-request rings"
        raise ConfigError(f"the draft model {draft.name} keeps {what}, which rejected proposals would overwrite "
                          f"without a way back; use a draft with full, sliding-window or MLA attention only")
    if draft.max_position_embeddings and draft.max_position_embeddings < max_model_len:
        raise ConfigError(f"the draft model {draft.name} has max_position_embeddings {draft.max_position_embeddings}, "
                          f"below --max-model-len {max_model_len}: it could not propose past that position; lower "
                          f"--max-model-len to {draft.max_position_embeddings} or use a draft with a longer context")

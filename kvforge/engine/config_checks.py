"""The engine's checks of its arguments against the model and its KV plan that need no weights, tokenizer or
device: the engine makes them before any weight loads, and ``kvforge plan`` makes the same ones, so a command
line that the plan takes passes them in ``serve`` and ``generate`` too. (Checks that read the model's files,
its tokenizer, chat template, reasoning parser or weights location, are the engine's alone.)"""

from __future__ import annotations

from kvforge.config import EngineArgs
from kvforge.errors import ConfigError
from kvforge.planner.kv_plan import KVPlan
from kvforge.spec.model_spec import ModelSpec
from kvforge.speculative.support import check_speculative


def engine_limitations(args: EngineArgs, spec: ModelSpec) -> list[str]:
    """What the engine does not run yet although the planner plans it (the engine refuses it; ``kvforge plan``
    plans it and warns)."""
    if spec.rings and args.tensor_parallel_size > 1:
        return ["per-request rings (CsaRingTest) are not supported with tensor parallelism yet; use "
                "--tensor-parallel-size 1 (`kvforge plan` shows the per-rank figures)"]
    return []


def check_engine_plan(args: EngineArgs, spec: ModelSpec, plan: KVPlan, platform: str,
                      limitations: bool = True) -> int:
    """ConfigError naming the fix where ``args`` cannot run ``plan`` of ``spec`` on ``platform`` (with
    ``limitations``, also where :func:`engine_limitations` names something); else the tokens one step may
    compute (without chunked prefill, at least the longest prompt, as vLLM takes it)."""
    if spec.rings and args.async_scheduling:
        raise ConfigError("--async-scheduling is not supported for ring (CsaRing) models: their per-request "
                          "state slots are bound to the synchronous step; drop --async-scheduling")
    found = engine_limitations(args, spec) if limitations else []
    if found:
        raise ConfigError(found[0])
    batched = args.step_token_budget(platform)
    if not args.enable_chunked_prefill and batched < plan.max_model_len:
        if args.max_num_batched_tokens is not None:
            raise ConfigError(
                f"--max-num-batched-tokens {batched} < max_model_len {plan.max_model_len} without chunked "
                "prefill: a prompt longer than one step could never be scheduled; raise "
                "--max-num-batched-tokens, lower --max-model-len or drop --no-enable-chunked-prefill")
        batched = plan.max_model_len  # as vLLM: without chunks a step must hold the longest prompt
    if args.speculative_config is not None:
        check_speculative(args.speculative_config, spec, plan, max_num_batched_tokens=batched)
    return batched

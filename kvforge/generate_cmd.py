"""``kvforge generate``: generate for prompts, optionally comparing two KV dtypes.

With ``--compare-kv-dtype D`` the same prompts are generated greedily a second
time with a KV cache of dtype D and the token agreement is reported (how many
leading tokens match, and the fraction of positions that agree).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


#: The sampling of ``kvforge generate`` where neither a flag nor the model's generation config sets a field.
SAMPLING_DEFAULTS = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "presence_penalty": 0.0,
                     "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def sampling_params(args: argparse.Namespace):
    """The flags the command line sets, over the model's generation config (``--generation-config``, read
    without loading weights), over :data:`SAMPLING_DEFAULTS`."""
    from kvforge.engine.generation_defaults import sampling_defaults
    from kvforge.engine.sampling_params import SamplingParams

    given = {name: getattr(args, name) for name in SAMPLING_DEFAULTS if getattr(args, name) is not None}
    values = {**SAMPLING_DEFAULTS, **sampling_defaults(args.generation_config, args.model), **given}
    return SamplingParams(**values, ignore_eos=args.ignore_eos, seed=args.seed)


def add_generate_args(p: argparse.ArgumentParser) -> None:
    from kvforge.config import EngineArgs

    EngineArgs.add_cli_args(p)
    add_generate_only_args(p)


def add_generate_only_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvforge generate`` beside the engine's: prompts and sampling."""
    p.add_argument("--prompt", action="append", default=None, help="prompt (repeat for several)")
    p.add_argument("--prompt-token-ids", action="append", default=None, type=token_ids, metavar="ID,ID,...",
                   help="a prompt as comma-separated token ids (repeat for several); for models without a "
                        "tokenizer, such as presets on dummy weights")
    p.add_argument("--chat", action="store_true",
                   help="apply the model's chat template (user turn); without --prompt, the default question "
                        "takes the template whenever the model has one")
    # Unset sampling flags take the model's generation config (--generation-config), else SAMPLING_DEFAULTS.
    p.add_argument("--max-tokens", type=int, default=None, help="default: max_new_tokens of the generation config, "
                                                               "else 64")
    p.add_argument("--temperature", type=float, default=None, help="default: the generation config's, else 0 (greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=None, help="in [-2, 2]; 0: off")
    p.add_argument("--frequency-penalty", type=float, default=None, help="in [-2, 2]; 0: off")
    p.add_argument("--repetition-penalty", type=float, default=None, help="> 0; 1: off")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--compare-kv-dtype", default=None,
                   help="also run greedy with this KV dtype (e.g. bf16) and report agreement")


def token_ids(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3] (non-negative integers, at least one)."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids") from None
    if any(t < 0 for t in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: token ids must be >= 0")
    return ids


def _prompts(args: argparse.Namespace) -> list:
    """Text prompts, or token-id prompts (checked against the model's vocabulary); refused before any weight
    loads when they cannot work."""
    from kvforge.errors import ConfigError
    from kvforge.spec.presets import PRESETS

    if args.prompt and args.prompt_token_ids:
        raise ConfigError("pass either --prompt or --prompt-token-ids, not both")
    if args.prompt_token_ids:
        if args.chat:
            raise ConfigError("--chat renders text messages; it cannot take --prompt-token-ids")
        from kvforge.engine.prompt_ids import check_prompt_token_ids
        from kvforge.errors import InvalidRequestError
        from kvforge.spec.load import load_model_spec

        vocab_size = load_model_spec(args.model).vocab_size  # config metadata only
        try:
            return [{"prompt_token_ids": check_prompt_token_ids(ids, vocab_size)} for ids in args.prompt_token_ids]
        except InvalidRequestError as exc:
            raise ConfigError(f"--prompt-token-ids: {exc}") from None
    is_preset = args.model is not None and not Path(args.model).exists() and args.model.lower() in PRESETS
    if args.tokenizer is None and (is_preset or args.skip_tokenizer_init):
        why = f"the preset {args.model!r} runs on dummy weights without a tokenizer" if is_preset else \
            "--skip-tokenizer-init leaves the engine without a tokenizer"
        raise ConfigError(f"{why}, so text prompts cannot be encoded; fix: pass --prompt-token-ids 1,2,3 "
                          f"(or --tokenizer DIR)")
    if args.prompt and not all(args.prompt):
        raise ConfigError("--prompt is empty; give it some text")
    return args.prompt or [DEFAULT_PROMPT]


def _check_prompt_lengths(args: argparse.Namespace, prompts: list) -> None:
    """Refuse a prompt the context cannot hold (the engine's own check, before any weight loads): text prompts
    outside --chat (a chat template adds tokens the engine counts itself) are encoded with the tokenizer the
    engine will load, token-id prompts counted. With ``--max-model-len auto`` the context is the length the
    engine's plan fits to the memory, planned here as the engine plans it."""
    from kvforge.config import EngineArgs
    from kvforge.errors import ConfigError
    from kvforge.planner.inputs import AUTO_MAX_MODEL_LEN
    from kvforge.planner.resolver import planned_max_model_len
    from kvforge.spec.load import load_model_spec

    texts = [p for p in prompts if isinstance(p, str)] if args.prompt and not args.chat else []
    if not texts and not args.prompt_token_ids:
        return
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.max_model_len == AUTO_MAX_MODEL_LEN:
        from kvforge.engine.engine_plan import pick_device, plan_engine

        limit = plan_engine(engine_args, pick_device(engine_args.device)).plan.max_model_len
    else:
        limit = planned_max_model_len(load_model_spec(args.model), engine_args.max_model_len)
    lengths = [len(p["prompt_token_ids"]) for p in prompts if isinstance(p, dict)]
    if texts:
        from kvforge.spec.embedded import embedded_model_path
        from kvforge.tokenizer import load_tokenizer

        source = args.tokenizer or args.model or embedded_model_path()
        tokenizer = load_tokenizer(source) if Path(source).exists() else None
        if tokenizer is not None:
            lengths += [len(tokenizer.encode(text)) for text in texts]
    if lengths and max(lengths) >= limit:
        fitted = engine_args.max_model_len == AUTO_MAX_MODEL_LEN
        raise ConfigError(f"a prompt has {max(lengths)} tokens but max-model-len is {limit}"
                          f"{' (--max-model-len auto: the longest the KV cache memory holds)' if fitted else ''} "
                          f"(prompt + at least one generated token must fit); shorten the prompt or "
                          f"{'give the KV cache more memory' if fitted else 'raise --max-model-len'}")


def _compare_kv_dtype(args: argparse.Namespace) -> str | None:
    """``--compare-kv-dtype`` as a canonical KV dtype name (None when not given), checked before any weight
    loads: the comparison engine is only built after the first run."""
    from kvforge.errors import ConfigError
    from kvforge.kv_dtypes import canonical_kv_dtype

    if args.compare_kv_dtype is None:
        return None
    try:
        return canonical_kv_dtype(args.compare_kv_dtype)
    except ConfigError as exc:
        raise ConfigError(f"--compare-kv-dtype: {exc}") from None


def _shown(prompt) -> str:
    return prompt if isinstance(prompt, str) else f"token ids {prompt['prompt_token_ids']}"


def agreement(a: list[int], b: list[int]) -> tuple[int, float]:
    """(length of the common prefix, fraction of aligned positions that are equal)."""
    prefix = 0
    for x, y in zip(a, b):
        if x != y:
            break
        prefix += 1
    n = max(len(a), len(b))
    same = sum(x == y for x, y in zip(a, b))
    return prefix, (same / n if n else 1.0)


def _run(llm, prompts, params, chat: bool):
    if chat:
        return llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    return llm.generate(prompts, params, use_tqdm=False)


def _has_chat_template(llm) -> bool:
    tokenizer = llm.engine.tokenizer
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def generate_main(args: argparse.Namespace) -> int:
    from kvforge.cli_args import model_argument
    from kvforge.config import EngineArgs
    from kvforge.llm import LLM

    args.model, args.model_flag = model_argument(args), None
    prompts = _prompts(args)
    _check_prompt_lengths(args, prompts)
    compare_kv_dtype = _compare_kv_dtype(args)
    if compare_kv_dtype is not None:  # the comparison is of greedy outputs: both runs pick the argmax
        if args.temperature:
            from kvforge.errors import ConfigError

            raise ConfigError(f"--compare-kv-dtype compares greedy outputs, but --temperature {args.temperature} "
                              f"samples; drop --temperature (the comparison runs greedy)")
        args.temperature = 0.0  # over a generation config's sampling temperature
    params = sampling_params(args)
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**{k: v for k, v in engine_args.__dict__.items()})  # the engine logs its plan
    t0 = time.perf_counter()
    # The default prompt is a question: an instruct model answers it only inside its chat template.
    chat = args.chat or (not args.prompt and not args.prompt_token_ids and _has_chat_template(llm))
    outs = _run(llm, prompts, params, chat)
    dt = time.perf_counter() - t0
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        ids = f"token ids {list(comp.token_ids)}"
        text = comp.text if isinstance(prompt, str) else (f"{comp.text!r} = {ids}" if comp.text else ids)
        print(f"\n>>> {_shown(prompt)}\n{text}")
        spec = out.speculative
        accepted = (f", {spec.acceptance_rate:.0%} of proposals accepted, {spec.mean_accepted_length:.2f} tokens "
                    f"per verification step" if spec is not None and spec.num_drafts else "")
        print(f"[{len(out.outputs[0].token_ids)} tokens, finish: {out.outputs[0].finish_reason}{accepted}]")
    print(f"\ngenerated {ntok} tokens in {dt:.2f} s ({ntok / dt:.1f} tok/s) with {llm.plan.kv_cache_dtype} KV")
    if compare_kv_dtype is not None:
        llm.shutdown()  # its KV pool would leave the second engine no device memory to plan for
        other = LLM(**{**engine_args.__dict__, "kv_cache_dtype": compare_kv_dtype})
        ref = _run(other, prompts, params, chat)
        other.shutdown()
        total_same, total = 0, 0
        print(f"\n{llm.plan.kv_cache_dtype} KV vs {other.plan.kv_cache_dtype} KV (greedy):")
        for i, (a, b) in enumerate(zip(outs, ref)):
            ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
            prefix, frac = agreement(ta, tb)
            total_same += round(frac * max(len(ta), len(tb)))
            total += max(len(ta), len(tb))
            print(f"  prompt {i}: {prefix} leading tokens identical, {frac:.1%} of positions agree "
                  f"({len(ta)} vs {len(tb)} tokens)")
            if prefix < len(tb):
                print(f"    {other.plan.kv_cache_dtype}: {b.outputs[0].text!r}")
        print(f"  overall agreement: {total_same}/{total} = {total_same / max(total, 1):.1%}")
    return 0

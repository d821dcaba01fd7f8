"""The rule for a prompt given as token ids: at least one id, each an integer in [0, vocab_size)."""

from __future__ import annotations

from kvforge.engine.sampling_params import plain_int
from kvforge.errors import InvalidRequestError


def check_prompt_token_ids(ids, vocab_size: int) -> list[int]:
    """``ids`` as a list of Python ints (numpy integers taken as the ints they hold), or InvalidRequestError
    (field "prompt") naming the first id out of range."""
    ids = [plain_int(t) for t in ids]
    if not ids:
        raise InvalidRequestError("prompt is empty; send at least one token", field="prompt")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size}); got {t!r}",
                                      field="prompt")
    return ids


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int, max_tokens: int | None = None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (None: all of them; -1: as many as
    leave room in ``max_model_len`` for ``max_tokens`` generated tokens, at least one, where vLLM's
    ``max_model_len`` would leave none)."""
    if keep is None:
        return ids
    if keep > max_model_len:
        raise InvalidRequestError(f"truncate_prompt_tokens {keep} is greater than max_model_len {max_model_len}: "
                                  f"keep at most {max_model_len - 1} tokens where output follows (-1: as many as "
                                  f"leave room for max_tokens)", field="truncate_prompt_tokens")
    if keep == -1:
        keep = max(1, max_model_len - max(1, max_tokens or 1))
    return ids[-keep:] if len(ids) > keep else ids


#: The keys of a prompt dict that kvforge reads: the prompt as text or as ids.
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def check_prompt_dict(prompt: dict) -> None:
    """Refuse a prompt dict's keys that would change the request and that kvforge does not apply (vLLM's
    ``multi_modal_data``, ``mm_processor_kwargs``, ``cache_salt``, ...), so no request runs as another one;
    such a key set to None (or an empty dict) changes nothing and is taken."""
    extra = sorted(k for k, v in prompt.items() if k not in PROMPT_KEYS and v is not None and v != {})
    if not extra:
        return
    multimodal = [k for k in extra if k in ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids")]
    why = ("multimodal inputs are not supported: send text or token ids" if multimodal else
           f"a prompt dict takes {' and '.join(repr(k) for k in PROMPT_KEYS)} only")
    raise InvalidRequestError(f"prompt key {', '.join(repr(k) for k in extra)}: {why}", field=extra[0])

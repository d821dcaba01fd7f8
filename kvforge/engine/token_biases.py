"""Per-request token restrictions on a batch of logits: ``allowed_token_ids`` and ``logit_bias``.

* ``allowed_token_ids`` (vLLM's field): every other token's logit becomes -inf, so neither greedy nor random
  sampling can pick it;
* ``logit_bias`` (OpenAI's field): ``{token id: bias}``, each bias in [-100, 100] added to that token's logit
  (-100 in practice bans a token, +100 forces it);
* ``min_tokens`` (vLLM's field): while a row has fewer output tokens than that, its stop tokens (EOS unless
  ignored, and ``stop_token_ids``) are excluded (stop strings are held back by the detokenizer);
* ``bad_words`` (vLLM's field): the tokens that would complete a bad word here (kvforge/engine/bad_words.py
  finds them; the caller passes them per row) are excluded, last: a row they would leave without any token
  keeps its logits without them.

Rows without any of these are left as they are (the function returns its input when no row has one).
Logprobs stay those of the raw logits: the sampler computes them before.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

from kvforge.engine.sampling_params import SamplingParams
from kvforge.host_copies import values_to_device


def _stop_tokens(params: SamplingParams, eos_token_ids: Collection[int]) -> set[int]:
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def apply_token_biases(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int] | None = None,
                       eos_token_ids: Collection[int] = (),
                       bad_word_bans: list[Collection[int]] | None = None) -> torch.Tensor:  # fmt: skip
    """float32 ``logits`` [rows, vocab] with each row's allowed set, biases, ``min_tokens`` rule and bad-word
    bans applied (module docstring); ``num_generated``: each row's output tokens before the one it samples
    (needed where a row sets ``min_tokens``); ``bad_word_bans``: each row's tokens that would complete a bad
    word."""
    out = _biased(logits, params, num_generated, eos_token_ids)
    pairs = [(i, t) for i, banned in enumerate(bad_word_bans or ()) for t in banned if t < logits.shape[1]]
    if not pairs:
        return out
    rows, cols = zip(*pairs)
    at = values_to_device([rows, cols], logits.device)
    banned = out.index_put((at[0], at[1]), out.new_full((), float("-inf")))
    emptied = torch.isneginf(banned).all(dim=-1, keepdim=True)
    return torch.where(emptied, out, banned)


def _biased(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int] | None,
            eos_token_ids: Collection[int]) -> torch.Tensor:
    allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    min_rows = [i for i, p in enumerate(params) if p.min_tokens]
    if min_rows:
        if num_generated is None:
            raise ValueError("min_tokens needs each row's count of output tokens")
        min_rows = [i for i in min_rows if num_generated[i] < params[i].min_tokens]
    if not allowed_rows and not bias_rows and not min_rows:
        return logits
    out = logits.clone()
    device = logits.device
    vocab = logits.shape[1]
    banned = [(i, t) for i in min_rows for t in _stop_tokens(params[i], eos_token_ids) if t < vocab]
    if banned:
        rows, cols = zip(*banned)
        at = values_to_device([rows, cols], device)
        # A Python scalar as an advanced-index value is copied to the device from pageable memory (a stream
        # synchronize); a device scalar is not.
        out.index_put_((at[0], at[1]), out.new_full((), float("-inf")))
    if allowed_rows:
        keep = np.zeros((len(allowed_rows), logits.shape[1]), dtype=bool)  # staged on the host
        for r, i in enumerate(allowed_rows):
            keep[r, list(params[i].allowed_token_ids)] = True
        idx = values_to_device(allowed_rows, device)
        out[idx] = out[idx].masked_fill(~values_to_device(keep, device, torch.bool), float("-inf"))
    if bias_rows:
        rows, cols, values = [], [], []
        for i in bias_rows:
            for token, bias in params[i].logit_bias:
                rows.append(i)
                cols.append(token)
                values.append(bias)
        at = values_to_device([rows, cols], device)
        out.index_put_((at[0], at[1]), values_to_device(values, device, out.dtype), accumulate=True)
    return out

"""Per-request token restrictions on a batch of logits: ``allowed_token_ids`` and ``logit_bias``.

* ``allowed_token_ids`` (vLLM's field): every other token's logit becomes -inf, so neither greedy nor random
  sampling can pick it;
* ``logit_bias`` (OpenAI's field): ``{token id: bias}``, each bias in [-100, 100] added to that token's logit
  (-100 in practice bans a token, +100 forces it).

Rows without either are left as they are (the function returns its input when no row has one). Logprobs
stay those of the raw logits: the sampler computes them before.
"""

from __future__ import annotations

import torch

from kvforge.engine.sampling_params import SamplingParams


def apply_token_biases(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """float32 ``logits`` [rows, vocab] with each row's allowed set and biases applied (module docstring)."""
    allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not allowed_rows and not bias_rows:
        return logits
    out = logits.clone()
    device = logits.device
    if allowed_rows:
        keep = torch.zeros(len(allowed_rows), logits.shape[1], dtype=torch.bool)
        for r, i in enumerate(allowed_rows):
            keep[r, list(params[i].allowed_token_ids)] = True
        idx = torch.tensor(allowed_rows, dtype=torch.long, device=device)
        out[idx] = out[idx].masked_fill(~keep.to(device, non_blocking=True), float("-inf"))
    if bias_rows:
        rows, cols, values = [], [], []
        for i in bias_rows:
            for token, bias in params[i].logit_bias:
                rows.append(i)
                cols.append(token)
                values.append(bias)
        out.index_put_((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                       torch.tensor(values, dtype=out.dtype, device=device), accumulate=True)  # fmt: skip
    return out

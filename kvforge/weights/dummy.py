"""Seeded random weights of the right shapes (for benchmarks and tests without a checkpoint).

Linear and embedding weights ~ normal(0, 0.02), norm weights 1, biases 0. The
numbers are generated on the parameter's own device (fast for big models) and
are deterministic for a given seed, device and model structure (drawn in the
order of each parameter's shape, whatever its memory layout); a
tensor-parallel rank gets its part of the same full tensors as TP=1.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    gens: dict[torch.device, torch.Generator] = {}
    shard = getattr(model, "shard_parameter", None)  # tensor-parallel models (kvforge/distributed/tp_decoder.py)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 2)
        is_norm = p.dim() == 1 and ("norm" in name or "layernorm" in name)
        if is_norm:
            p.fill_(1.0)
        elif leaf[-1] == "bias":
            p.zero_()
        else:
            g = gens.get(p.device)
            if g is None:
                g = gens[p.device] = torch.Generator(device=p.device)
                g.manual_seed(int(seed))
            drawable = p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
            if shard is not None:  # tensor-parallel rank: draw the TP=1 tensor, keep this rank's part
                full = torch.empty(model.full_parameter_shape(name), device=p.device,
                                   dtype=p.dtype if drawable else torch.float32)
                p.copy_(shard(name, full.normal_(0.0, std, generator=g)))
            elif drawable and p.is_contiguous():
                p.normal_(0.0, std, generator=g)
            else:  # fp8 storage (drawn in float32, cast) or a strided layout (drawn in the shape's order)
                p.copy_(torch.empty(p.shape, device=p.device, dtype=p.dtype if drawable else torch.float32)
                        .normal_(0.0, std, generator=g))

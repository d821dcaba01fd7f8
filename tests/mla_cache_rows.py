"""Paged MLA latent caches for the kernel tests: rows of known values at random blocks, NaN everywhere else."""

from __future__ import annotations

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def paged_rows(lens, block_size, width, dtype, scale, gen):
    """A paged cache ``[num_blocks, block_size, width]`` whose token rows hold ``rows / scale`` in ``dtype``
    (torch's cast); every other row is NaN. Returns (cache, block tables, rows as stored, in float64)."""
    per = [-(-n // block_size) for n in lens]
    nblocks = sum(per) + 3
    perm = torch.randperm(nblocks, generator=gen)
    tables = torch.full((len(lens), max(per) + 1), 2**30, dtype=torch.int32)  # unused entries: junk ids
    cache = torch.full((nblocks, block_size, width), float("nan")).to(dtype)
    if dtype in FP8:
        cache.view(torch.uint8).fill_(0x7F)  # NaN in e4m3 and e5m2
    stored, at = [], 0
    for i, n in enumerate(lens):
        ids = perm[at : at + per[i]]
        at += per[i]
        tables[i, : per[i]] = ids.to(torch.int32)
        rows = torch.randn(n, width, generator=gen)
        rows[:, : width // 2] *= 0.5
        q = (rows / scale).to(dtype)
        pos = torch.arange(n)
        cache[ids[pos // block_size], pos % block_size] = q
        stored.append(q.double() * scale)
    return cache, tables, stored

"""Request seeds reach torch's generators whole: on CPU, whose generator keeps only a seed's low 32 bits,
seeds that differ above bit 32 (or in sign) still draw different numbers, and seeds in [0, 2^32) are used as
they are."""

from __future__ import annotations

import pytest
import torch

from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.sequence import Sequence, generator_seed


def draws(seed: int) -> list[float]:
    g = Sequence("r", [1, 2, 3], SamplingParams(seed=seed)).generator_for("cpu")
    return torch.rand(8, generator=g).tolist()


def test_torch_cpu_generator_keeps_only_32_bits():
    """The premise: without the mixing, 1 and 2^32 + 1 give one stream on CPU."""
    a = torch.rand(4, generator=torch.Generator().manual_seed(1))
    b = torch.rand(4, generator=torch.Generator().manual_seed(2**32 + 1))
    assert torch.equal(a, b)


@pytest.mark.parametrize("a,b", [(1, 2**32 + 1), (-1, 2**63 - 1), (0, -(2**63)), (5, 5 - 2**32)])
def test_seeds_that_differ_above_32_bits_draw_differently(a, b):
    assert draws(a) != draws(b)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**32 - 1])
def test_32_bit_seeds_are_used_as_they_are(seed):
    assert generator_seed(seed, torch.device("cpu")) == seed
    assert draws(seed) == torch.rand(8, generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_seed_draws_the_same_numbers_every_time():
    assert draws(2**40 + 7) == draws(2**40 + 7)
    assert generator_seed(2**40, torch.device("cuda")) == 2**40  # CUDA's generator keeps all 64 bits

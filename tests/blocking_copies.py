"""A torch function mode that records host-to-device copies which would block the host on CUDA, and a sampled
batch that runs every sampler rule."""

from __future__ import annotations

import torch


class BlockingCopies(torch.overrides.TorchFunctionMode):
    """Records host-to-device copies that would block the host on CUDA: ``torch.tensor`` / ``torch.as_tensor``
    given a device (a pageable copy, then a stream synchronize), ``Tensor.to`` a device without
    ``non_blocking``, and a Python number assigned through an advanced index (``x[rows, cols] = 0.0``: the
    value goes to the device as a pageable copy; a basic slice fills without one). On the CPU the same
    calls are made, so the rule is checked without a GPU (pinning the source, which a non-blocking copy
    also needs on CUDA, is kvforge/host_copies.py's; tests/test_host_copies_gpu.py checks the stream is
    never synchronized)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.calls.append(name)
        elif name == "to" and not kwargs.get("non_blocking") and (
                "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])):
            self.calls.append(name)
        elif name == "__setitem__" and isinstance(args[2], (bool, int, float)) and _advanced(args[1]):
            self.calls.append(name)
        return func(*args, **kwargs)


def _advanced(index) -> bool:
    """Whether ``index`` is an advanced index: a tensor or a list, alone or inside a tuple."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, (torch.Tensor, list)) for p in parts)


def every_rule_batch(device) -> tuple:
    """Arguments of ``Sampler.sample`` for five rows on ``device`` whose requests use temperature, min-p,
    top-k, top-p, a seed, repetition / frequency / presence penalties, a logit bias, allowed tokens,
    min_tokens and logprobs: (logits, params, generators, histories, num_generated)."""
    from kvforge.engine.sampling_params import SamplingParams

    torch.manual_seed(0)
    logits = torch.randn(5, 512, device=device)
    params = [SamplingParams(temperature=0.8, min_p=0.05, top_k=10, top_p=0.9, seed=1),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
              SamplingParams(temperature=1.0, logit_bias={3: 1.5}, allowed_token_ids=[1, 2, 3, 4]),
              SamplingParams(temperature=1.2, min_tokens=4, stop_token_ids=[7]),
              SamplingParams(temperature=0.7, logprobs=2)]
    histories = [([1, 2], [3]), ([5, 6, 7], [6, 6]), ([], []), ([9], []), ([], [])]
    generators = [torch.Generator(device).manual_seed(1)] + [None] * 4
    return logits, params, generators, histories, [1, 2, 0, 0, 0]

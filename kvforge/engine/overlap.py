"""Overlapped (asynchronous) scheduling: the host prepares step N+1 while the GPU runs step N.

The synchronous engine waits for each step's sampled tokens before it
schedules the next step, so the GPU idles for the whole host part of a step
(scheduling, input build, output building, detokenization; about 40% of a
Llama-3.1-8B decode step at batch 256 on an H200, docs/BENCHMARKS.md, "End to end, offline").

With ``--async-scheduling`` one ``LLMEngine.step()`` call:

1. schedules step N+1 from a state in which each sequence sampled in step N
   has one token *in flight* (``Sequence.num_pending``; its value unknown);
2. launches step N+1: the input id of an in-flight token is gathered on the
   device from step N's sampled-token tensor (``ModelRunner`` placeholders),
   the sampler runs, and the new tokens start copying to pinned host memory;
3. only then waits for step N's tokens and resolves them
   (``Scheduler.resolve``: append, detokenize, stop checks, free), and
   returns step N's outputs.

Invariants: at most one step is in flight; ``num_pending <= 1`` whenever the
scheduler runs; a sequence whose in-flight token reaches ``max_tokens`` or
``max_model_len`` is not scheduled again, so only an EOS / stop token / stop
string costs one wasted token of compute (its result is dropped). Blocks freed
while a launched step still writes them are safe because every step runs on
one CUDA stream, in order. While every step runs the same rows as the
synchronous engine (no request ended early on EOS or a stop string, no
preemption), outputs are bitwise equal to its; a wasted row changes the
batch's shape and so the float summation order, and greedy outputs can then
differ at near-ties of the logits (tests/test_async_scheduling.py). At TP > 1 rank 0 also
broadcasts each step's sampled tokens to the workers, which gather their
in-flight ids from them (kvforge/distributed/runner.py). Ring (CsaRing)
models keep the synchronous loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvforge.engine.prompt_scoring import PromptLogprobs
from kvforge.engine.sampler import PendingLogprobs
from kvforge.engine.scheduler import SchedulerOutput
from kvforge.engine.sequence import Sequence
from kvforge.engine.step_log import Stamp
from kvforge.host_copies import start_host_copy


def default_async_scheduling(platform: str, tensor_parallel: bool, rings: bool) -> bool:
    """Overlap when ``--async-scheduling`` is not given: only where the device runs apart from the host (CUDA),
    at TP 1 (at TP > 1 it works on CPU but is not yet measured on GPUs), and never for ring models, whose
    per-request rings are bound to the synchronous step (an in-flight step would write one more row into a
    finished sequence's ring)."""
    return platform == "cuda" and not tensor_parallel and not rings


@dataclass
class InflightStep:
    """A launched step whose sampled tokens have not been read on the host yet.

    ``token_ids``: int64 ``[len(sampled_seqs)]`` on the device, row i for
    ``sampled_seqs[i]``; ``host_tokens`` its copy (pinned on CUDA, complete
    once ``ready`` has fired). ``row_of``: request id -> row, for the next
    step's placeholders. ``logprobs``: per row, as the sampler returned them (a
    ``PendingLogprobs``, resolved with the tokens, where any row asked).
    ``prompt_logprobs``: the step's prompt-token logprobs (host copies, complete
    once ``ready`` has fired), None when no request asked for them.
    ``launched``: when the step was launched, on both clocks (the engine's step record).
    """

    out: SchedulerOutput
    sampled_seqs: list[Sequence]
    token_ids: torch.Tensor
    host_tokens: torch.Tensor
    logprobs: list | PendingLogprobs
    ready: torch.cuda.Event | None
    row_of: dict[str, int] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    launched: Stamp = Stamp(0.0, 0.0)
    #: Speculative steps (synchronous): per sampled sequence, the verified [(token, logprobs)] to append;
    #: ``token_ids`` and ``host_tokens`` are then None.
    verified: list | None = None

    def wait_tokens(self) -> list[int]:
        """Block until the sampled tokens are on the host; return them."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_tokens.tolist()


def copy_tokens_to_host(token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start the device->host copy of ``token_ids``; (host tensor, event that fires when it is complete)."""
    if token_ids.device.type != "cuda":
        return token_ids, None
    host = start_host_copy(token_ids)
    ev = torch.cuda.Event()
    ev.record()
    return host, ev

"""The split-K merge kernel (``triton_paged_attention.merge_split_partials``) under the Triton interpreter
on CPU, against a float64 merge: up to 256 splits x 512 columns (the MLA decode's batch-1 case, columns
spread over several programs), and splits with no token (max -inf, sum 0) whose accumulator rows hold
NaN, as when a split-K kernel leaves them unwritten: they must not reach the output. Runs in a subprocess
because ``TRITON_INTERPRET`` is read when the kernels are defined; skipped without Triton."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent('''
    import torch
    from kvforge.kernels.triton_paged_attention import merge_split_partials

    def case(t, h, s, d, d_pad, empty_every, seed):
        g = torch.Generator().manual_seed(seed)
        acc = torch.randn(t, h, s, d_pad, generator=g)
        ml = torch.stack([torch.randn(t, h, s, generator=g) * 4, torch.rand(t, h, s, generator=g) + 0.5], -1)
        empty = torch.zeros(t, h, s, dtype=torch.bool)
        empty[..., ::empty_every] = True
        empty[..., 1] = False
        ml[..., 0][empty] = float("-inf")
        ml[..., 1][empty] = 0.0
        acc[empty] = float("nan")
        qsl = torch.tensor([0, t - 1], dtype=torch.int32)  # one sequence of t - 1 tokens; the last is padding
        out = torch.full((t, h, d), 7.0)
        merge_split_partials(acc, ml, out, qsl, 1)
        m = ml[..., 0].double()
        w = torch.where(empty, 0.0, torch.exp2(m - m.amax(-1, keepdim=True)))
        a = torch.where(empty[..., None], 0.0, acc.double())
        want = (a[..., :d] * w[..., None]).sum(2) / (ml[..., 1].double() * w).sum(2)[..., None]
        err = (out[: t - 1].double() - want[: t - 1]).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), (t, h, s, d, err)
        assert torch.all(out[t - 1] == 7.0), "the padding token's row was written"

    case(3, 2, 128, 512, 512, 3, 0)  # 128 splits: 64 columns per program, 8 programs per (token, head)
    case(2, 2, 256, 512, 512, 3, 0)  # 256 (the wgmma MLA cap): 32 columns per program, 16 programs
    case(2, 1, 256, 512, 512, 1, 4)  # 256 splits, all but one empty (a short sequence under a pinned graph)
    case(2, 1, 64, 512, 512, 5, 2)
    case(3, 4, 5, 96, 128, 2, 1)  # GQA-like: D 96 padded to 128, one program per (token, head)
    print("ok")
''')


def test_merge_kernel_interpreted_many_splits_and_empty_splits():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]

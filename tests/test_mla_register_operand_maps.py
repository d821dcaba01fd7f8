"""Index algebra of the register-operand MLA decode (kvforge/kernels/gluon_mla_decode_ws.py), on CPU.

The kernel turns loaded tiles into ``wgmma`` operands with reshapes, permutes and splits. Those follow
numpy's row-major semantics whatever the register layout is. It then reads the query columns through
``chunk_column`` and stores accumulator rows at ``latent_column``. Here the same shape operations run in
numpy on tensors of physical column numbers, and the result must be exactly what those two maps claim.
A wrong bit in either map would scramble the scores or the output columns on the GPU.
"""

from __future__ import annotations

import numpy as np

from kvforge.kernels import gluon_mla_decode_ws as ex


def test_score_operand_reads_chunk_column():
    cols = np.broadcast_to(np.arange(64), (64, 64))  # x[token, physical column] = the column number
    y = cols.reshape(64, 2, 2, 2, 2, 2, 2).transpose(0, 3, 4, 5, 1, 2, 6).reshape(64, 64)  # _score_operand
    assert [int(c) for c in y[0]] == [ex.chunk_column(k) for k in range(64)]
    assert sorted(ex.chunk_column(k) for k in range(64)) == list(range(64))  # a permutation
    # a thread (lane t = lane % 4) holds logical columns {2t, 2t+1, 2t+8, 2t+9} of each 16-column k-step:
    # under the map they are the 16 contiguous bytes 16t .. 16t+15
    for t in range(4):
        held = sorted(ex.chunk_column(16 * b + o) for b in range(4) for o in (2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9))
        assert held == list(range(16 * t, 16 * t + 16))


def test_pv_operand_rows_are_latent_column():
    y = np.broadcast_to(np.arange(512), (64, 512)).reshape(64, 32, 2, 2, 4).transpose(0, 1, 3, 4, 2)
    c3lo, c3hi = y[..., 0], y[..., 1]  # gl.split: the last axis (size 2)
    quarters = []
    for half in (c3lo, c3hi):
        h = half.transpose(0, 1, 3, 2)
        quarters += [h[..., 0], h[..., 1]]
    for j, q in enumerate(quarters):  # accumulator j holds rows 128 j .. 128 j + 127
        z = q.reshape(64, 128).T.reshape(2, 2, 2, 2, 2, 2, 2, 64).transpose(5, 0, 1, 6, 2, 3, 4, 7).reshape(128, 64)
        assert [int(c) for c in z[:, 0]] == [ex.latent_column(128 * j + m) for m in range(128)]
    assert sorted(ex.latent_column(m) for m in range(512)) == list(range(512))


def test_pv_operand_halves_rows_are_latent_column_halves():
    """More than 8 heads per program: each 256-column half (``lat.slice(256 h, 256)``) is reshaped to
    (token, c3..c7, c2, c0 c1), permuted and split on c2 into accumulators 2h and 2h+1, then relabeled by the
    same ``_pv_operand``; the rows must be ``latent_column_halves``, and a thread's 8 contiguous bytes (its
    two rows m3, m6 of the pair's two accumulators) must be columns 8k .. 8k+7."""
    quarters = []
    for h in range(2):
        y = np.broadcast_to(np.arange(256 * h, 256 * h + 256), (64, 256)).reshape(64, 32, 2, 4).transpose(0, 1, 3, 2)
        quarters += [y[..., 0], y[..., 1]]  # gl.split on c2
    for j, q in enumerate(quarters):
        z = q.reshape(64, 128).T.reshape(2, 2, 2, 2, 2, 2, 2, 64).transpose(5, 0, 1, 6, 2, 3, 4, 7).reshape(128, 64)
        assert [int(c) for c in z[:, 0]] == [ex.latent_column_halves(128 * j + m) for m in range(128)]
    assert sorted(ex.latent_column_halves(m) for m in range(512)) == list(range(512))
    for r in (0, 1, 2, 4, 16, 32):  # m0-m2 (lanes), m4-m5 (warps): row r's bytes with m3, m6, m7 varied
        held = sorted(ex.latent_column_halves(r + 8 * a + 64 * b + 128 * c) for a in (0, 1) for b in (0, 1)
                      for c in (0, 1))  # fmt: skip
        assert held == list(range(held[0], held[0] + 8)) and held[0] % 8 == 0


def _jit_expression(name: str) -> str:
    """The return expression of the kernel helper ``name`` in the module's source (the helpers are jit
    functions, absent without Triton, so their text is evaluated here on numpy integers)."""
    src = open(ex.__file__).read()
    body = src[src.index(f"def {name}("):]
    body = body[body.index("return ") + len("return "):]
    end = body.index("\n\n")
    return " ".join(body[:end].replace("\\\n", " ").split())


def test_kernel_bit_formulas_match_the_python_maps():
    """The kernel reads query columns through ``_chunk_column_of``: its source, evaluated on every index, equals
    the map above. It stores accumulator ``j`` row ``r`` at partial column ``128 j + r``, which the merge writes
    to latent column ``accumulator_columns(nh)[128 j + r]``: the map of its heads per program."""
    k = np.arange(64)
    assert eval(_jit_expression("_chunk_column_of")).tolist() == [ex.chunk_column(int(v)) for v in k]
    assert ex.accumulator_columns(8, "cpu").tolist() == [ex.latent_column(m) for m in range(512)]
    assert ex.accumulator_columns(16, "cpu").tolist() == [ex.latent_column_halves(m) for m in range(512)]

"""Index algebra of the register-operand MLA decode (kvforge/kernels/gluon_mla_decode_ws.py, and the
experiment benchmarks/exp_regs_mla_decode.py that shares its helpers), on CPU.

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


def _jit_expression(name: str) -> str:
    """The return expression of the kernel helper ``name`` in the module's source (the helpers are jit
    functions, absent without Triton, so their text is evaluated here on numpy integers)."""
    src = open(ex.__file__).read()
    body = src[src.index(f"def {name}("):]
    body = body[body.index("return ") + len("return "):]
    end = body.index("\n\n")
    return " ".join(body[:end].replace("\\\n", " ").split())


def test_kernel_bit_formulas_match_the_python_maps():
    """The kernel reads query columns through ``_chunk_column_of`` and stores accumulator ``j`` row ``r`` at
    ``_latent_column_of(128 j + r)``: their source, evaluated on every index, equals the maps above."""
    k = np.arange(64)
    assert eval(_jit_expression("_chunk_column_of")).tolist() == [ex.chunk_column(int(v)) for v in k]
    m = np.arange(512)
    assert eval(_jit_expression("_latent_column_of")).tolist() == [ex.latent_column(int(v)) for v in m]

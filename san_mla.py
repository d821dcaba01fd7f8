"""Diagnostic (untracked): the 8-warp wgmma MLA kernel outside the launcher's refusal, for compute-sanitizer."""
import sys

import torch

src = open("kvforge/kernels/gluon_mla_decode.py").read()
src = src.replace("if nw == 8 and not (is_fp8 and regs and nh == 32):", "if False:")
open("kvforge/kernels/_san_gmla.py", "w").write(src)
sys.path.insert(0, "tests")
from test_triton_mla import _batch  # noqa: E402

from kvforge.attention import mla_reference as ref  # noqa: E402
from kvforge.kernels import _san_gmla as gm  # noqa: E402

nh, nw, kv, batch = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
cache, meta, ql, qr, scale = _batch(batch, kv, nh, "cuda", block_size=16, seed=1)
want = ref.mla_decode(ql.float(), qr.float(), cache, meta, scale, 192 ** -0.5)
for splits in (1, 4):
    out = gm.mla_decode_wgmma(ql, qr, cache, meta, scale, 192 ** -0.5, num_splits=splits, cfg={"num_warps": nw})
    torch.cuda.synchronize()
    err = ((out.float() - want).abs().max() / want.abs().max()).item()
    print(f"nh={nh} nw={nw} kv={kv} batch={batch} splits={splits} rel_err={err:.3e}", flush=True)

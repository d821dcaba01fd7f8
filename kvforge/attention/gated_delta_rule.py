"""The gated delta rule (Gated DeltaNet, Kimi Delta Attention) in PyTorch: the reference on every device.

One sequence, one head: a state ``S [K, V]`` (a key-to-value map) evolves per token ``t`` as

    S  <- diag(exp(g_t)) S                          (decay; g_t <= 0, log space)
    u_t = beta_t * (v_t - S^T k_t)                   (the delta: what S mispredicts for k_t)
    S  <- S + k_t u_t^T                              (write the correction)
    o_t = S^T (scale * q_t)                          (read with the updated state)

``g_t`` is one number per head (Gated DeltaNet, ``g [T, Hv]``) or one per key channel (KDA,
``g [T, Hv, K]``). With ``normalize_qk``, q and k are first L2-normalised over the head
dimension (``x * rsqrt(sum(x^2) + 1e-6)``, in the compute dtype), as transformers'
``use_qk_l2norm_in_kernel``. ``scale`` defaults to ``K ** -0.5``.

Heads: ``q, k [T, Hk, K]``, ``v [T, Hv, V]`` with ``Hv`` a multiple of ``Hk``; value head ``h``
reads key head ``h // (Hv // Hk)``. ``g`` and ``beta [T, Hv]`` are per value head.

State contract: ``state [Hv, K, V]`` is the state before the first token (None: zeros); both
forms return ``(o [T, Hv, V] in v's dtype, final state [Hv, K, V] in the compute dtype)``, so a
sequence cut anywhere into calls that carry the state gives the outputs and state of one call.
Compute dtype: float64 when ``v`` is float64, else float32.

:func:`recurrent` runs the definition token by token (decode). :func:`chunked` (prefill) gives the
same result with matrix products over chunks of ``chunk_size`` tokens (the last chunk may be
shorter): inside a chunk, with ``G`` the cumulative sum of ``g`` from the chunk start, the deltas
``U`` solve the unit lower-triangular system ``(I + A) U = beta V - (beta K exp(G)) S0`` where
``A[t, j] = beta_t sum_c k_t[c] k_j[c] exp(G_t[c] - G_j[c])`` for ``j < t``; then
``O = (Q exp(G)) S0 + tril(Q K^T decay) U`` and ``S = exp(G_last) S0 + (K exp(G_last - G))^T U``.
Every exponent is ``<= 0`` (differences of a non-increasing cumulative sum), so nothing overflows.
"""

from __future__ import annotations

import torch

L2_NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_NORM_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)`` (the FLA / transformers convention, not ``max(norm, eps)``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, state, scale, normalize_qk):
    """Validated inputs in the compute dtype, key heads expanded to value heads, g as [T, Hv, K]."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"gated delta rule wants q, k [T, Hk, K] and v [T, Hv, V]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    t, hk, dk = q.shape
    hv = v.shape[1]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    if beta.shape != (t, hv) or g.shape not in ((t, hv), (t, hv, dk)):
        raise ValueError(f"g must be [T, Hv] or [T, Hv, K] and beta [T, Hv] (T={t}, Hv={hv}, K={dk}); "
                         f"got g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    cdt = torch.float64 if v.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(cdt) for x in (q, k, v, g, beta))
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    q = q * (dk**-0.5 if scale is None else float(scale))
    if g.dim() == 2:
        g = g[:, :, None].expand(t, hv, dk)
    if state is None:
        state = torch.zeros(hv, dk, v.shape[2], dtype=cdt, device=v.device)
    elif state.shape != (hv, dk, v.shape[2]):
        raise ValueError(f"state must be [Hv, K, V] = {(hv, dk, v.shape[2])}, got {tuple(state.shape)}")
    return q, k, v, g, beta, state.to(cdt)


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor | None = None, *, scale: float | None = None,
              normalize_qk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time (see the module docstring for shapes and contract)."""
    out_dtype = v.dtype
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state, scale, normalize_qk)
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, :, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][:, :, None] * u[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out.to(out_dtype), s


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor | None = None, *, chunk_size: int = 64, scale: float | None = None,
            normalize_qk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over chunks of ``chunk_size`` tokens (see the module docstring)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out_dtype = v.dtype
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, state, scale, normalize_qk)
    # Heads first: [Hv, T, ...].
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))
    beta = beta.transpose(0, 1)
    out = torch.empty_like(v)
    for start in range(0, q.shape[1], chunk_size):
        c = slice(start, start + chunk_size)
        qc, kc, vc, bc = q[:, c], k[:, c], v[:, c], beta[:, c]
        n = qc.shape[1]
        gc = g[:, c].cumsum(dim=1)  # [Hv, n, K]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        diff = (gc[:, :, None, :] - gc[:, None, :, :]).masked_fill(~lower[None, :, :, None], float("-inf"))
        decay = diff.exp()  # [Hv, n(t), n(j), K]: exp(G_t - G_j) for j <= t, else 0
        kk = torch.einsum("htc,hjc,htjc->htj", kc, kc, decay)
        a = (bc[:, :, None] * kk).tril(-1)
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        rhs_v = bc[:, :, None] * vc
        rhs_k = bc[:, :, None] * kc * gc.exp()
        u0 = torch.linalg.solve_triangular(eye + a, rhs_v, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(eye + a, rhs_k, upper=False, unitriangular=True)
        u = u0 - w @ s
        qk = torch.einsum("htc,hjc,htjc->htj", qc, kc, decay)
        out[:, c] = (qc * gc.exp()) @ s + qk @ u
        g_last = gc[:, -1]  # [Hv, K]
        s = g_last.exp()[:, :, None] * s + (kc * (g_last[:, None, :] - gc).exp()).transpose(1, 2) @ u
    return out.transpose(0, 1).to(out_dtype), s

"""A dense reference ``attn`` callable and a greedy loop built on it.

This is the model-level oracle: no paging, no kernels. K/V of each sequence
live in per-layer tensors that grow by concatenation; every call computes
causal (optionally sliding-window) attention in float32 for each sequence of
the flat batch. It exists to test models (``tests/test_models_vs_hf.py``,
``tests/test_gguf.py``) and as a slow-but-obvious baseline for the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class DenseKVAttention:
    """``attn(layer_idx, q[T,Hq,D], k[T,Hkv,D], v[T,Hkv,D]) -> [T,Hq,D]`` over a flat batch.

    Call :meth:`set_batch` before each model forward with the sequence ids in
    the order their tokens appear and how many new tokens each contributes.
    """

    def __init__(self, softmax_scale: float, sliding_window: Callable[[int], int | None] | None = None):
        self.scale = float(softmax_scale)
        self.window = sliding_window or (lambda _layer: None)
        self.cache: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._batch: list[tuple[int, int]] = []

    @classmethod
    def for_model(cls, model) -> DenseKVAttention:
        return cls(model.softmax_scale, model.sliding_window)

    def set_batch(self, seq_ids: Sequence[int], query_lens: Sequence[int]) -> None:
        self._batch = list(zip(seq_ids, query_lens))

    def context_len(self, seq_id: int) -> int:
        layers = self.cache.get(seq_id)
        return 0 if not layers else next(iter(layers.values()))[0].shape[0]

    def free(self, seq_id: int) -> None:
        self.cache.pop(seq_id, None)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        window = self.window(layer_idx)
        start = 0
        for seq_id, n in self._batch:
            layers = self.cache.setdefault(seq_id, {})
            k_new, v_new = k[start : start + n], v[start : start + n]
            if layer_idx in layers:
                k_old, v_old = layers[layer_idx]
                k_all, v_all = torch.cat([k_old, k_new]), torch.cat([v_old, v_new])
            else:
                k_all, v_all = k_new, v_new
            layers[layer_idx] = (k_all, v_all)
            out[start : start + n] = self._attend(q[start : start + n], k_all, v_all, window).to(q.dtype)
            start += n
        if start != q.shape[0]:
            raise ValueError(f"set_batch covered {start} tokens but the step has {q.shape[0]}")
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
        n, hq, _ = q.shape
        total, hkv, _ = k.shape
        if hq != hkv:
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * self.scale
        qpos = torch.arange(total - n, total, device=q.device)[:, None]
        kpos = torch.arange(total, device=q.device)[None, :]
        allowed = kpos <= qpos
        if window is not None:
            allowed &= qpos - kpos < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = scores.softmax(dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v.float())


@torch.no_grad()
def greedy_generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: frozenset[int] | set[int] = frozenset(),
    device=None,
) -> list[list[int]]:
    """Greedy decoding of several prompts at once (one flat batch per step) with dense attention."""
    if device is None:
        device = next(model.parameters()).device
    attn = DenseKVAttention.for_model(model)
    outputs: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    feed = {i: list(p) for i, p in enumerate(prompts)}
    for _ in range(max_new_tokens):
        if not active:
            break
        ids, pos, ends = [], [], []
        for i in active:
            ctx = attn.context_len(i)
            ids += feed[i]
            pos += range(ctx, ctx + len(feed[i]))
            ends.append(len(ids) - 1)
        attn.set_batch(active, [len(feed[i]) for i in active])
        hidden = model(
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(pos, dtype=torch.long, device=device),
            attn,
        )
        next_ids = model.compute_logits(hidden[ends]).argmax(dim=-1).tolist()
        still = []
        for i, tok in zip(active, next_ids):
            outputs[i].append(tok)
            feed[i] = [tok]
            if tok in eos_token_ids:
                attn.free(i)
            else:
                still.append(i)
        active = still
    return outputs

"""Token masks of grammar-constrained rows: one bit per vocabulary id (xgrammar's packed int32 bitmask), set
where the request's grammar allows the token next."""

from __future__ import annotations

import torch

from kvforge.host_copies import values_to_device


def set_bits(bitmask, row: int, tokens) -> None:
    """Set the bits of ``tokens`` in row ``row`` (int32 words)."""
    for token in tokens:
        word = int(bitmask[row, token // 32]) | (1 << (token % 32))
        bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word


def clear_bits(bitmask, row: int, tokens) -> None:
    """Clear the bits of ``tokens`` in row ``row`` (ids past the row's width have none)."""
    for token in tokens:
        if token // 32 < bitmask.shape[1]:
            word = (int(bitmask[row, token // 32]) & 0xFFFFFFFF) & ~(1 << (token % 32))
            bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word


def has_bit(bitmask, row: int, token: int) -> bool:
    """Whether row ``row`` allows ``token``."""
    return token // 32 < bitmask.shape[1] and bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def grammar_bitmask(matchers: list, vocab_size: int) -> torch.Tensor | None:
    """The bitmask [len(matchers), ceil(vocab_size / 32)] int32 of each row's next token, every bit set in the
    rows whose matcher is None or complete (a row whose request ends before its token is read); None when no
    row has one."""
    if all(m is None for m in matchers):
        return None
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)
    for row, matcher in enumerate(matchers):
        if matcher is not None and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask


def proposal_bitmask(matchers: list, proposals: list[list[int]], vocab_size: int) -> torch.Tensor | None:
    """The bitmask of a verification step's rows: per sequence ``len(proposals[i]) + 1`` rows, row ``j`` the
    tokens its grammar allows after its output and its first ``j`` proposals. Where the grammar refuses
    proposal ``j``, the rows after it allow everything: verification rejects proposal ``j`` (its row gives it
    no probability), so they are never read. The matchers end where they began (rolled back)."""
    if all(m is None for m in matchers):
        return None
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(sum(len(p) + 1 for p in proposals), vocab_size)
    row = 0
    for matcher, props in zip(matchers, proposals):
        if matcher is not None:
            accepted = 0
            for j in range(len(props) + 1):
                if matcher.is_terminated():  # a proposed end token completed the output: nothing follows it
                    break
                matcher.fill_next_token_bitmask(bitmask, row + j)
                if j == len(props) or not _allows(bitmask, row + j, props[j]) or not matcher.accept_token(props[j]):
                    break
                accepted += 1
            if accepted:
                matcher.rollback(accepted)
        row += len(props) + 1
    return bitmask


def _allows(bitmask: torch.Tensor, row: int, token: int) -> bool:
    """Whether row ``row`` of ``bitmask`` allows ``token`` (checked before the matcher sees a proposal: xgrammar
    warns on every special token it is offered)."""
    if not 0 <= token < bitmask.shape[1] * 32:
        return False
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of float32 ``logits`` [N, vocab] with -inf where ``bitmask`` [N, words] has the token's bit clear."""
    import xgrammar

    out = logits.clone()
    xgrammar.apply_token_bitmask_inplace(out, values_to_device(bitmask, out.device, bitmask.dtype),
                                         vocab_size=out.shape[-1])
    return out

"""The split-K rule every split decode kernel uses, with its parameters named per kernel.

A decode program walks one (sequence, head group) over a slice of its context; with few programs the GPU
sits idle, so the context is split into ``splits`` slices whose partials a merge kernel combines. The rule:
as many splits as fill ``waves`` programs per SM (``ceil`` or ``floor`` of the SM count over the programs),
but no split shorter than ``min_tokens`` and never more than ``max_splits``; at least one. A kernel may fill
fewer waves when its programs are few (``small_grid_waves`` once the programs are at most half the SMs): a
few (sequence, head) programs split many ways pay more in partials and merging than the extra waves hide.
On those small grids a kernel may also take shorter splits (``small_grid_min_tokens``): a lone program walks
its tokens one tile at a time, so a few programs over a short context finish sooner split finer. A kernel
whose rule fills more than one wave may also keep, on small grids, at least one full wave of splits no shorter
than ``one_wave_min_tokens`` where its own rule gives fewer (its long-split waves are for long contexts; a
short one is served faster by one wave of short splits).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SplitRule:
    """One kernel's split-K parameters (see the module docstring).

    ``round_up``: ``ceil(waves * SMs / programs)`` (a partial last wave is allowed) rather than the floor
    (whole waves only). ``forced``: how a caller's pinned count is applied (:meth:`apply_forced`).
    """

    waves: int
    min_tokens: int
    max_splits: int
    round_up: bool
    #: "exact": the pinned count as given (at least 1); "capped": also at most ``max_splits``;
    #: "or_rule": a pinned 0 means "use the rule", then capped.
    forced: str = "exact"
    #: Waves to fill when ``programs <= num_sms // 2`` (0: ``waves`` everywhere).
    small_grid_waves: int = 0
    #: The shortest split when ``programs <= num_sms // 2`` (0: ``min_tokens`` everywhere).
    small_grid_min_tokens: int = 0
    #: On small grids, at least ``min(floor(SMs / programs), context // one_wave_min_tokens)`` splits
    #: (0: no such floor).
    one_wave_min_tokens: int = 0

    def waves_for(self, programs: int, num_sms: int) -> int:
        """The waves the rule fills for ``programs`` programs (``small_grid_waves`` on small grids)."""
        if self.small_grid_waves and programs <= num_sms // 2:
            return self.small_grid_waves
        return self.waves

    def min_tokens_for(self, programs: int, num_sms: int) -> int:
        """The shortest split for ``programs`` programs (``small_grid_min_tokens`` on small grids)."""
        if self.small_grid_min_tokens and programs <= num_sms // 2:
            return self.small_grid_min_tokens
        return self.min_tokens

    def splits(self, programs: int, context_len: int, num_sms: int, waves: int | None = None) -> int:
        """The rule's split count for ``programs`` programs over a context of ``context_len`` tokens
        (``waves``: programs per SM where a kernel's residency depends on the shape; default ``self.waves``)."""
        programs = max(1, programs)
        target = (waves or self.waves_for(programs, num_sms)) * num_sms
        fill = -(-target // programs) if self.round_up else target // programs
        count = min(fill, context_len // self.min_tokens_for(programs, num_sms))
        if self.one_wave_min_tokens and programs <= num_sms // 2:
            count = max(count, min(num_sms // programs, context_len // self.one_wave_min_tokens))
        return max(1, min(count, self.max_splits))

    def apply_forced(self, forced: int, programs: int, context_len: int, num_sms: int,
                     waves: int | None = None) -> int:
        """The split count when a caller pins ``forced`` (CUDA graphs pin the rule's count at the longest
        context)."""
        if self.forced == "exact":
            return max(1, int(forced))
        if self.forced == "or_rule" and not forced:
            forced = self.splits(programs, context_len, num_sms, waves)
        return max(1, min(int(forced), self.max_splits))

    def choose(self, forced: int | None, programs: int, context_len: int, num_sms: int,
               waves: int | None = None) -> int:
        """The rule's count, or the pinned one when ``forced`` is not None."""
        if forced is None:
            return self.splits(programs, context_len, num_sms, waves)
        return self.apply_forced(forced, programs, context_len, num_sms, waves)

    def describe(self) -> str:
        fill = "ceil" if self.round_up else "floor"
        waves = "waves" if self.waves == 0 else str(self.waves)
        if self.small_grid_waves:
            waves += f" (or {self.small_grid_waves} when programs <= SMs // 2)"
        tokens = str(self.min_tokens)
        if self.small_grid_min_tokens:
            tokens += f" (or {self.small_grid_min_tokens} when programs <= SMs // 2)"
        rule = f"min({fill}({waves} x SMs / programs), context // {tokens}, {self.max_splits})"
        if self.one_wave_min_tokens:
            rule += (f"; when programs <= SMs // 2 at least min(floor(SMs / programs), context // "
                     f"{self.one_wave_min_tokens})")
        return rule + ", at least 1"

"""LazyEviction (Zhang et al., 2025, arXiv 2506.15969): lagged eviction by each token's recurrence interval.

In long generations a token that goes quiet often comes back. Each (KV head, token) keeps two
counts: ``quiet``, the queries since the token was last *recalled* (a query gave it at least
`threshold` times the uniform share 1/t of its attention, t = the tokens it attended; mean over
the G query heads of the KV head), and ``gap``, the longest quiet spell that ended in a recall
(its recurrence interval). A token counts as recalled just before it enters, so one never
recalled has gap 0 and one recalled only at its own step gap 1.

Score: a token still inside its longest recorded silence (quiet <= gap) is expected back in
gap - quiet steps; the cache keeps the soonest expected first, and every overdue token
(quiet > gap: past any silence it has shown) ranks below every expected one, the most
overdue dropped first (ties: the older first). The `window` newest tokens are pinned: they
have not been observed long enough.

Lagged: the cache evicts once every `window` tokens (the policy's `lag`, a slack of
window - 1), so a token stays observed for up to a window past the budget. A prompt is
observed through its last `window` queries (`last_rows`); earlier prompt queries count for
nothing, as if every token entered just before the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import AttentionStats, Policy, TokenView, ranks

#: Above any gap or quiet count a cache reaches (float64 holds both exactly): puts every overdue token below
OVERDUE = float(2**40)


@dataclass(frozen=True)
class LazyParams:
    window: int = 32  # W: tokens between evictions, the newest W pinned, the prompt's last W queries observed
    threshold: float = 1.0  # a recall: at least this many times the uniform share 1/t of a query's attention

    def validate(self) -> None:
        if self.window < 1:
            raise ValueError("window must be >= 1")
        if self.threshold <= 0:
            raise ValueError("threshold must be > 0")


class Lazy(Policy):
    name = "lazy"
    description = "lagged eviction (every window tokens) of the tokens furthest past their recurrence interval"
    Params = LazyParams
    needs = frozenset({"last_rows"})
    state = {"quiet": torch.float32, "gap": torch.float32}

    def __init__(self, params: LazyParams | None = None) -> None:
        super().__init__(params)
        self.last_rows_window = self.params.window
        self.lag = self.params.window - 1

    def observe(self, state: dict[str, torch.Tensor], stats: AttentionStats) -> None:
        rows = stats.last_rows  # [B, Hkv, R, T]: the call's last R queries (pads and empty slots: 0)
        present = rows > 0
        recalled = present & (rows * present.sum(dim=-1, keepdim=True) >= self.params.threshold)
        quiet, gap = state["quiet"], state["gap"]
        # the quiet count at each row, over the rows in order, without a loop: `heard` is the count of present
        # rows up to the last recall (or minus the quiet count carried in, before any)
        counted = present.float().cumsum(dim=2)  # [B, Hkv, R, T]
        heard = torch.where(recalled, counted, -quiet[:, :, None]).cummax(dim=2).values
        before = torch.cat([-quiet[:, :, None], heard[:, :, :-1]], dim=2)  # the same, just before each row
        spells = torch.where(recalled, counted - before, 0.0)  # the quiet spell each recall ends
        torch.maximum(gap, spells.amax(dim=2), out=gap)
        quiet.copy_(counted[:, :, -1] - heard[:, :, -1])

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        quiet, gap = state["quiet"].double(), state["gap"].double()
        ahead = torch.where(quiet <= gap, quiet - gap, -OVERDUE - (quiet - gap))  # higher: back sooner
        score = ranks(ahead, view.positions, dim=2, dtype=torch.float32)
        pinned = torch.clamp(view.budget, max=self.params.window)
        return torch.where(view.recent_mask(pinned), torch.inf, score)

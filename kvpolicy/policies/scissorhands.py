"""Scissorhands (Liu et al., NeurIPS'23, arXiv 2305.17118): drop the tokens that keep getting little attention.

Score: per (KV head, token) an "unimportance" count n[j] of the queries that gave token j
less than the uniform share 1/t of their attention (t = the tokens that query attended),
over the recent `history_window` (w) queries; the `recent` (r) newest tokens are pinned.
The cache drops the tokens with the highest counts (ties: the older token goes first).

The history window is an exponentially decayed count: every query multiplies n by
(1 - 1/w) before adding its own 0/1, so the weights of past queries sum to w and fade
over about w steps. The paper counts over a hard window of the last w steps, which needs
a ring buffer of w bits per token (400x this one float); the decayed count needs no
history and ranks tokens the same way whenever their below-uniform rate is steady.

Indicators: decode steps (and calls of at most w queries) use the backend's
`below_uniform` statistic (per query head, averaged over the G query heads of the KV
head: the GQA rule). A longer call (a prompt) counts only its last w queries, read from
`last_rows`; those rows are already averaged over the G heads, so for GQA models the
prompt's indicator is "the group's mean attention is below 1/t" (exact for MHA). The
queries of one call all weigh the same; older counts decay by (1 - 1/w) per query.

Amortized compression ("drop m tokens at once when the cache holds B"): use the recipe
budget ``{tokens: B - m, slack: m}``: the cache grows to B, then compacts back to B - m.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import AttentionStats, Policy, TokenView, ranks


@dataclass(frozen=True)
class ScissorhandsParams:
    history_window: int = 400  # w: the queries whose below-uniform indicators are counted
    recent: int = 10  # r: the newest tokens, never evicted

    def validate(self) -> None:
        if self.history_window < 1:
            raise ValueError("history_window must be >= 1")
        if self.recent < 0:
            raise ValueError("recent must be >= 0")


class Scissorhands(Policy):
    name = "scissorhands"
    description = "evict the tokens most often below uniform attention over a history window; recent kept"
    Params = ScissorhandsParams
    needs = frozenset({"below_uniform", "last_rows"})
    state = {"count": torch.float32}

    def __init__(self, params: ScissorhandsParams | None = None) -> None:
        super().__init__(params)
        self.last_rows_window = self.params.history_window

    def observe(self, state: dict[str, torch.Tensor], stats: AttentionStats) -> None:
        window = self.params.history_window
        count = state["count"]
        count.mul_(((1.0 - 1.0 / window) ** stats.queries.double()).float()[:, None, None])
        long = stats.queries > window
        if stats.last_rows.shape[2] < window:  # no call in this batch is a prompt longer than w: the indicators
            count += stats.below_uniform  # (decided by shape, not by reading `long`: a decode step never syncs)
            return
        # a prompt: only its last w queries count
        rows = stats.last_rows
        attended = rows > 0
        below = attended & (rows * attended.sum(dim=-1, keepdim=True) < 1.0)
        count += torch.where(long[:, None, None], below.sum(dim=2).float(), stats.below_uniform)

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        # rank by (count descending, position ascending): rank 0 is the first to go
        score = ranks(-state["count"], view.positions, dim=2, dtype=torch.float32)
        recent = torch.clamp(view.budget, max=self.params.recent)
        return torch.where(view.recent_mask(recent), torch.inf, score)

"""H2O (Zhang et al., NeurIPS'23): heavy hitters by accumulated attention + a recent window.

Score: F[j] = sum of the attention every query so far gave token j (prefill column sums,
then one row per decode step, renormalized over the tokens still cached), reduced over
the query heads of each KV head. The `recent_ratio` share of the budget goes to the
most recent tokens; the rest to the highest F among older ones (paper: 10% + 10%).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import AttentionStats, Policy, TokenView


@dataclass(frozen=True)
class H2OParams:
    recent_ratio: float = 0.5  # share of the budget pinned to the most recent tokens
    # "sum" is the paper; "mean" divides F by the number of queries that saw the token,
    # removing the bias toward early tokens (kvpress ObservedAttention).
    accumulate: str = "sum"
    # 1.0 is the paper; below 1, older attention fades by this factor per token seen (a call
    # of n real queries multiplies F by decay**n before adding its column sums), so tokens that
    # mattered long ago give way, alike token by token or in chunks (KVCache-Factory's decayed sums)
    decay: float = 1.0

    def validate(self) -> None:
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError("recent_ratio must be in [0, 1]")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        if self.accumulate not in ("sum", "mean"):
            raise ValueError('accumulate must be "sum" or "mean"')


class H2O(Policy):
    name = "h2o"
    description = "heavy hitters by accumulated attention + recent window"
    Params = H2OParams
    needs = frozenset({"colsum"})
    state = {"acc": torch.float32}

    @property
    def additive(self) -> bool:  # a decay weighs a chunk's queries alike: additive only without one
        return self.params.decay == 1.0

    def observe(self, state: dict[str, torch.Tensor], stats: AttentionStats) -> None:
        if self.params.decay < 1.0:
            state["acc"].mul_(torch.pow(self.params.decay, stats.queries.float())[:, None, None])
        state["acc"] += stats.colsum

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        heavy = state["acc"]
        if self.params.accumulate == "mean":
            # every query since a token entered the cache attended to it
            heavy = heavy / (view.seen[:, None, None] - view.positions).clamp(min=1).float()
        recent = torch.round(view.budget.double() * self.params.recent_ratio).long()
        return torch.where(view.recent_mask(recent), torch.inf, heavy)

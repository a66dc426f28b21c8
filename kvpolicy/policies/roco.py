"""RoCo (Ren & Zhu, "On the Efficacy of Eviction Policy for Key-Value Constrained Generative
Language Model Inference", 2024; EasyKV's `roco`, formerly `h2o_head_std_avg`).

Score: per (KV head, token) the temporal mean attention mu[j] = S[j] / c[j] and its
standard deviation sigma[j] = sqrt(Q[j] / c[j] - mu[j]^2), with S the sum of the attention
(averaged over the G query heads: the GQA rule), Q the sum of its square (the backend's
`colsum_sq` squares each query head's attention before the G-mean, so for GQA sigma also
holds the spread between the G heads; EasyKV squares the G-mean; equal for MHA), and c[j]
the queries that attended j since it entered (its age: every later query attends it,
which does not hold under sliding-window attention).
The eviction scope is the cache minus its P least stable tokens (largest sigma), with
P = `sink_length` + floor(`recent_ratio` x budget); the first `sink_length` tokens and the
last `recent_tokens` tokens count as infinitely unstable, so they are protected first
(when P is smaller than their number, the older of them fall into the scope).
Inside the scope the lowest mu goes; outside it every token is pinned.

EasyKV fixes the scope at K = B - r - sinks tokens and evicts `stride` tokens per step;
here the scope is "all but P", so that one call may evict any number of tokens (a whole
prompt at once, with every prompt query's attention observed), while a call that is one
token over budget (a decode step) follows EasyKV's rule exactly. EasyKV's amortized
`stride` is the budget's `slack` (stride = slack + 1). EasyKV's `decoding` mode, which
keeps the prompt whole and budgets generated tokens only with r = 0.3 B, is not
reproduced: a kvpolicy budget covers the whole cache. Ties in sigma: the older token
enters the scope first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import AttentionStats, Policy, TokenView


@dataclass(frozen=True)
class RoCoParams:
    recent_ratio: float = 0.1  # share of the budget outside the scope for the least stable tokens
    sink_length: int = 4  # first tokens always protected (EasyKV `temp_length`)
    recent_tokens: int = 10  # newest tokens always protected (hard-coded 10 in EasyKV)

    def validate(self) -> None:
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError("recent_ratio must be in [0, 1]")
        if self.sink_length < 0 or self.recent_tokens < 0:
            raise ValueError("sink_length and recent_tokens must be >= 0")


class RoCo(Policy):
    name = "roco"
    description = "lowest temporal mean attention among the most stable tokens (lowest std); sinks kept"
    Params = RoCoParams
    needs = frozenset({"colsum", "colsum_sq"})
    state = {"sum": torch.float32, "sq": torch.float32}
    additive = True

    def observe(self, state: dict[str, torch.Tensor], stats: AttentionStats) -> None:
        state["sum"] += stats.colsum
        state["sq"] += stats.colsum_sq

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        p = self.params
        seen = (view.seen[:, None, None] - view.positions).clamp(min=1).float()
        mean = state["sum"] / seen
        std = (state["sq"] / seen - mean.square()).clamp(min=0).sqrt()
        forced = (view.positions < p.sink_length) | view.recent_mask(torch.full_like(view.budget, p.recent_tokens))
        key = torch.where(view.valid, torch.where(forced, torch.inf, std), torch.nan)  # invalid slots sort last
        by_age = view.positions.argsort(dim=2, stable=True)
        order = by_age.gather(2, key.gather(2, by_age).argsort(dim=2, stable=True))  # most stable first
        protected = torch.minimum(p.sink_length + (view.budget.double() * p.recent_ratio).floor().long(), view.budget)
        scope = view.valid.sum(dim=2) - protected  # [B, Hkv] tokens in the scope
        rank = torch.empty_like(order).scatter_(2, order, torch.arange(order.shape[2], device=order.device).expand_as(order))
        return torch.where(rank < scope[..., None], mean, torch.inf)

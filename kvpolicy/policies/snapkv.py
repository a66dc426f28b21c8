"""SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024).

Score, set by each *prompt call* (an attention call in which a batch row has more than
`window` real queries, i.e. the prefill): the observation window is that call's last
`window` queries; every older cached token j gets s[j] = sum over those queries of their
attention to j (averaged over the G query heads of its KV head), smoothed by 1-D pooling
over neighbouring prompt tokens (`kernel`, `pooling` avg|max, same zero padding; taken over
the surviving prompt tokens in position order). The cache keeps the top-(budget - window)
of them plus the whole window, which is ranked above every scored token.

Decode steps (calls with at most `window` real queries, e.g. generation) are not scored.
The paper never evicts then (its cache grows by one token per generated token), but a
kvpolicy budget caps the whole cache at every step, so something must give:

* ``decode: keep`` (default): generated tokens rank with the window, above every scored
  prompt token, so each new token displaces the weakest remaining prompt token and the
  prompt part is what is compressed further. (The paper's growing cache is reproduced
  for n generated tokens by a budget ``slack`` >= n, when the prompt is longer than
  budget + slack: the prompt is compressed to the budget, then the cache grows.)
* ``decode: evict_oldest``: after the first decode step every token ranks by recency, so
  the cache becomes a sliding window that drops the oldest token first.

The returned score is a rank: scored prompt tokens by (pooled score, position), so equal
pooled scores drop the older token first; then the window and generated tokens, by
recency. They are "pinned" by ranking above every prompt token rather than by +inf, so a
budget below window + generated tokens keeps the newest of them instead of an arbitrary
tie-break.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import AttentionStats, Policy, TokenView, ranks

PROMPT, PINNED = 1.0, 2.0  # token kinds: scored prompt token, pinned by recency; 0 = just appended


@dataclass(frozen=True)
class SnapKVParams:
    window: int = 32  # observation window: the prompt's last queries, kept whole
    kernel: int = 5  # pooling width over neighbouring tokens (odd)
    pooling: str = "avg"  # "avg" (SnapKV code) or "max" (LongBench configs)
    decode: str = "keep"  # what generated tokens do once the budget binds: "keep" or "evict_oldest"

    def validate(self) -> None:
        if self.window < 1:
            raise ValueError("window must be >= 1")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError("kernel must be an odd number >= 1")
        if self.pooling not in ("avg", "max"):
            raise ValueError('pooling must be "avg" or "max"')
        if self.decode not in ("keep", "evict_oldest"):
            raise ValueError('decode must be "keep" or "evict_oldest"')


class SnapKV(Policy):
    name = "snapkv"
    description = "prompt tokens the last `window` prompt queries attend to (pooled), plus that window"
    Params = SnapKVParams
    needs = frozenset({"last_rows"})
    state = {"obs": torch.float32, "kind": torch.float32}

    def __init__(self, params: SnapKVParams | None = None) -> None:
        super().__init__(params)
        self.last_rows_window = self.params.window

    def observe(self, state: dict[str, torch.Tensor], stats: AttentionStats) -> None:
        kind, window = state["kind"], self.params.window
        prompt = (stats.queries > window)[:, None, None]  # [B, 1, 1]: this call compresses the row
        # a prompt call scores every cached token by its window and pins the window itself: the
        # call's last `window` slots (real tokens: a batch is left-padded)
        is_window = torch.zeros_like(kind, dtype=torch.bool)
        is_window[..., kind.shape[-1] - window :] = True
        state["obs"].copy_(torch.where(prompt, stats.last_rows.sum(dim=2), state["obs"]))
        if self.params.decode == "keep":
            decoded = torch.where(kind == 0, PINNED, kind)  # tokens appended now rank with the window
        else:
            decoded = torch.full_like(kind, PINNED)  # from the first decode step on: recency alone
        kind.copy_(torch.where(prompt, torch.where(is_window, PINNED, PROMPT), decoded))

    def pooled(self, state: dict[str, torch.Tensor], view: TokenView) -> tuple[torch.Tensor, torch.Tensor]:
        """(scored, pooled): which slots hold scored prompt tokens, and their pooled window attention."""
        kind, positions = state["kind"], view.positions
        scored = view.valid & (kind == PROMPT)
        # pool over the scored tokens in position order: sort them to the front, pool, scatter back
        order = torch.where(scored, positions, torch.iinfo(torch.long).max).argsort(dim=2)
        obs = torch.where(scored, state["obs"], 0.0).gather(2, order)
        flat, pad = obs.reshape(-1, 1, obs.shape[-1]), self.params.kernel // 2
        if self.params.pooling == "avg":
            pooled = F.avg_pool1d(flat, self.params.kernel, stride=1, padding=pad, count_include_pad=True)
        else:
            pooled = F.max_pool1d(F.pad(flat, (pad, pad)), self.params.kernel, stride=1)
        return scored, torch.empty_like(obs).scatter_(2, order, pooled.view_as(obs))

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        scored, pooled = self.pooled(state, view)
        positions = view.positions
        # rank by (pooled score, position): equal pooled scores (few prompt tokens left) drop the older first
        rank = ranks(pooled, positions, dim=2, dtype=torch.float32)
        slots = rank.shape[2]
        return torch.where(scored, rank, slots + positions.float())  # window/generated: above all, by recency

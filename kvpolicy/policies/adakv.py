"""AdaKV (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation", 2024).

SnapKV's scoring (`snapkv.py`: pooled attention of the prompt's last `window` queries, the
window and generated tokens pinned) with the budget split among the KV heads of a layer
instead of an equal share each. Per batch row, over the heads this policy owns in a layer
(budget b each, so H * b in all):

1. every head keeps its own best floor(alpha * b) tokens, in its own SnapKV order (pinned
   tokens first, so a head keeps at least its pinned window whatever alpha);
2. the rest of the H * b go to the best remaining (head, token) pairs of the whole layer, by
   pooled score (pinned tokens above every scored one); ties: the newer token, then the
   lower head.

A head's budget is the number of tokens it got; the cache fixes these budgets at the row's
first eviction (the prefill, when the prompt is over budget) and keeps them while decoding,
where new tokens behave as in SnapKV (``decode: keep`` or ``evict_oldest``). The per-token
scores are SnapKV's; only the split differs. Each KV head's scores are already the mean over
its G query heads (the GQA rule), so a (head, token) pair is a KV head and a token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import TokenView, ranks, sort_order
from .snapkv import SnapKV, SnapKVParams


@dataclass(frozen=True)
class AdaKVParams(SnapKVParams):
    alpha: float = 0.2  # share of each head's budget it keeps whatever the other heads score (the floor)

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError("alpha must be in [0, 1]")


class AdaKV(SnapKV):
    name = "adakv"
    description = "SnapKV scores with head-wise budgets: a floor per head, the rest to the layer's best (head, token)"
    Params = AdaKVParams
    allocates = True

    def allocate(self, state: dict[str, torch.Tensor], view: TokenView, cells: torch.Tensor) -> torch.Tensor:
        valid, budget = view.valid, view.budget
        batch, heads, slots = valid.shape
        scored, pooled = self.pooled(state, view)
        # 1. each head's floor, taken in its own order (SnapKV's rank; pinned tokens first)
        own = self.score(state, view).masked_fill(~valid, -torch.inf)
        place = ranks(own, dim=2, descending=True)
        floor = torch.floor(budget.double() * self.params.alpha).long()
        pinned = (valid & ~scored).sum(dim=2)
        forced = torch.minimum(torch.maximum(floor, pinned), budget).clamp(max=valid.sum(dim=2))
        forced = torch.where(cells, forced, 0)
        free = valid & cells[..., None] & (place >= forced[..., None])
        # 2. the rest of the row's total to the layer's best remaining (head, token) pairs
        rest = torch.where(cells, budget, 0).sum(dim=1) - forced.sum(dim=1)  # [B]
        key = torch.where(scored, pooled, torch.inf).masked_fill(~free, -torch.inf).reshape(batch, -1)
        positions = view.positions.reshape(batch, -1)
        best = sort_order(key, positions, dim=1, descending=True)  # ties: the newer, then the lower head
        rank = torch.arange(heads * slots, device=key.device)
        take = (rank < rest[:, None]) & (key.gather(1, best) > -torch.inf)
        chosen = torch.zeros_like(take).scatter_(1, best, take).view(batch, heads, slots)
        return torch.where(cells, forced + chosen.sum(dim=2), budget)

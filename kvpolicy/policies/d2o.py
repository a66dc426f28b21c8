"""D2O (Wan et al., ICLR'25, arXiv 2406.13035): H2O that merges what it evicts, under budgets set per layer.

Tokens rank as in H2O (accumulated attention; `recent_ratio` of the budget pinned to the newest).

Layer budgets: a KV head's sparsity is 1 - n_eff / n, n_eff = 1 / sum(p^2) for p its accumulated
attention over its n tokens as a distribution (0 when even, towards 1 when concentrated; a
monotone function of p's variance that compares across layers). A layer's weight is exp(-its
heads' mean sparsity); its budget the recipe's times its weight over the mean weight of the
layers (the paper's softmax over layers, `view.layer_share`), set once every layer has given its weight.
`sparsity: head_range` reads a layer's sparsity as the authors' code does instead: each KV head's variance of
accumulated attention, min-max normalized over the layer's heads, averaged.

Merging: each evicted token finds the kept token of its KV head whose key is most similar
(cosine u). Each head keeps a threshold, an EMA of the mean best similarity at each eviction
(tau <- ema_keep * tau + ema_new * mean, started by the first eviction's mean). A token with u >= tau
merges into its match with weight exp(u), the match weighing e (exp of its similarity with
itself): the match's K and V become the weighted mean. Below tau the token is dropped.

Two departures from the paper, off by default: `keep_mass` scales both weights by the tokens each side
already stands for, and `proportional` lets a merged slot draw the attention of all its tokens
(log n added to its logits), which the paper's merge loses (docs/policies/d2o.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import MergePlan, TokenView
from .h2o import H2O, H2OParams


@dataclass(frozen=True)
class D2OParams(H2OParams):
    # weight of the previous threshold in its EMA (the authors' code: alpha 0.5)
    ema_keep: float = 0.5
    # weight of this eviction's mean best similarity (the authors' code: beta 0.5)
    ema_new: float = 0.5
    # false: every layer keeps the recipe's budget (merging alone)
    layer_budgets: bool = True
    # how a layer's sparsity is read from its heads' accumulated attention: "effective" (1 - effective tokens / tokens,
    # averaged over the KV heads: comparable across layers); "head_range" (the authors' code: each head's variance,
    # min-max normalized over the layer's KV heads, averaged: exact for multi-head attention, flat with 1 or 2 KV heads)
    sparsity: str = "effective"
    # false: evicted tokens are dropped (the layer budgets alone)
    merge: bool = True
    # true: a kept token weighs e times the tokens it already stands for (itself and those merged into it), so that
    # repeated merges do not wash it out; false: e, as the paper's formula
    keep_mass: bool = False
    # true: a slot standing for n tokens draws attention as n copies of its key would (log n added to its logits), so
    # merging keeps the attention its tokens drew together; false: it counts once in softmax, as in the paper
    proportional: bool = False

    def validate(self) -> None:
        super().validate()
        if not (self.ema_keep >= 0 and self.ema_new > 0):
            raise ValueError("ema_keep must be >= 0 and ema_new > 0")
        if self.sparsity not in ("effective", "head_range"):
            raise ValueError(f"sparsity must be \"effective\" or \"head_range\", not {self.sparsity!r}")


class D2O(H2O):
    name = "d2o"
    description = "H2O that merges evicted tokens into their most similar kept ones, budgets set per layer"
    Params = D2OParams
    state = {"acc": torch.float32}
    cell_state = {"threshold": torch.float32, "started": torch.bool}
    merges = True
    weighs_layers = True
    allocates = True

    def __init__(self, params: D2OParams | None = None) -> None:
        super().__init__(params)
        self.proportional_attention = self.params.proportional
        if not self.params.layer_budgets:  # the recipe's budget everywhere: no weights to compute, nothing to split
            self.weighs_layers = self.allocates = False

    def layer_weight(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        acc = torch.where(view.valid, state["acc"], 0.0).double()
        count = view.valid.sum(dim=2).clamp(min=1)
        if self.params.sparsity == "head_range":
            variance = ((acc - acc.sum(dim=2, keepdim=True) / count[..., None]) ** 2).masked_fill(~view.valid, 0.0)
            variance = variance.sum(dim=2) / (count - 1).clamp(min=1)  # [B, Hkv], unbiased as torch.var
            low, high = variance.min(dim=1, keepdim=True).values, variance.max(dim=1, keepdim=True).values
            return torch.exp(-((variance - low) / (high - low + 1e-6)).mean(dim=1)).float()
        share = acc / acc.sum(dim=2, keepdim=True).clamp(min=1e-12)  # each head's attention as a distribution
        effective = 1.0 / (share**2).sum(dim=2).clamp(min=1e-12)  # tokens it would spread evenly over
        sparsity = 1.0 - effective / count
        return torch.exp(-sparsity.mean(dim=1)).float()

    def allocate(self, state: dict[str, torch.Tensor], view: TokenView, cells: torch.Tensor) -> torch.Tensor | None:
        if view.layer_share is None:  # not every layer has given its weight yet
            return None
        return torch.round(view.budget.double() * view.layer_share.double()[:, None]).long().clamp(min=1)

    def merge(self, state: dict[str, torch.Tensor], view: TokenView, keys: torch.Tensor,
              kept: torch.Tensor) -> MergePlan:
        leaving = view.valid & ~kept
        counts = leaving.sum(dim=2, keepdim=True)
        width = int(counts.max())
        order = torch.sort((~leaving).to(torch.int8), dim=2, stable=True).indices[..., :width]  # leaving slots first
        present = torch.arange(width, device=keys.device) < counts
        keys = keys.float()
        gone = F.normalize(keys.gather(2, order[..., None].expand(-1, -1, -1, keys.shape[-1])), dim=-1)
        # cosine: the leaving keys normalized, every slot's dot product divided by its norm (no normalized copy of
        # the layer's keys at each step)
        norms = torch.linalg.vector_norm(keys, dim=-1).clamp(min=1e-12)[:, :, None, :]
        similarity = ((gone @ keys.transpose(-1, -2)) / norms).masked_fill(~kept[:, :, None, :], -torch.inf)
        best, match = similarity.max(dim=-1)  # [B, Hkv, M]
        mean = torch.where(present, best, 0.0).sum(dim=2) / counts[..., 0].clamp(min=1)
        evicting, started, tau = counts[..., 0] > 0, state["started"], state["threshold"]
        updated = torch.where(started, self.params.ema_keep * tau + self.params.ema_new * mean, mean)
        tau.copy_(torch.where(evicting, updated, tau))
        started |= evicting
        merged = present & (best >= tau[..., None]) & self.params.merge
        target = torch.full_like(view.positions, -1).scatter_(2, order, torch.where(merged, match, -1))
        if not self.params.keep_mass:
            weight = torch.zeros_like(state["acc"]).scatter_(2, order, torch.where(merged, best.exp(), 0.0))
            return MergePlan(target=target, weight=weight, self_weight=torch.full_like(weight, math.e))
        mass = view.merged  # tokens already merged into each slot (the cache counts them)
        carried = torch.where(merged, 1.0 + mass.gather(2, order), 0.0)
        weight = torch.zeros_like(mass).scatter_(2, order, torch.where(merged, best.exp(), 0.0) * carried)
        self_weight = math.e * (1.0 + mass)
        return MergePlan(target=target, weight=weight, self_weight=self_weight)

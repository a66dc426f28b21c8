"""`LayerLedger`: how much of the model's budget each layer of one cache gets, from its policies' weights (D2O).

A layer's share is its weight over the mean weight of all the layers that give one, asked only
once every one of them has reported: until then a layer evicts to the recipe's budget and its
share waits. Fed token by token or in chunks, every layer has reported by the first eviction;
a prompt in one forward pass evicts each layer before the layers above have seen the prompt,
so the shares are fixed at the next pass (the first generated token). Deciding earlier, from
the layers below alone, made the total drift (0.88x the recipe's on a 4,000-token prompt,
weights falling with depth). A batch row's weights stop changing once its budgets are set.
"""

from __future__ import annotations

import torch


class LayerLedger:
    def __init__(self, layers: set[int]) -> None:
        self.layers = frozenset(layers)  # the layers that give a weight
        self.weights: dict[int, torch.Tensor] = {}  # layer -> [B] float, its policies' latest weight

    @property
    def complete(self) -> bool:
        """Every layer that gives a weight has given one."""
        return self.layers <= self.weights.keys()

    def report(self, layer: int, weight: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """The layer's weight [B] for ``rows`` [B] bool (None: all); the other rows keep theirs."""
        weight, before = weight.detach().float(), self.weights.get(layer)
        if rows is not None and before is not None and before.shape == weight.shape:
            weight = torch.where(rows.to(weight.device), weight, before)
        self.weights[layer] = weight

    def forget(self, layer: int) -> None:
        self.weights.pop(layer, None)

    def share(self, layer: int) -> torch.Tensor | None:
        """[B]: the layer's weight over the mean weight of the layers, or None until every layer reported one."""
        own = self.weights.get(layer)
        if own is None or not self.complete:
            return None
        known = torch.stack([w.to(own.device) for w in self.weights.values() if w.shape == own.shape])
        return own / known.mean(dim=0).clamp(min=1e-12)

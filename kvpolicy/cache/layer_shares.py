"""`LayerLedger`: how much of the model's budget each layer of one cache gets, from its policies' weights (D2O).

Layers evict as the prompt leaves them, before the layers above have seen it: a layer's share
is its weight over the mean weight of the layers that gave one so far (the layers below it in
this pass, the layers above it from the passes before). With the whole prompt in one pass the
first layer is compared with itself alone; fed in chunks, every layer is compared with all. A
batch row's weights stop changing once its budgets are set.
"""

from __future__ import annotations

import torch


class LayerLedger:
    def __init__(self) -> None:
        self.weights: dict[int, torch.Tensor] = {}  # layer -> [B] float, its policies' latest weight

    def report(self, layer: int, weight: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """The layer's weight [B] for ``rows`` [B] bool (None: all); the other rows keep theirs."""
        weight, before = weight.detach().float(), self.weights.get(layer)
        if rows is not None and before is not None and before.shape == weight.shape:
            weight = torch.where(rows.to(weight.device), weight, before)
        self.weights[layer] = weight

    def forget(self, layer: int) -> None:
        self.weights.pop(layer, None)

    def share(self, layer: int) -> torch.Tensor | None:
        """[B]: the layer's weight over the mean of the weights reported, or None before it reported one."""
        own = self.weights.get(layer)
        if own is None:
            return None
        known = torch.stack([w.to(own.device) for w in self.weights.values() if w.shape == own.shape])
        return own / known.mean(dim=0).clamp(min=1e-12)

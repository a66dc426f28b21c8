"""`LayerLedger`: how much of the model's budget each layer of one cache gets, from its policies' weights (D2O).

A layer's share is its weight over the mean weight of all the layers that give one, asked only
once every one of them has reported: until then a layer evicts to the recipe's budget and its
share waits. Fed token by token or in chunks, every layer has reported by the first eviction;
a prompt in one forward pass evicts each layer before the layers above have seen the prompt,
so the shares are fixed at the next pass (the first generated token). Deciding earlier, from
the layers below alone, made the total drift (0.88x the recipe's on a 4,000-token prompt,
weights falling with depth). A batch row's weights stop changing once its budgets are set.

A layer may report its tokens' scores instead of a weight (`Policy.ranks_across_layers`, `report_scores`): its
weight is then how many of its tokens are among the model's best, every layer's scores ranked together against the
model's total budget, so the shares give each layer the tokens a model-wide ranking would keep there.
"""

from __future__ import annotations

import torch


class LayerLedger:
    def __init__(self, layers: set[int]) -> None:
        self.layers = frozenset(layers)  # the layers that give a weight
        self.weights: dict[int, torch.Tensor] = {}  # layer -> [B] float, its policies' latest weight
        # layer -> ([B, N] scores, -inf: no token; [B] tokens its budget keeps; [B] rows it reports for), for layers
        # that rank across layers; ranked when a share is next asked, once every layer has reported
        self.scores: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self.unranked = False
        # the layers' mean weight per (shape, device), kept until a weight changes: every layer asks at every call
        self._means: dict[tuple, torch.Tensor] = {}

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
        self._means.clear()

    def report_scores(self, layer: int, scores: torch.Tensor, budget: torch.Tensor,
                      rows: torch.Tensor | None = None) -> None:
        """The layer's token scores [B, N] (-inf: not a token; +inf: pinned) and the tokens [B] its budget keeps, for
        ``rows``: its weight becomes the count of its tokens at or above the model-wide threshold, once every layer
        has reported (ranked when a share is next asked: layers report again and again before one is)."""
        self.scores[layer] = (scores.detach().float(), budget.detach().long(), rows)
        self.unranked = True

    def _rank(self) -> None:
        """Each layer's weight from the model-wide ranking: per row, the threshold is the k-th best score over every
        layer (k: the layers' budgets summed), and a layer weighs the count of its scores at or above it."""
        layers = sorted(self.scores)
        device = self.scores[layers[0]][0].device
        pooled = torch.cat([self.scores[layer][0].to(device) for layer in layers], dim=1)  # [B, sum N]
        total = torch.stack([self.scores[layer][1].to(device) for layer in layers]).sum(dim=0)  # [B]
        ranked = pooled.sort(dim=1, descending=True).values
        index = (total - 1).clamp(min=0, max=ranked.shape[1] - 1)
        threshold = ranked.gather(1, index[:, None])  # [B, 1]
        for layer in layers:
            scores, _, rows = self.scores[layer]
            count = (scores.to(device) >= threshold).sum(dim=1).float().clamp(min=1e-3)
            self.report(layer, count, rows)
        self.unranked = False

    def forget(self, layer: int) -> None:
        self.weights.pop(layer, None)
        self.scores.pop(layer, None)
        self._means.clear()

    def share(self, layer: int) -> torch.Tensor | None:
        """[B]: the layer's weight over the mean weight of the layers, or None until every layer reported one."""
        if self.unranked and self.layers <= self.scores.keys():
            self._rank()
        own = self.weights.get(layer)
        if own is None or not self.complete:
            return None
        key = (tuple(own.shape), own.device)
        if key not in self._means:
            known = torch.stack([w.to(own.device) for w in self.weights.values() if w.shape == own.shape])
            self._means[key] = known.mean(dim=0).clamp(min=1e-12)
        return own / self._means[key]

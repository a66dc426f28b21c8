"""KVzip with one ranking over the whole model (``kvzip-global``), as KVzip's authors prune.

The probe's scores (`kvzip.py`) are probabilities, comparable across layers as well as heads, so the model's whole
budget (every layer's heads x budget) goes to its best (layer, KV head, token) triples: each layer keeps as many
tokens as it wins in that ranking (`LayerLedger.report_scores`: every layer reports its scores once the probe is
over, before any evicts), split among its heads as ``kvzip-ada`` splits a layer's budget. A layer the repetition
leans on keeps more than the recipe's share, one it ignores keeps less; the model's total stays the recipe's.
Layers keep different counts, so storage is ragged; it costs a sort of the model's scores once per prompt.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import TokenView
from .kvzip import HeadSplit, KVzip, KVzipAdaParams


class ModelSplit(HeadSplit):
    """`HeadSplit` whose layer total is the layer's share of a model-wide ranking of ``score``."""

    weighs_layers = ranks_across_layers = True

    def allocate(self, state: dict[str, torch.Tensor], view: TokenView, cells: torch.Tensor) -> torch.Tensor | None:
        if view.layer_share is None:  # not every layer has ranked its tokens yet
            return None
        heads = cells.sum(dim=1).clamp(min=1)
        total = torch.round(torch.where(cells, view.budget, 0).sum(dim=1).double() * view.layer_share.double())
        total = torch.maximum(total.long(), heads)  # a token per head at least: attention needs one
        order = cells.long().cumsum(dim=1) - 1  # each head's rank among the layer's cells
        even = total[:, None] // heads[:, None] + (order < (total % heads)[:, None]).long()
        # only the layer's total matters to the split below (no floor per head: alpha 0, KVzip's)
        return super().allocate(state, dataclasses.replace(view, budget=torch.where(cells, even, view.budget)), cells)


class KVzipGlobal(ModelSplit, KVzip):
    name = "kvzip-global"
    description = "KVzip's scores ranked over the whole model: each layer and head keeps the model's best tokens it holds"
    Params = KVzipAdaParams
    pinned_from = 2.0  # sinks and the tokens after the prompt

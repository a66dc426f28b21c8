"""Full cache: keep every token (the baseline every other policy is measured against)."""

from __future__ import annotations

import torch

from .base import Policy, TokenView


class Full(Policy):
    name = "full"
    description = "keep every token; budgets do not apply"
    evicts = False

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        return torch.where(view.valid, torch.inf, -torch.inf)

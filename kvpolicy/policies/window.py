"""Window: keep only the most recent tokens (the "Local" baseline of the H2O paper)."""

from __future__ import annotations

import torch

from .base import Policy, TokenView


class Window(Policy):
    name = "window"
    description = "the most recent `budget` tokens; no attention statistics"

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        return view.positions.float()  # newer tokens score higher

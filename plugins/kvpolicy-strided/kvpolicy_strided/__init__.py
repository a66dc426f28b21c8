"""kvpolicy plugin: ``strided``, the fixed-pattern baseline of the H2O paper (Sparse Transformer, strided).

Keeps the first ``sinks`` tokens, the most recent ``recent_ratio`` share of the budget,
and every ``stride``-th older token (positions 0, stride, 2*stride, ...), newest first,
until the budget is full. No attention statistics are read (plain SDPA, no tracking
cost) and no per-token state is kept: the score is a function of positions only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kvpolicy
from kvpolicy import Policy, TokenView

__version__ = "0.1.0"


@dataclass(frozen=True)
class StridedParams:
    sinks: int = 4  # first tokens always kept (attention sinks)
    stride: int = 4  # keep every stride-th older token
    recent_ratio: float = 0.5  # share of the budget pinned to the most recent tokens

    def validate(self) -> None:
        if self.sinks < 0:
            raise ValueError("sinks must be >= 0")
        if self.stride < 1:
            raise ValueError("stride must be >= 1")
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError("recent_ratio must be in [0, 1]")


class Strided(Policy):
    name = "strided"
    description = "sinks + recent window + every stride-th older token; no attention statistics"
    Params = StridedParams

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        positions = view.positions
        # Older tokens on the stride outrank every token off it (position < seen), newest first in each class.
        on_stride = view.valid & (positions % self.params.stride == 0)
        offset = (view.seen[:, None, None] + 1).to(positions.dtype)
        score = (positions + torch.where(on_stride, offset, 0)).float()
        recent = torch.round(view.budget.double() * self.params.recent_ratio).long()
        pinned = view.valid & ((positions < self.params.sinks) | view.recent_mask(recent))
        return torch.where(pinned, torch.inf, score)


@kvpolicy.hookimpl
def kvpolicy_register_policies() -> list[type]:
    return [Strided]

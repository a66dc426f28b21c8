"""StreamingLLM (Xiao et al., ICLR'24): the first `sinks` tokens plus the most recent ones.

Keys keep their original RoPE positions (as kvpress and KVCache-Factory do); the
paper's re-assigned in-cache positions are not implemented yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, TokenView


@dataclass(frozen=True)
class StreamingParams:
    sinks: int = 4  # attention-sink tokens kept from the start of each sequence

    def validate(self) -> None:
        if self.sinks < 0:
            raise ValueError("sinks must be >= 0")


class Streaming(Policy):
    name = "streaming"
    description = "`sinks` first tokens + the most recent ones; no attention statistics"
    Params = StreamingParams

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        recency = view.positions.float()
        return torch.where(view.positions < self.params.sinks, torch.inf, recency)

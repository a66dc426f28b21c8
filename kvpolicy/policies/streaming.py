"""StreamingLLM (Xiao et al., ICLR'24): the first `sinks` tokens plus the most recent ones.

``positions: original`` (default) keeps each key at its original RoPE position, as
kvpress and KVCache-Factory do. ``positions: in_cache`` is the paper's method: at every
attention call keys are re-rotated to their index within the cache and the query to
its own, so positions never exceed the cache size (O(cache x head_dim) per call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, TokenView


@dataclass(frozen=True)
class StreamingParams:
    sinks: int = 4  # attention-sink tokens kept from the start of each sequence
    positions: str = "original"  # or "in_cache": RoPE positions re-assigned within the cache (the paper)

    def validate(self) -> None:
        if self.sinks < 0:
            raise ValueError("sinks must be >= 0")
        if self.positions not in ("original", "in_cache"):
            raise ValueError('positions must be "original" or "in_cache"')


class Streaming(Policy):
    name = "streaming"
    description = "`sinks` first tokens + the most recent ones; no attention statistics"
    Params = StreamingParams

    def __init__(self, params: StreamingParams | None = None) -> None:
        super().__init__(params)
        self.in_cache_positions = self.params.positions == "in_cache"

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        recency = view.positions.float()
        return torch.where(view.positions < self.params.sinks, torch.inf, recency)

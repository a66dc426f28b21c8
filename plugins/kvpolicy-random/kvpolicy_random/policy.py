"""The random-eviction baseline of the H2O paper (Zhang et al., 2023, ablation "Random").

Every token gets a fixed pseudo-random keep-priority, a hash of (seed, KV head, position).
Because the priority never changes, keeping the top `budget` priorities at each eviction
keeps a uniformly random subset of the tokens seen (older than the protected recent window),
and an evicted token could never have come back: the choice is the same as drawing the
subset once at the end. No attention statistics, no per-token state, reproducible by seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpolicy import Policy, TokenView

_MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27, so a 32-bit value times it fits in int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) on int64 tensors in [0, 2**32)."""
    x = ((x >> 16) ^ x) * _MUL & _MASK32
    x = ((x >> 16) ^ x) * _MUL & _MASK32
    return (x >> 16) ^ x


@dataclass(frozen=True)
class RandomParams:
    seed: int = 0  # seed of the random choice; the same seed keeps the same tokens
    recent: int = 0  # most recent tokens always kept (at most the budget)

    def validate(self) -> None:
        if not 0 <= self.seed <= _MASK32:
            raise ValueError("seed must be in [0, 2**32 - 1]")
        if self.recent < 0:
            raise ValueError("recent must be >= 0")


class RandomEviction(Policy):
    name = "random"
    description = "a uniformly random (seeded) subset of the tokens + `recent` newest; no attention statistics"
    Params = RandomParams

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        positions = view.positions  # [B, Hkv, T], -1 for an empty slot
        heads = torch.arange(positions.shape[1], device=positions.device, dtype=torch.int64)
        key = _mix32(torch.tensor(self.params.seed, dtype=torch.int64, device=positions.device))
        key = _mix32(key ^ heads)[None, :, None]  # one stream per KV head
        priority = _mix32(key ^ (positions.long() & _MASK32)) >> 8  # 24 bits: exact in float32
        recent = torch.clamp(view.budget.long(), max=self.params.recent)
        pinned = view.valid & view.recent_mask(recent)
        return torch.where(pinned, torch.inf, priority.float())

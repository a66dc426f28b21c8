"""Expected attention (Devoto et al. 2025, kvpress's ExpectedAttentionPress): the attention the queries still to
come are expected to pay each cached token, with no question and no extra pass.

The queries seen so far (their rotation taken off, times the layer's scaling; the sinks' outlier queries left out)
give each query head a mean m and a covariance S (`query_moments`). A query at a future position is one of them
rotated there; the rotation averaged over the next `future_positions` positions, R, turns them into a Gaussian
N(R m, R S R^T), whose expected exp(q . k) is exp(k . R m + k^T R S R^T k / 2) (its moment generating function).
Score: that, normalized over a head's cached tokens but the sinks, averaged over the G query heads of each KV head,
times the token's value norm (a small value moves the output little); the first `sinks` tokens are pinned. It reads
no attention, only the keys and values at each eviction: cheap enough to rescore at every decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import AttentionStats, CellArray, Policy, TokenView


@dataclass(frozen=True)
class ExpectedAttentionParams:
    future_positions: int = 512  # the queries expected: the next this-many positions (kvpress: 512)
    sinks: int = 4  # the first tokens, pinned; their queries stay out of the moments
    covariance: bool = True  # False: the mean query alone (no [G, D, D] state per KV head)
    value_norm: bool = True  # weigh the expected attention by the token's value norm
    epsilon: float = 0.0  # added to the normalized expected attention before the value norm
    recent_ratio: float = 0.0  # share of the budget pinned to the newest tokens
    decay: float = 1.0  # below 1, older queries' moments fade by this factor per query seen (1: every query alike)

    def validate(self) -> None:
        if self.future_positions < 1 or self.sinks < 0 or self.epsilon < 0:
            raise ValueError("future_positions must be >= 1, sinks and epsilon >= 0")
        if not 0.0 <= self.recent_ratio <= 1.0 or not 0.0 < self.decay <= 1.0:
            raise ValueError("recent_ratio must be in [0, 1] and decay in (0, 1]")


def future_rotation(seen: torch.Tensor, count: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's rotation averaged over positions seen .. seen + count - 1 of each row: (cos, sin), [B, D] each."""
    positions = seen[:, None].double() + torch.arange(count, device=seen.device, dtype=torch.float64)
    angle = positions[..., None] * inv_freq.to(seen.device, torch.float64)
    cos, sin = angle.cos().mean(dim=1), angle.sin().mean(dim=1)
    return torch.cat([cos, cos], dim=-1).float(), torch.cat([sin, sin], dim=-1).float()


def turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The averaged rotation applied to the vectors along the last dim of ``x`` [B, ..., D] (rotate-half layout)."""
    shape = (cos.shape[0], *([1] * (x.dim() - 2)), cos.shape[1])
    first, second = x.chunk(2, dim=-1)
    return x * cos.view(shape) + torch.cat([-second, first], dim=-1) * sin.view(shape)


class ExpectedAttention(Policy):
    name = "expected-attention"
    description = "attention expected from the queries to come (moments of past queries, RoPE to future positions)"
    Params = ExpectedAttentionParams
    needs = frozenset({"query_moments"})
    reads_kv = True
    cell_state = {"count": torch.float32, "total": CellArray(torch.float32, ("groups", "head_dim")),
                  "outer": CellArray(torch.float32, ("groups", "head_dim", "head_dim"))}

    def __init__(self, params: ExpectedAttentionParams | None = None) -> None:
        super().__init__(params)
        self.query_moments_skip = self.params.sinks
        if not self.params.covariance:  # the mean alone: no [G, D, D] per KV head
            self.cell_state = {k: v for k, v in type(self).cell_state.items() if k != "outer"}

    def observe(self, state: dict[str, torch.Tensor], stats: AttentionStats) -> None:
        fade = torch.pow(self.params.decay, stats.query_count)[:, None]  # [B, 1]
        state["count"].mul_(fade).add_(stats.query_count[:, None])
        state["total"].mul_(fade[..., None, None]).add_(stats.query_sum)
        if self.params.covariance:
            state["outer"].mul_(fade[..., None, None, None]).add_(stats.query_outer)

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        p = self.params
        keys = view.keys.float()
        count = state["count"].clamp(min=1.0)[..., None, None]  # [B, Hkv, 1, 1]
        mean = state["total"] / count  # [B, Hkv, G, D]
        cos, sin = future_rotation(view.seen, p.future_positions, view.inv_freq)
        logits = torch.einsum("bhgd,bhtd->bhgt", turn(mean, cos, sin), keys)
        if p.covariance:
            spread = state["outer"] / count[..., None] - mean[..., :, None] * mean[..., None, :]
            spread = turn(turn(spread, cos, sin).transpose(-1, -2), cos, sin)  # R S R^T
            logits = logits + 0.5 * torch.einsum("bhtd,bhgde,bhte->bhgt", keys, spread, keys)
        sink = view.positions < p.sinks
        # the sinks stay out of the normalization too: their outlier logits would flatten each query head's share
        # unevenly, and so the mean over the group
        logits = logits.masked_fill(~(view.valid & ~sink)[:, :, None], -torch.inf)
        expected = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(dim=2)  # [B, Hkv, T]
        if p.value_norm:
            expected = (expected + p.epsilon) * view.values.float().norm(dim=-1)
        recent = torch.round(view.budget.double() * p.recent_ratio).long()
        pinned = sink | view.recent_mask(recent)
        return torch.where(view.valid & pinned, torch.inf, expected)

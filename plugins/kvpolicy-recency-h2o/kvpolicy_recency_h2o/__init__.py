"""kvpolicy plugin: ``recency_h2o`` (H2O whose accumulated attention fades with age) and the ``kvtokens`` task.

``recency_h2o`` keeps H2O's recent window (``recent_ratio`` of the budget) and fills the
rest with the highest *decayed* accumulated attention: before each attention call adds
its column sums, the running sum is multiplied by ``0.5 ** (queries / half_life)``, where
``queries`` is the number of real tokens the call brings. So attention received
``half_life`` tokens ago counts half as much as attention received now, the same whether
the text is fed token by token or in chunks (within one chunk the column sums are not
split by query, so a chunk's own attention is not decayed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kvpolicy
from kvpolicy import AttentionStats, Policy, TokenView

__version__ = "0.1.0"


@dataclass(frozen=True)
class RecencyH2OParams:
    half_life: float = 64.0  # tokens after which received attention counts half
    recent_ratio: float = 0.5  # share of the budget pinned to the most recent tokens

    def validate(self) -> None:
        if not self.half_life > 0:
            raise ValueError("half_life must be > 0 (tokens)")
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError("recent_ratio must be in [0, 1]")


class RecencyH2O(Policy):
    name = "recency_h2o"
    description = "H2O with accumulated attention halving every `half_life` tokens + recent window"
    Params = RecencyH2OParams
    needs = frozenset({"colsum"})
    state = {"acc": torch.float32}

    def observe(self, state: dict[str, torch.Tensor], stats: AttentionStats) -> None:
        acc = state["acc"]
        fade = torch.exp2(-stats.queries.to(acc.device, torch.float32) / self.params.half_life)  # [B]
        acc.mul_(fade[:, None, None])
        acc += stats.colsum

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        recent = torch.round(view.budget.double() * self.params.recent_ratio).long()
        return torch.where(view.recent_mask(recent), torch.inf, state["acc"])


@kvpolicy.hookimpl
def kvpolicy_register_policies() -> list[type]:
    return [RecencyH2O]


@kvpolicy.hookimpl
def kvpolicy_register_tasks() -> list:
    # imported here: the task module loads kvpolicy's tasks (and transformers), which the policy alone does not
    # need, and every kvpolicy command imports this plugin to find its policies
    from .task import KVTokens

    return [KVTokens()]


def __getattr__(name: str) -> object:
    if name == "KVTokens":  # `from kvpolicy_recency_h2o import KVTokens`, without loading it at import
        from .task import KVTokens

        return KVTokens
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

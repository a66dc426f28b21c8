"""TOVA (Oren et al., "Transformers are Multi-State RNNs", 2024): keep what the current query attends to.

Score: s[j] = the attention the *current* query (the last query of the attention call:
the decoded token, or the last prompt token at prefill) gives token j, averaged over all
the heads of the layer: the G query heads of each KV head (the backend's `last_rows`
with W = 1) and then over the layer's KV heads, so every KV head of the layer keeps the
same tokens (one layer-wide selection, natively GQA-safe). Once the cache is over budget
the lowest-scoring tokens go, the token just appended included. No sinks, no recent
window (EasyKV's variant adds both; the paper does not).

The layer-wide mean is taken per token *position*, over the KV heads holding that token,
so it stays right when the heads of a layer are not in the same slot order (e.g. when
another policy owns some heads of the layer; those heads then count in the mean too,
since a policy only sees stats for the whole layer).
"""

from __future__ import annotations

import torch

from .base import AttentionStats, Policy, TokenView


class TOVA(Policy):
    name = "tova"
    description = "the current query's attention, averaged over the layer's heads (one layer-wide choice)"
    needs = frozenset({"last_rows"})
    state = {"row": torch.float32}  # the latest call's last attention row, per KV head
    last_rows_window = 1

    def observe(self, state: dict[str, torch.Tensor], stats: AttentionStats) -> None:
        # a token appended by this call is already in the slots, so its entry exists (its self-attention)
        state["row"].copy_(stats.last_rows[:, :, -1])

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        batch, heads, slots = view.positions.shape
        # group the row's slots by token position without knowing how many positions there are (no host sync, static
        # shapes): sort the positions, number each distinct one, and sum per number
        positions = view.positions.reshape(batch, -1)
        order = positions.argsort(dim=1, stable=True)
        ordered = positions.gather(1, order)
        starts = torch.ones_like(ordered, dtype=torch.bool)
        starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        index = torch.empty_like(order).scatter_(1, order, starts.long().cumsum(dim=1) - 1)  # [B, Hkv*T]
        weight = view.valid.reshape(batch, -1).to(state["row"].dtype)
        total = torch.zeros(batch, positions.shape[1], dtype=weight.dtype, device=weight.device)
        total.scatter_add_(1, index, state["row"].reshape(batch, -1) * weight)
        holders = torch.zeros_like(total).scatter_add_(1, index, weight).clamp(min=1)
        return (total / holders).gather(1, index).view(batch, heads, slots)

"""`DenseStore`: K/V as ``[batch, kv_heads, slots, head_dim]``, every cell (batch row, KV head) as wide as the largest.

New tokens are appended at a common slot offset. Eviction keeps each cell's top-scoring
tokens and packs them into its first slots by moving the few survivors that sit past the
new length into the holes (a decode step moves one token per cell, not the whole cache).
One slot past those in use is kept free as the scratch slot that no-op moves write to.
"""

from __future__ import annotations

import torch

from .base import KVStore, Sizing, headroom, storage_bytes, top_kept
from .slots import SlotTable, move_slots, resize_slots


class DenseStore(KVStore):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, token_state: dict[str, torch.dtype], sizing: Sizing):
        """``keys``/``values``: the layer's first K/V ([B, Hkv, q, D]), for shapes, dtype and device only."""
        batch, heads = keys.shape[:2]
        self.keys = keys.new_zeros((batch, heads, 0, keys.shape[-1]))
        self.values = values.new_zeros((batch, heads, 0, values.shape[-1]))
        self.slots = SlotTable(batch, heads, keys.device, token_state)
        self.sizing = sizing
        self.used = 0
        self.packed_tokens = 0
        # (row, KV head) index of every cell, for writes that hit one slot per cell
        cells = torch.arange(batch * heads, device=keys.device).view(batch, heads)
        self._cell_index = (cells // heads, cells % heads)

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    def _reallocate(self, capacity: int) -> None:
        self.keys = resize_slots(self.keys, capacity, self.used, 0)
        self.values = resize_slots(self.values, capacity, self.used, 0)
        self.slots.resize(capacity, self.used)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        count = keys.shape[2]
        needed = self.used + count + 1  # +1: the scratch slot
        if needed > self.capacity:
            grown = needed + headroom(needed, self.sizing.budgets_grow)
            limit = self.sizing.uniform_limit
            if limit is not None:
                # every cell bounded alike: a cache streaming at its budget needs the budget, the slack, this
                # call's tokens and the scratch slot, and no more (growth past it would never be freed)
                grown = min(grown, max(needed, limit + self.sizing.slack + count + 1))
            self._reallocate(grown)
        start = self.used
        self.past_packed = self.packed_tokens is not None
        self.keys[:, :, start : start + count] = keys
        self.values[:, :, start : start + count] = values
        self.slots.open(start, count)
        self.used += count
        if self.packed_tokens is not None:
            self.packed_tokens += count
        return start

    def mark_pads(self) -> None:
        self.packed_tokens = None

    def attention_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, : self.used], self.values[:, :, : self.used]

    def evict(self, scores: torch.Tensor | None, keep: torch.Tensor, count: torch.Tensor) -> None:
        if scores is None:
            return  # nothing to drop: tokens stay where they are (gaps are masked)
        packed = int(count.min()) == self.used  # every cell's tokens fill slots [0, used)
        drop = count - keep
        if packed and int(drop.min()) == 1 and int(drop.max()) == 1:
            self.drop_one(scores.argmin(dim=2))
        else:
            self._compact(scores, keep)

    def truncate(self, used: int, packed_tokens: int | None) -> None:
        self.slots.valid[:, :, used : self.used] = False
        self.slots.positions[:, :, used : self.used] = -1
        self.used, self.packed_tokens = used, packed_tokens

    def fit(self, tokens: int) -> None:
        """Shrink to ``tokens`` + slack + room for the next token and the scratch slot, when far above it."""
        target = tokens + self.sizing.slack + 2
        if self.capacity > target + headroom(target, self.sizing.budgets_grow):
            self._reallocate(target)

    def drop_one(self, victim: torch.Tensor) -> None:
        """Evict each cell's ``victim`` slot by moving its last slot into the gap (one indexed write per tensor: half
        the time of a gather and a scatter at a decode step's shapes)."""
        last = self.used - 1
        gap = (*self._cell_index, victim)
        for tensor in (self.keys, self.values, *self.slots.tensors()):
            tensor[gap] = tensor[:, :, last]
        self.slots.valid[:, :, last] = False
        self.slots.positions[:, :, last] = -1
        self.used = last
        self.packed_tokens = last

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.keys = move_slots(self.keys, src, dst)
        self.values = move_slots(self.values, src, dst)
        self.slots.move(src, dst)

    def _compact(self, scores: torch.Tensor, keep: torch.Tensor) -> None:
        """Keep the ``keep`` [B, Hkv] best slots of each cell, packed into slots [0, keep)."""
        kept = top_kept(scores, keep)
        slot = torch.arange(scores.shape[2], device=scores.device)
        holes = ~kept & (slot < keep[..., None])  # slots to fill
        movers = kept & (slot >= keep[..., None])  # survivors that sit past the new length
        moves = int(movers.sum(dim=2).max())
        if moves:
            scratch = self.capacity - 1
            if moves == 1:
                present = movers.any(dim=2, keepdim=True)
                dst, src = holes.float().argmax(2, keepdim=True), movers.float().argmax(2, keepdim=True)
            else:
                dst = torch.sort((~holes).to(torch.int8), dim=2, stable=True).indices[..., :moves]
                src = torch.sort((~movers).to(torch.int8), dim=2, stable=True).indices[..., :moves]
                present = torch.arange(moves, device=scores.device) < movers.sum(dim=2, keepdim=True)
            self._move(torch.where(present, src, scratch), torch.where(present, dst, scratch))
        width = int(keep.max())
        self.slots.keep_first(keep, max(self.used, width))
        self.used = width
        self.packed_tokens = width if int(keep.min()) == width else None

    def flat_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.view(-1, self.keys.shape[-1]), self.values.view(-1, self.values.shape[-1])

    def slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        batch, heads = slots.shape[:2]
        cells = torch.arange(batch * heads, device=slots.device).view(batch, heads, 1)
        return cells * self.keys.shape[2] + slots

    def slot_keys(self) -> torch.Tensor:
        return self.keys[:, :, : self.used]

    def slot_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attention_kv()

    def kv_bytes(self) -> int:
        return storage_bytes(self.keys) + storage_bytes(self.values)

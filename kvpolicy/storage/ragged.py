"""`RaggedStore`: one flat K/V buffer per layer in which each cell owns a segment sized to its own budget.

Used when the cells of a layer keep different numbers of tokens (per-head budgets, AdaKV,
FastGen, ratio budgets over prompts of different lengths, a full-cache row next to evicting
ones), where equal-width storage would hold `MIN_SAVING` more than the segments:

* K and V live in ``[sum of capacities, head_dim]``; cell ``c`` owns rows
  ``[offset[c], offset[c] + cap[c])``: its budget, ``slack``, and one row for the token a decode
  step appends before it evicts. Between passes its ``cell_tokens[c]`` tokens sit at the start.
* The metadata keeps the dense `SlotTable` layout: slot ``s < cell_tokens[c]`` is row
  ``offset[c] + s``; a pass appends at the common slots ``[used, used + q)`` of the metadata
  and at rows ``offset[c] + cell_tokens[c] + i`` of each segment.
* Attention reads a dense padded copy of this one layer (a gather; cells with fewer tokens
  padded with masked slots): transient workspace, reported as such, not cache.
* After each pass each cell's tokens are packed back to the start of its segment. A decode
  step moves at most one K/V row per cell. A segment that runs out of room triggers a
  re-layout with amortized headroom; after a compaction the buffer shrinks back when it
  holds more than `MIN_SAVING` over its cells' targets.
"""

from __future__ import annotations

import torch

from .base import KVStore, Sizing, headroom, storage_bytes, top_kept
from .dense import DenseStore
from .slots import SlotTable

#: Ragged storage pays when equal-width storage would hold this much more than per-cell segments.
MIN_SAVING = 1 / 16


def ragged_pays(sizes: torch.Tensor) -> bool:
    """Whether segments of ``sizes`` [B, Hkv] save enough over equal-width storage of the largest."""
    return int(sizes.max()) * sizes.numel() > (1 + MIN_SAVING) * int(sizes.sum())


def _segments(caps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    caps = caps.clamp(min=1)
    flat = caps.reshape(-1)
    return caps, (torch.cumsum(flat, 0) - flat).view_as(caps), int(flat.sum())


class RaggedStore(KVStore):
    packed_tokens = None
    past_packed = False

    def __init__(self, slots: SlotTable, used: int, sizing: Sizing, keys: torch.Tensor, values: torch.Tensor,
                 offset: torch.Tensor, cap: torch.Tensor, cell_tokens: torch.Tensor):
        self.slots, self.used, self.sizing = slots, used, sizing
        self.keys, self.values = keys, values  # [rows, D]
        self.offset, self.cap, self.cell_tokens = offset, cap, cell_tokens  # [B, Hkv] each
        self.room = int((cap - cell_tokens).min())  # rows free in the fullest segment, between passes
        self.appended = 0  # slot of the first token appended by the current pass
        self.pass_has_pads = False
        self._view: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_dense(cls, dense: DenseStore, keep: torch.Tensor) -> RaggedStore:
        """Dense -> ragged, right after a compaction packed each cell's ``keep`` tokens into slots [0, keep)."""
        caps, offset, total = _segments(dense.sizing.segment_sizes(keep))
        width = int(keep.max())
        slot = torch.arange(width, device=keep.device)
        present = slot < keep[..., None]
        rows = (offset[..., None] + slot)[present]
        flat = []
        for tensor in (dense.keys, dense.values):
            fresh = tensor.new_zeros(total, tensor.shape[-1])
            fresh.index_copy_(0, rows, tensor[:, :, :width][present])
            flat.append(fresh)
        store = cls(dense.slots, dense.used, dense.sizing, *flat, offset, caps, keep.clone())
        store._fit_slots(width)
        return store

    def _fit_slots(self, width: int) -> None:
        target = width + self.sizing.slack + 2
        if self.slots.capacity > target + headroom(target):
            self.slots.resize(target, self.used)

    def _relayout(self, caps: torch.Tensor) -> None:
        """Move every cell's tokens into fresh segments of ``caps`` rows (grow or shrink)."""
        caps, offset, total = _segments(caps)
        tokens = self.cell_tokens
        slot = torch.arange(int(tokens.max()), device=tokens.device)
        present = slot < tokens[..., None]
        src, dst = (self.offset[..., None] + slot)[present], (offset[..., None] + slot)[present]
        flat = []
        for tensor in (self.keys, self.values):
            fresh = tensor.new_zeros(total, tensor.shape[-1])
            fresh.index_copy_(0, dst, tensor.index_select(0, src))
            flat.append(fresh)
        self.keys, self.values = flat
        self.offset, self.cap = offset, caps
        self.room = int((caps - tokens).min())

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        batch, heads, count, _ = keys.shape
        if count > self.room:
            needed = self.cell_tokens + count
            self._relayout(torch.where(self.cap >= needed, self.cap, self.sizing.grown_segments(needed)))
        start = self.used
        if start + count > self.slots.capacity:
            self.slots.resize(start + count + headroom(start + count), self.used)
        device = self.keys.device
        home = self.offset + self.cell_tokens
        rows = (home[..., None] + torch.arange(count, device=device)).reshape(-1)
        self.keys.index_copy_(0, rows, keys.reshape(-1, keys.shape[-1]).to(self.keys.dtype))
        self.values.index_copy_(0, rows, values.reshape(-1, values.shape[-1]).to(self.values.dtype))
        self.slots.open(start, count)
        self.used += count
        self.appended, self.pass_has_pads = start, False
        # slot s of a cell: its row s below its token count, then (gap: any row, masked) this pass's rows
        slot = torch.arange(self.used, device=device)
        tokens = self.cell_tokens[..., None]
        local = torch.where(slot < tokens, slot, torch.where(slot >= start, tokens + slot - start, 0))
        index = (self.offset[..., None] + local).reshape(-1)
        view = (self.keys.index_select(0, index).view(batch, heads, self.used, -1),
                self.values.index_select(0, index).view(batch, heads, self.used, -1))
        self._view = view
        self.workspace_bytes = max(self.workspace_bytes, storage_bytes(view[0]) + storage_bytes(view[1]))
        return start

    def mark_pads(self) -> None:
        self.pass_has_pads = True

    def attention_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._view

    def end_pass(self) -> None:
        self._view = None

    def evict(self, scores: torch.Tensor | None, keep: torch.Tensor, count: torch.Tensor) -> None:
        one_step = self.used - self.appended == 1 and not self.pass_has_pads
        if one_step and (scores is None or int((count - keep).max()) <= 1):
            self._step(scores, count > keep)
        else:
            self._compact(scores, keep)

    def drop_one(self, victim: torch.Tensor) -> None:
        raise NotImplementedError("the layer takes its packed decode path on dense storage only")

    def _step(self, scores: torch.Tensor | None, drop: torch.Tensor) -> None:
        """A decode step: the new token (common slot ``appended``) fills the evicted slot, or the cell's next one."""
        new, tokens, offset, slots = self.appended, self.cell_tokens, self.offset, self.slots
        if scores is None:
            victim = tokens
        else:
            victim = scores.masked_fill(~slots.valid[:, :, : self.used], torch.inf).argmin(dim=2)
        gone = drop & (victim == new)  # the new token itself is evicted
        dst = torch.where(drop, victim, tokens)
        slots.move(torch.full_like(dst, new)[..., None], dst[..., None])
        leaves = (dst != new) | gone
        slots.valid[:, :, new] &= ~leaves
        slots.positions[:, :, new].masked_fill_(leaves, -1)
        slots.valid.scatter_(2, dst[..., None], ~gone[..., None])
        rows = (offset + torch.where(drop & ~gone, victim, tokens)).reshape(-1)
        home = (offset + tokens).reshape(-1)
        for tensor in (self.keys, self.values):
            tensor.index_copy_(0, rows, tensor.index_select(0, home))
        self.cell_tokens = tokens + 1 - drop.long()
        self.used, self.room = torch.stack([self.cell_tokens.max(), (self.cap - self.cell_tokens).min()]).tolist()

    def _compact(self, scores: torch.Tensor | None, keep: torch.Tensor) -> None:
        """Keep ``keep`` [B, Hkv] tokens per cell (the best ``scores``, or every valid one when None), packed."""
        used, start = self.used, self.appended
        kept = self.slots.valid[:, :, :used] if scores is None else top_kept(scores, keep)
        width = int(keep.max())
        order = torch.sort((~kept).to(torch.int8), dim=2, stable=True).indices[..., :width]  # kept slots, in order
        present = torch.arange(width, device=keep.device) < keep[..., None]
        tokens, offset = self.cell_tokens[..., None], self.offset[..., None]
        src = offset + torch.where(order < tokens, order, tokens + order - start)
        dst = offset + torch.arange(width, device=keep.device)
        move = present & (src != dst)
        if bool(move.any()):
            src, dst = src[move], dst[move]
            for tensor in (self.keys, self.values):
                tensor.index_copy_(0, dst, tensor.index_select(0, src))
        self.slots.reorder(order, present, used)
        self.cell_tokens, self.used = keep.clone(), width
        sizes = self.sizing.segment_sizes(keep)
        if self.keys.shape[0] > (1 + MIN_SAVING) * int(sizes.sum()):
            self._relayout(sizes)
        else:
            self.room = int((self.cap - keep).min())
        self._fit_slots(width)

    def flat_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        # a cell's first cell_tokens slots sit at the start of its segment, this pass's after them
        tokens = self.cell_tokens[..., None]
        return self.offset[..., None] + torch.where(slots < tokens, slots, tokens + slots - self.appended)

    def kv_bytes(self) -> int:
        return storage_bytes(self.keys) + storage_bytes(self.values)

    def cell_rows(self) -> torch.Tensor:
        return self.cap

    def bookkeeping(self) -> list[torch.Tensor]:
        return [self.offset, self.cap, self.cell_tokens]


__all__ = ["RaggedStore", "MIN_SAVING", "ragged_pays"]

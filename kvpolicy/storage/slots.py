"""`SlotTable`: the per-slot metadata of one cache layer, ``[batch, kv_heads, capacity]`` tensors.

Every storage format keeps this dense layout for its metadata (a few bytes per token against
``2 * head_dim * dtype`` bytes of K/V), so policies, statistics and masks read the same
shapes whatever the K/V layout: ``valid`` (the slot holds a real token), ``positions`` (its
index among the row's real tokens, -1 when empty) and ``token_state`` (the policies' per-token
state and, when a policy reads them, token ids), which move with K/V on compaction.
"""

from __future__ import annotations

import torch


class SlotTable:
    def __init__(self, batch: int, heads: int, device: torch.device, token_state: dict[str, torch.dtype],
                 position_dtype: torch.dtype = torch.long):
        self.valid = torch.zeros((batch, heads, 0), dtype=torch.bool, device=device)
        self.positions = torch.full((batch, heads, 0), -1, dtype=position_dtype, device=device)
        self.token_state = {name: torch.zeros((batch, heads, 0), dtype=dtype, device=device)
                            for name, dtype in token_state.items()}

    @property
    def capacity(self) -> int:
        return self.valid.shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return [self.positions, self.valid, *self.token_state.values()]

    def resize(self, capacity: int, used: int) -> None:
        """Move to ``capacity`` slots (grow, or shrink to free memory), keeping the first ``used``."""
        self.positions = resize_slots(self.positions, capacity, used, -1)
        self.valid = resize_slots(self.valid, capacity, used, False)
        self.token_state = {name: resize_slots(t, capacity, used, 0) for name, t in self.token_state.items()}

    def open(self, start: int, count: int) -> None:
        """Slots [start, start + count) now hold new tokens: valid, with fresh (zero) state."""
        self.valid[:, :, start : start + count] = True
        for tensor in self.token_state.values():
            tensor[:, :, start : start + count] = 0

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """positions and token state of slot ``src`` copied to slot ``dst`` ([B, Hkv, m] each); valid is the caller's."""
        self.positions = move_slots(self.positions, src, dst)
        self.token_state = {name: move_slots(t, src, dst) for name, t in self.token_state.items()}

    def keep_first(self, keep: torch.Tensor, width: int) -> None:
        """Each cell's ``keep`` [B, Hkv] tokens sit in slots [0, keep); slots past them up to ``width`` are empty."""
        self.valid[:, :, :width] = torch.arange(width, device=self.valid.device) < keep[..., None]
        self.positions[:, :, :width].masked_fill_(~self.valid[:, :, :width], -1)

    def reorder(self, order: torch.Tensor, present: torch.Tensor, used: int, start: int = 0) -> None:
        """Slot start + s of each cell takes slot ``start + order[..., s]`` where ``present`` ([B, Hkv, width]); the
        rest of [start, used) empties."""
        end = start + order.shape[2]
        span = slice(start, used)
        self.positions[:, :, start:end] = self.positions[:, :, span].gather(2, order).masked_fill_(~present, -1)
        self.positions[:, :, end:used] = -1
        for tensor in self.token_state.values():
            tensor[:, :, start:end] = tensor[:, :, span].gather(2, order).masked_fill_(~present, 0)
        self.valid[:, :, span] = False
        self.valid[:, :, start:end] = present


def resize_slots(tensor: torch.Tensor, capacity: int, used: int, fill: float | int | bool) -> torch.Tensor:
    """``tensor`` [B, Hkv, slots, ...] moved to ``capacity`` slots, its first ``used`` kept, the rest ``fill``."""
    fresh = torch.full((*tensor.shape[:2], capacity, *tensor.shape[3:]), fill, dtype=tensor.dtype, device=tensor.device)
    keep = min(used, capacity, tensor.shape[2])
    fresh[:, :, :keep] = tensor[:, :, :keep]
    return fresh


def along_slots(index: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``index`` [B, Hkv, m] expanded over the trailing dims of ``tensor`` [B, Hkv, slots, ...] (for gather/scatter)."""
    return index.reshape(*index.shape, *([1] * (tensor.dim() - 3))).expand(*index.shape, *tensor.shape[3:])


def move_slots(tensor: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """tensor[b, h, dst] = tensor[b, h, src] along dim 2 (src/dst: [B, Hkv, m]); every source is read first."""
    return tensor.scatter_(2, along_slots(dst, tensor), tensor.gather(2, along_slots(src, tensor)))

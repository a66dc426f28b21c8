"""How one precision tier stores its tokens: 16-bit floats (`FloatTier`) or integer codes (`QuantTier`).

A tier holds ``[B, Hkv, cap, ...]`` tensors over its region's slots (`tiered.TieredStore`
owns the metadata and decides who goes where). Every tier answers the same calls: write
tokens into given slots, read slots back at the compute dtype, and say what a token and a
cell cost in bytes, so that a byte budget can be solved into tier sizes before anything is
stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..backend.regions import KVRegion
from .base import storage_bytes
from .slots import along_slots, resize_slots


@dataclass(frozen=True)
class TierCosts:
    """Bytes of one token of one cell in each tier (K/V, scales, and the per-slot metadata every tier's slots carry),
    bytes each cell holds whatever its tokens (quantization ranges, per-cell state), and a 16-bit token's K/V (the
    unit of a ``memory`` budget)."""

    token: tuple[int, ...]
    cell: int
    reference_token: int



class TierFormat(Protocol):
    name: str
    bits: int

    def resize(self, capacity: int, keep: int) -> None: ...

    def write_range(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, present: torch.Tensor,
              kept: torch.Tensor) -> None: ...

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...

    def read_into(self, count: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The first ``count`` slots' K/V decoded into ``keys``/``values`` [B, Hkv, count, D] (slices of a workspace)."""
        ...

    def gather_into_front(self, order: torch.Tensor, width: int) -> None: ...

    def kernel_region(self, start: int, count: int) -> KVRegion:
        """How a kernel reads this tier's first ``count`` slots, which are the layer's slots from ``start``."""
        ...

    def nbytes(self) -> int: ...

    def token_bytes(self) -> int: ...

    def cell_bytes(self) -> int: ...


def float16_for(compute_dtype: torch.dtype) -> torch.dtype:
    """The 16-bit float a tier stores: bfloat16 for a bfloat16 model, else float16 (more mantissa, enough range for K/V)."""
    return torch.bfloat16 if compute_dtype == torch.bfloat16 else torch.float16


def scatter_present(tensor: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, present: torch.Tensor) -> None:
    """tensor[b, h, slots[b, h, i]] = rows[b, h, i] where ``present``; other entries write back what is there."""
    index = along_slots(slots, tensor)
    keep = present.reshape(*present.shape, *([1] * (tensor.dim() - 3)))
    tensor.scatter_(2, index, torch.where(keep, rows.to(tensor.dtype), tensor.gather(2, index)))


class FloatTier:
    """Tokens as 16-bit floats, ``[B, Hkv, cap, D]`` keys and values (the best tier, where tokens arrive)."""

    bits = 16
    name = "16-bit"

    def __init__(self, batch: int, heads: int, head_dim: int, compute_dtype: torch.dtype, device: torch.device):
        dtype = float16_for(compute_dtype)
        self.keys = torch.zeros((batch, heads, 0, head_dim), dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)

    def resize(self, capacity: int, keep: int) -> None:
        self.keys = resize_slots(self.keys, capacity, keep, 0)
        self.values = resize_slots(self.values, capacity, keep, 0)

    def write_range(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys[:, :, start : start + keys.shape[2]] = keys
        self.values[:, :, start : start + values.shape[2]] = values

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, present: torch.Tensor,
              kept: torch.Tensor) -> None:
        scatter_present(self.keys, slots, keys, present)
        scatter_present(self.values, slots, values, present)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        index = along_slots(slots, self.keys)
        return self.keys.gather(2, index).to(dtype), self.values.gather(2, index).to(dtype)

    def read_into(self, count: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        keys.copy_(self.keys[:, :, :count])
        values.copy_(self.values[:, :, :count])

    def gather_into_front(self, order: torch.Tensor, width: int) -> None:
        index = along_slots(order, self.keys)
        self.keys[:, :, :width] = self.keys.gather(2, index)
        self.values[:, :, :width] = self.values.gather(2, index)

    def kernel_region(self, start: int, count: int) -> KVRegion:
        return KVRegion(start, count, 16, self.keys, self.values)

    def nbytes(self) -> int:
        return storage_bytes(self.keys) + storage_bytes(self.values)

    def token_bytes(self) -> int:
        return 2 * self.keys.shape[-1] * self.keys.element_size()

    def cell_bytes(self) -> int:
        return 0

"""`QuantTier`: a precision tier of integer codes, keys per channel and values per token (`storage.quant`).

Keys share one range per (row, KV head) and channel (`quant.ChannelRange`), so a key stays
decodable wherever it moves and whichever tokens are evicted around it; values carry their
own scale and zero point per group of channels. Tokens arrive here only by moving down from a
better tier (`tiered.TieredStore`), a few at a time.
"""

from __future__ import annotations

import torch

from .base import storage_bytes
from .quant import (
    ChannelRange,
    QuantizedRows,
    bytes_per_token,
    dequantize_per_token,
    key_range_bytes,
    quantize_per_token,
)
from .slots import resize_slots
from .tier_formats import along_slots, scatter_present


class QuantTier:
    def __init__(self, bits: int, group: int, batch: int, heads: int, head_dim: int, device: torch.device,
                 keys_per: str = "channel"):
        # a group wider than the head is the whole head (one scale per token)
        self.bits, self.group, self.head_dim, self.keys_per = bits, min(group, head_dim), head_dim, keys_per
        self.name = f"{bits}-bit"
        width = head_dim * bits // 8
        self.key_codes = torch.zeros((batch, heads, 0, width), dtype=torch.uint8, device=device)
        # keys per channel share one range per cell; per token, each key has its own scales (below)
        self.key_range = ChannelRange.empty((batch, heads) if keys_per == "channel" else (0, 0), head_dim, bits, device)
        self.value_codes = torch.zeros_like(self.key_codes)
        self.value_scale = torch.zeros((batch, heads, 0, head_dim // self.group), dtype=torch.float16, device=device)
        self.value_zero = torch.zeros_like(self.value_scale)
        per_token_keys = 0 if keys_per == "channel" else head_dim // self.group
        self.key_scale = torch.zeros((batch, heads, 0, per_token_keys), dtype=torch.float16, device=device)
        self.key_zero = torch.zeros_like(self.key_scale)

    def _tensors(self) -> list[torch.Tensor]:
        return [self.key_codes, self.value_codes, self.value_scale, self.value_zero, self.key_scale, self.key_zero]

    def resize(self, capacity: int, keep: int) -> None:
        (self.key_codes, self.value_codes, self.value_scale, self.value_zero, self.key_scale,
         self.key_zero) = (resize_slots(t, capacity, keep, 0) for t in self._tensors())

    def write_range(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError("new tokens enter the 16-bit tier; a quantized tier only receives tokens moving down")

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, present: torch.Tensor) -> None:
        if self.keys_per == "channel":
            self.key_range, self.key_codes = self.key_range.widen(keys, self.key_codes, valid=present)
            scatter_present(self.key_codes, slots, self.key_range.encode(keys), present)
        else:
            rows = quantize_per_token(keys, self.bits, self.group)
            for tensor, new in ((self.key_codes, rows.packed), (self.key_scale, rows.scale), (self.key_zero, rows.zero)):
                scatter_present(tensor, slots, new, present)
        rows = quantize_per_token(values, self.bits, self.group)
        for tensor, new in ((self.value_codes, rows.packed), (self.value_scale, rows.scale), (self.value_zero, rows.zero)):
            scatter_present(tensor, slots, new, present)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decode(*(t.gather(2, along_slots(slots, t)) for t in self._tensors()), dtype)

    def read_all(self, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decode(*(t[:, :, :count] for t in self._tensors()), dtype)

    def _decode(self, key_codes: torch.Tensor, value_codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                key_scale: torch.Tensor, key_zero: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        values = dequantize_per_token(QuantizedRows(value_codes, scale, zero, self.bits), dtype)
        if self.keys_per == "channel":
            return self.key_range.decode(key_codes, dtype), values
        return dequantize_per_token(QuantizedRows(key_codes, key_scale, key_zero, self.bits), dtype), values

    def gather_into_front(self, order: torch.Tensor, width: int) -> None:
        raise NotImplementedError("only the 16-bit tier is packed; a quantized tier keeps holes until tokens move in")

    def nbytes(self) -> int:
        return sum(storage_bytes(t) for t in (*self._tensors(), self.key_range.scale, self.key_range.zero))

    def token_bytes(self) -> int:
        cost = bytes_per_token(self.head_dim, self.bits, self.group)
        return cost.total if self.keys_per == "channel" else 2 * cost.values

    def cell_bytes(self) -> int:
        return key_range_bytes(self.head_dim) if self.keys_per == "channel" else 0

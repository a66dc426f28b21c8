"""`QuantTier`: a precision tier of integer codes, values per token and keys as the recipe says (`key_codecs`).

Values carry their own scale and zero point per group of channels; keys are scaled by a key codec
(per channel over blocks of slots by default, as KIVI does). Tokens arrive here only by moving down
from a better tier (`tiered.TieredStore`), a few at a time, and keep their slot until they move on.
"""

from __future__ import annotations

import torch

from ..backend.regions import KVRegion, Scaled
from .base import storage_bytes
from .key_codecs import KEY_CODECS
from .quant import QuantizedRows, bytes_per_token, dequantize_per_token, quantize_per_token
from .slots import resize_slots
from .tier_formats import along_slots, scatter_present


class QuantTier:
    def __init__(self, bits: int, group: int, batch: int, heads: int, head_dim: int, device: torch.device,
                 keys_per: str = "channel"):
        # a group wider than the head is the whole head (one scale per token)
        self.bits, self.group, self.head_dim, self.keys_per = bits, min(group, head_dim), head_dim, keys_per
        self.name = f"{bits}-bit"
        self.keys = KEY_CODECS[keys_per](bits, self.group, batch, heads, head_dim, device)
        self.value_codes = torch.zeros((batch, heads, 0, head_dim * bits // 8), dtype=torch.uint8, device=device)
        self.value_scale = torch.zeros((batch, heads, 0, head_dim // self.group), dtype=torch.float16, device=device)
        self.value_zero = torch.zeros_like(self.value_scale)

    def _values(self) -> list[torch.Tensor]:
        return [self.value_codes, self.value_scale, self.value_zero]

    def resize(self, capacity: int, keep: int) -> None:
        self.keys.resize(capacity, keep)
        self.value_codes, self.value_scale, self.value_zero = (resize_slots(t, capacity, keep, 0) for t in self._values())

    def write_range(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError("new tokens enter the 16-bit tier; a quantized tier only receives tokens moving down")

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, present: torch.Tensor,
              kept: torch.Tensor) -> None:
        """Tokens moving in go to ``slots`` where ``present``; ``kept`` [B, Hkv, cap]: the slots whose tokens stay."""
        self.keys.write(slots, keys, present, kept)
        rows = quantize_per_token(values, self.bits, self.group)
        for tensor, new in zip(self._values(), (rows.packed, rows.scale, rows.zero), strict=True):
            scatter_present(tensor, slots, new, present)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scale, zero = (t.gather(2, along_slots(slots, t)) for t in self._values())
        return self.keys.read(slots, dtype), dequantize_per_token(QuantizedRows(codes, scale, zero, self.bits), dtype)

    def read_all(self, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scale, zero = (t[:, :, :count] for t in self._values())
        return self.keys.read_all(count, dtype), dequantize_per_token(QuantizedRows(codes, scale, zero, self.bits), dtype)

    def gather_into_front(self, order: torch.Tensor, width: int) -> None:
        raise NotImplementedError("only the 16-bit tier is packed; a quantized tier keeps holes until tokens move in")

    def kernel_region(self, start: int, count: int) -> KVRegion:
        values = Scaled(self.value_codes, self.value_scale, self.value_zero, rows=1, group=self.group)
        return KVRegion(start, count, self.bits, self.keys.kernel_operand(), values)

    def nbytes(self) -> int:
        return self.keys.nbytes() + sum(storage_bytes(t) for t in self._values())

    def token_bytes(self) -> int:
        return self.keys.token_bytes() + bytes_per_token(self.head_dim, self.bits, self.group).values

    def cell_bytes(self) -> int:
        return self.keys.cell_bytes()

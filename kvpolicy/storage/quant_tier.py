"""`QuantTier`: a precision tier of integer codes, values per token and keys as the recipe says (`key_codecs`).

Values carry their own scale and zero point per group of channels; keys are scaled by a key codec
(per channel over blocks of slots by default, as KIVI does). Tokens arrive here only by moving down
from a better tier (`tiered.TieredStore`), a few at a time, and keep their slot until they move on.
"""

from __future__ import annotations

import torch

from ..backend.regions import KVRegion
from .key_codecs import KEY_CODECS, TokenRows


class QuantTier:
    def __init__(self, bits: int, group: int, batch: int, heads: int, head_dim: int, device: torch.device,
                 keys_per: str = "channel"):
        # a group wider than the head is the whole head (one scale per token)
        self.bits, self.group, self.head_dim, self.keys_per = bits, min(group, head_dim), head_dim, keys_per
        self.name = f"{bits}-bit"
        self.keys = KEY_CODECS[keys_per](bits, self.group, batch, heads, head_dim, device)
        self.values = TokenRows(bits, self.group, batch, heads, head_dim, device)

    def resize(self, capacity: int, keep: int) -> None:
        self.keys.resize(capacity, keep)
        self.values.resize(capacity, keep)

    def write_range(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError("new tokens enter the 16-bit tier; a quantized tier only receives tokens moving down")

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, present: torch.Tensor,
              kept: torch.Tensor) -> None:
        """Tokens moving in go to ``slots`` where ``present``; ``kept`` [B, Hkv, cap]: the slots whose tokens stay."""
        self.keys.write(slots, keys, present, kept)
        self.values.write(slots, values, present, kept)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.read(slots, dtype), self.values.read(slots, dtype)

    def read_into(self, count: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys.read_into(count, keys)
        self.values.read_into(count, values)

    def gather_into_front(self, order: torch.Tensor, width: int) -> None:
        raise NotImplementedError("only the 16-bit tier is packed; a quantized tier keeps holes until tokens move in")

    def kernel_region(self, start: int, count: int) -> KVRegion:
        return KVRegion(start, count, self.bits, self.keys.kernel_operand(), self.values.kernel_operand())

    def nbytes(self) -> int:
        return self.keys.nbytes() + self.values.nbytes()

    def token_bytes(self) -> int:
        return self.keys.token_bytes() + self.values.token_bytes()

    def cell_bytes(self) -> int:
        return self.keys.cell_bytes()

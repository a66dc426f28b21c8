"""How a quantized tier (`quant_tier.QuantTier`) scales its keys: one object per choice of ``keys:`` in a recipe.

Every codec holds the tier's packed key codes ``[B, Hkv, cap, D * bits / 8]`` and the scales they need,
and answers the same calls (write into slots, read slots or the first ``count``, resize, bytes), so
that a new way to scale keys is a new class here, not a branch in the tier:

* `BlockKeys` (``keys: channel``, the default): per channel over blocks of `KEY_BLOCK` consecutive
  slots of the tier, as KIVI groups a channel over 32 consecutive tokens. A token keeps its slot
  until it moves down or is evicted, so a block's range stays valid under eviction; tokens moving
  into a block widen its range (`quant.ChannelRange.widen`, to exactly the span needed), and a block left empty starts afresh.
* `CellKeys` (``keys: cell``): per channel, one range per (row, KV head), widened as tokens arrive.
* `TokenRows` (``keys: token``): a scale and zero point per token and group of channels, like values.
"""

from __future__ import annotations

import torch

from ..backend.regions import Scaled
from .base import storage_bytes
from .quant import (
    SCALE_BYTES,
    ChannelRange,
    QuantizedRows,
    dequantize_per_token,
    dequantize_per_token_into,
    key_range_bytes,
    quantize_per_token,
)
from .slots import along_slots, resize_slots
from .tier_formats import scatter_present

#: Scale rows "larger than any tier": every slot of a cell reads row 0 (`CellKeys`' one range).
ONE_ROW = 2**30
#: Slots that share one key range per channel in `BlockKeys`: KIVI's 32 tokens.
KEY_BLOCK = 32
#: A block widens to exactly the span its keys need: unlike a cell's range, it meets at most `KEY_BLOCK` writes, and
#: on SmolLM2's keys a 25% margin costs more in wider steps than it saves in re-encodings (`benchmarks/quant_error.py`:
#: 4-bit attention error 9.1% against 7.2%, 8 tokens a write).
BLOCK_MARGIN = 1.0


class TokenRows:
    """Rows scaled per token and group of channels: a quantized tier's values, and its keys under ``keys: token``."""

    def __init__(self, bits: int, group: int, batch: int, heads: int, head_dim: int, device: torch.device):
        self.bits, self.group = bits, group
        self.codes = torch.zeros((batch, heads, 0, head_dim * bits // 8), dtype=torch.uint8, device=device)
        self.scale = torch.zeros((batch, heads, 0, head_dim // group), dtype=torch.float16, device=device)
        self.zero = torch.zeros_like(self.scale)

    def resize(self, capacity: int, keep: int) -> None:
        self.codes, self.scale, self.zero = (resize_slots(t, capacity, keep, 0) for t in (self.codes, self.scale, self.zero))

    def write(self, slots: torch.Tensor, keys: torch.Tensor, present: torch.Tensor, kept: torch.Tensor) -> None:
        rows = quantize_per_token(keys, self.bits, self.group)
        for tensor, new in ((self.codes, rows.packed), (self.scale, rows.scale), (self.zero, rows.zero)):
            scatter_present(tensor, slots, new, present)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        codes, scale, zero = (t.gather(2, along_slots(slots, t)) for t in (self.codes, self.scale, self.zero))
        return dequantize_per_token(QuantizedRows(codes, scale, zero, self.bits), dtype)

    def read_into(self, count: int, out: torch.Tensor) -> None:
        rows = QuantizedRows(self.codes[:, :, :count], self.scale[:, :, :count], self.zero[:, :, :count], self.bits)
        dequantize_per_token_into(rows, out)

    def kernel_operand(self) -> Scaled:
        return Scaled(self.codes, self.scale, self.zero, rows=1, group=self.group)

    def nbytes(self) -> int:
        return sum(storage_bytes(t) for t in (self.codes, self.scale, self.zero))

    def token_bytes(self) -> int:
        return self.codes.shape[-1] + 2 * SCALE_BYTES * self.scale.shape[-1]

    def cell_bytes(self) -> int:
        return 0


class CellKeys:
    """Keys per channel on one range per (row, KV head): no per-token scale, but the range spans every token the
    cell ever held (it restarts only when the cell's tier empties), so its steps are the widest."""

    def __init__(self, bits: int, group: int, batch: int, heads: int, head_dim: int, device: torch.device):
        self.bits = bits
        self.codes = torch.zeros((batch, heads, 0, head_dim * bits // 8), dtype=torch.uint8, device=device)
        self.range = ChannelRange.empty((batch, heads), head_dim, bits, device)

    def resize(self, capacity: int, keep: int) -> None:
        self.codes = resize_slots(self.codes, capacity, keep, 0)

    def write(self, slots: torch.Tensor, keys: torch.Tensor, present: torch.Tensor, kept: torch.Tensor) -> None:
        empty = ~kept.any(dim=2)[..., None, None]  # a cell whose tier emptied fits its next keys afresh
        self.range = ChannelRange(self.range.scale.masked_fill(empty, 0), self.range.zero.masked_fill(empty, 0),
                                  self.bits, self.range.margin)
        self.range, self.codes = self.range.widen(keys, self.codes, valid=present)
        scatter_present(self.codes, slots, self.range.encode(keys), present)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.range.decode(self.codes.gather(2, along_slots(slots, self.codes)), dtype)

    def read_into(self, count: int, out: torch.Tensor) -> None:
        self.range.decode_into(self.codes[:, :, :count], out)

    def kernel_operand(self) -> Scaled:
        return Scaled(self.codes, self.range.scale, self.range.zero, rows=ONE_ROW, group=1)

    def nbytes(self) -> int:
        return storage_bytes(self.codes) + storage_bytes(self.range.scale) + storage_bytes(self.range.zero)

    def token_bytes(self) -> int:
        return self.codes.shape[-1]

    def cell_bytes(self) -> int:
        return key_range_bytes(self.range.head_dim)


class BlockKeys:
    """Keys per channel over blocks of `KEY_BLOCK` slots: range tensors [B, Hkv, blocks, 1, D]."""

    def __init__(self, bits: int, group: int, batch: int, heads: int, head_dim: int, device: torch.device,
                 block: int = KEY_BLOCK):
        self.bits, self.block, self.head_dim = bits, block, head_dim
        self.codes = torch.zeros((batch, heads, 0, head_dim * bits // 8), dtype=torch.uint8, device=device)
        self.range = ChannelRange.empty((batch, heads, 0), head_dim, bits, device, margin=BLOCK_MARGIN)

    def _blocks(self, slots: int) -> int:
        return -(-slots // self.block)

    def resize(self, capacity: int, keep: int) -> None:
        self.codes = resize_slots(self.codes, capacity, keep, 0)
        blocks, kept_blocks = self._blocks(capacity), self._blocks(min(keep, capacity))
        self.range = ChannelRange(resize_slots(self.range.scale, blocks, kept_blocks, 0),
                                  resize_slots(self.range.zero, blocks, kept_blocks, 0), self.bits, self.range.margin)

    def _padded(self, tensor: torch.Tensor, fill: float | bool) -> torch.Tensor:
        """``tensor`` [B, Hkv, cap, ...] padded to whole blocks and viewed as [B, Hkv, blocks, block, ...]."""
        blocks = self._blocks(tensor.shape[2])
        padded = resize_slots(tensor, blocks * self.block, tensor.shape[2], fill)
        return padded.view(*tensor.shape[:2], blocks, self.block, *tensor.shape[3:])

    def write(self, slots: torch.Tensor, keys: torch.Tensor, present: torch.Tensor, kept: torch.Tensor) -> None:
        capacity = self.codes.shape[2]
        # a block whose tokens all left fits its next keys afresh instead of keeping an old, wider range
        empty = ~self._padded(kept, False).any(dim=3)[..., None, None]
        base = ChannelRange(self.range.scale.masked_fill(empty, 0), self.range.zero.masked_fill(empty, 0), self.bits,
                            self.range.margin)
        # each block's lowest and highest new key per channel (the only keys its range must now cover): the work is
        # per block and per mover, not per slot; only blocks that widen are re-encoded
        block = slots // self.block
        x = keys.float()
        shape = (*base.scale.shape[:3], self.head_dim)
        index = along_slots(block, x)
        low = x.new_full(shape, torch.inf).scatter_reduce(2, index, x.masked_fill(~present[..., None], torch.inf), "amin")
        high = x.new_full(shape, -torch.inf).scatter_reduce(2, index, x.masked_fill(~present[..., None], -torch.inf),
                                                           "amax")
        touched = (low <= high).any(dim=-1)
        whole = capacity % self.block == 0
        codes = self.codes.view(*shape[:3], self.block, -1) if whole else self._padded(self.codes, 0)
        self.range, codes = base.widen(torch.stack([low, high], dim=3), codes,
                                       valid=touched[..., None].expand(*touched.shape, 2))
        if not whole:
            self.codes = codes.flatten(2, 3)[:, :, :capacity].contiguous()
        scale = self.range.scale.squeeze(3).gather(2, index)[..., None, :]  # each mover's block's grid
        zero = self.range.zero.squeeze(3).gather(2, index)[..., None, :]
        fresh = ChannelRange(scale, zero, self.bits).encode(keys[..., None, :]).squeeze(3)
        scatter_present(self.codes, slots, fresh, present)

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        codes = self.codes.gather(2, along_slots(slots, self.codes))
        block = along_slots(slots // self.block, self.range.scale.squeeze(3))
        ranges = ChannelRange(self.range.scale.squeeze(3).gather(2, block).unsqueeze(3),
                              self.range.zero.squeeze(3).gather(2, block).unsqueeze(3), self.bits)
        return ranges.decode(codes.unsqueeze(3), dtype).squeeze(3)

    def read_into(self, count: int, out: torch.Tensor) -> None:
        whole = count // self.block  # whole blocks, then the last one's first slots
        for first, blocks, length in ((0, whole, self.block), (whole, 1, count - whole * self.block)):
            if blocks and length:
                slots = slice(first * self.block, first * self.block + blocks * length)
                ranges = ChannelRange(self.range.scale[:, :, first : first + blocks],
                                      self.range.zero[:, :, first : first + blocks], self.bits)
                ranges.decode_into(self.codes[:, :, slots].unflatten(2, (blocks, length)),
                                   out[:, :, slots].unflatten(2, (blocks, length)))

    def kernel_operand(self) -> Scaled:
        return Scaled(self.codes, self.range.scale.squeeze(3), self.range.zero.squeeze(3), rows=self.block, group=1)

    def accumulated_bound(self) -> torch.Tensor:
        """float32 [B, Hkv, blocks, 1, D]: the largest error of a key of each block: a key is re-encoded at most once a
        write into its block after its own, each time within half the (never narrower) final step."""
        return self.range.accumulated_bound(encodings=self.block)

    def nbytes(self) -> int:
        return storage_bytes(self.codes) + storage_bytes(self.range.scale) + storage_bytes(self.range.zero)

    def token_bytes(self) -> int:
        # a block's range is charged to its slots; `cell_bytes` covers the last, partly used block
        return self.codes.shape[-1] + -(-key_range_bytes(self.head_dim) // self.block)

    def cell_bytes(self) -> int:
        return key_range_bytes(self.head_dim)


KEY_CODECS = {"channel": BlockKeys, "cell": CellKeys, "token": TokenRows}


def read_all(codec: TokenRows | CellKeys | BlockKeys, count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A codec's first ``count`` slots decoded into a new [B, Hkv, count, D] tensor (tests, benchmarks)."""
    batch, heads, _, packed = codec.codes.shape
    out = torch.empty((batch, heads, count, packed * 8 // codec.bits), dtype=dtype, device=codec.codes.device)
    codec.read_into(count, out)
    return out

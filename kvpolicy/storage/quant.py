"""Quantization primitives for tokens kept at lower precision (2, 4 or 8 bits): packing, values, keys, bytes.

Asymmetric uniform min-max quantization, round to nearest: a range ``[zero, zero + (2**bits - 1) * scale]``
holds ``2**bits`` evenly spaced levels and a value is stored as the code ``c`` of its nearest level,
``x ≈ c * scale + zero``. The two K/V tensors are quantized along different axes, as KIVI and KVQuant found
they must be: keys have a few outlier *channels* (the same channels are large in every token), values do not.

* **Values per token** (`quantize_per_token`): each token's ``head_dim`` channels in groups of ``group``, one
  (scale, zero) per group and token, stored with the token. A token can be moved, dropped or demoted alone.
* **Keys per channel** (`ChannelRange`): one (scale, zero) per channel of each cell (a batch row and KV head),
  ``[..., 1, head_dim]``, shared by every quantized token of the cell. KIVI shares a per-channel range over
  groups of consecutive tokens, which compaction (tokens moved and evicted one at a time) and demotion during
  decoding (a few tokens at a time) would break up; a range per cell survives both, and when new tokens fall
  outside it, it widens and the cell's existing codes are re-encoded onto the new grid.

Scales and zero points are float16 (2 bytes each, counted by `bytes_per_token` and `key_range_bytes`), and
codes are always computed from the float16 values actually stored: the zero is rounded down to float16 and
the scale up, so that the grid still covers every value, and each element's error stays within ``scale / 2``
of the stored scale (plus float32 arithmetic). Inputs are expected finite and within float16's range, as
K/V are (neither is checked: that would cost a device sync).

Codes are packed ``8 // bits`` to a byte along the last dimension, the first code in the lowest bits
(`pack`, `unpack`). Everything is vectorized over any leading dimensions (batch rows, KV heads, layers);
nothing loops over tokens, heads or channels.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..errors import KVPolicyError

#: The bit widths a quantized tier may use.
BITS = (2, 4, 8)
#: Bytes of one stored scale or zero point (float16).
SCALE_BYTES = 2
#: The smallest scale stored (the smallest positive float16): a constant group still divides by something.
_MIN_SCALE = 2.0**-24
_FLOAT16_MAX = float(torch.finfo(torch.float16).max)
#: Default widening of a key range: to this many times the span needed, so that widenings are rare.
DEFAULT_MARGIN = 1.25


def check_bits(bits: int) -> int:
    """``bits`` when it is one of `BITS`, else a `KVPolicyError` that says which are."""
    if bits not in BITS:
        raise KVPolicyError(f"bits={bits!r} is not a supported bit width: use 2, 4 or 8")
    return bits


def levels(bits: int) -> int:
    """The largest code of ``bits`` bits, 2**bits - 1 (codes run 0..levels)."""
    return (1 << check_bits(bits)) - 1


def _check_packable(count: int, bits: int, what: str) -> int:
    per_byte = 8 // check_bits(bits)
    if count % per_byte:
        raise KVPolicyError(
            f"{what}={count} does not fill whole bytes at {bits} bits ({per_byte} codes a byte): "
            f"use a multiple of {per_byte}"
        )
    return per_byte


def _check_group(head_dim: int, group: int) -> None:
    if group <= 0 or head_dim % group:
        raise KVPolicyError(
            f"group={group} does not divide head_dim={head_dim}: use a divisor of it (e.g. 32 or {head_dim})"
        )


# --- packing ---------------------------------------------------------------------------------------------


#: The integer word of ``per_byte`` bytes, and the mask that keeps each byte's low ``bits`` bits, for `unpack`.
_WORD = {2: torch.int16, 4: torch.int32}
_SPREAD_MASK = {4: 0x0F0F, 2: 0x03030303}


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (uint8 [..., n], each < 2**bits) packed ``8 // bits`` to a byte: uint8 [..., n * bits // 8].

    The first code of a byte sits in its lowest bits. At 8 bits the codes are their own packing (returned
    as they are, not copied). ``n`` must fill whole bytes.
    """
    if codes.dtype != torch.uint8:
        raise KVPolicyError(f"codes must be uint8, got {codes.dtype}: quantize first (codes run 0..2**bits - 1)")
    per_byte = _check_packable(codes.shape[-1], bits, "the number of codes n")
    if per_byte == 1:
        return codes
    grouped = codes.unflatten(-1, (codes.shape[-1] // per_byte, per_byte)) << _shifts(bits, codes.device)
    return grouped.sum(dim=-1, dtype=torch.uint8)  # the codes' bits do not overlap: the sum is their OR


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` codes (uint8 [..., n]) that `pack` packed into ``packed`` (uint8 [..., n * bits // 8])."""
    per_byte = _check_packable(n, bits, "n")
    if packed.dtype != torch.uint8 or packed.shape[-1] != n // per_byte:
        raise KVPolicyError(
            f"packed must be uint8 [..., {n // per_byte}] for n={n} codes of {bits} bits, "
            f"got {packed.dtype} {list(packed.shape)}"
        )
    if per_byte == 1:
        return packed
    if sys.byteorder == "little":
        # one word per byte, its codes spread to one byte each: code i moves from bit i*bits to bit 8*i, and the
        # word read as bytes is the codes in order. Three passes over the bytes, not a broadcast over
        # [..., n / per_byte, per_byte] (about 12x slower on a CPU, and this runs for every read of a tier).
        word = packed.to(_WORD[per_byte])
        spread = word
        for code in range(1, per_byte):
            spread = spread | (word << (code * (8 - bits)))
        return (spread & _SPREAD_MASK[bits]).contiguous().view(torch.uint8)
    return ((packed[..., None] >> _shifts(bits, packed.device)) & levels(bits)).flatten(-2)


# --- the grid: float16 scale and zero, codes from them ---------------------------------------------------


def _float16_down(x: torch.Tensor) -> torch.Tensor:
    """The largest float16 <= ``x`` (float32)."""
    near = x.clamp(-_FLOAT16_MAX, _FLOAT16_MAX).to(torch.float16)
    return torch.where(near.float() > x, torch.nextafter(near, torch.full_like(near, -torch.inf)), near)


def _float16_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest float16 >= ``x`` (float32), at most float16's largest."""
    near = x.clamp(-_FLOAT16_MAX, _FLOAT16_MAX).to(torch.float16)
    up = torch.where(near.float() < x, torch.nextafter(near, torch.full_like(near, torch.inf)), near)
    return up.clamp(max=_FLOAT16_MAX)


def _grid(low: torch.Tensor, high: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 (scale, zero) of a grid that covers [low, high] (float32): zero rounded down, scale up."""
    zero = _float16_down(low)
    scale = _float16_up(((high - zero.float()) / levels(bits)).clamp(min=_MIN_SCALE))
    return scale, zero


def _encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of ``x`` on the stored float16 grid (broadcast), rounded to nearest, clipped to 0..levels."""
    steps = (x.float() - zero.float()) / scale.float()
    return torch.round(steps).clamp_(0, levels(bits)).to(torch.uint8)


def _decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # in place on one fresh tensor: a temporary per operation costs more than the arithmetic when the allocator
    # returns large blocks to the system between calls (page faults on every decode of a tier)
    return codes.float().mul_(scale.float()).add_(zero.float()).to(dtype)


def decode_into(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (any float dtype, e.g. a slice of a layer's attention workspace) = ``codes * scale + zero`` (broadcast),
    computed in float32 as `_decode` does, without a temporary of ``out``'s size when ``out`` is float32."""
    if out.dtype != torch.float32:
        out.copy_(_decode(codes, scale, zero, torch.float32))
        return
    torch.mul(codes, scale.float(), out=out)
    out.add_(zero.float())


# --- values: per token, groups of channels ---------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedRows:
    """Tokens quantized one by one: ``packed`` uint8 [..., T, D * bits / 8], ``scale`` and ``zero`` float16
    [..., T, D / group]. Every tensor is indexed by token along dim -2, so a store moves and drops a token by
    moving the same index of all three (its K/V slot moves)."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int

    @property
    def head_dim(self) -> int:
        return self.packed.shape[-1] * 8 // self.bits

    @property
    def group(self) -> int:
        return self.head_dim // self.scale.shape[-1]


def quantize_per_token(x: torch.Tensor, bits: int, group: int) -> QuantizedRows:
    """``x`` [..., T, D] quantized per token, one float16 (scale, zero) per ``group`` consecutive channels.

    Each element of the result decodes within ``scale / 2`` of its group's stored scale (the bound the
    tests check). ``group`` must divide D, and D fill whole bytes at ``bits``.
    """
    head_dim = x.shape[-1]
    check_bits(bits)
    _check_group(head_dim, group)
    _check_packable(head_dim, bits, "head_dim")
    grouped = x.float().unflatten(-1, (head_dim // group, group))
    low, high = torch.aminmax(grouped, dim=-1)
    scale, zero = _grid(low, high, bits)
    codes = _encode(grouped, scale[..., None], zero[..., None], bits).flatten(-2)
    return QuantizedRows(pack(codes, bits), scale, zero, bits)


def dequantize_per_token_into(rows: QuantizedRows, out: torch.Tensor) -> None:
    """`dequantize_per_token` written into ``out`` [..., T, D] (see `decode_into`)."""
    codes = unpack(rows.packed, rows.bits, rows.head_dim).unflatten(-1, (rows.scale.shape[-1], rows.group))
    decode_into(codes, rows.scale[..., None], rows.zero[..., None], out.unflatten(-1, (rows.scale.shape[-1], rows.group)))


def dequantize_per_token(rows: QuantizedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [..., T, D] tensor of ``dtype`` that `quantize_per_token` stored in ``rows``."""
    out = rows.packed.new_empty((*rows.packed.shape[:-1], rows.head_dim), dtype=dtype)
    dequantize_per_token_into(rows, out)
    return out


# --- keys: per channel, one range per cell ---------------------------------------------------------------


@dataclass(frozen=True)
class ChannelRange:
    """The key grid of each cell: float16 ``scale`` and ``zero`` [..., 1, D], one per channel, shared by every
    quantized key of the cell, so a key stays decodable wherever compaction moves it within its cell.

    A cell with no token yet has scale 0 (and zero 0); its first tokens fit its range exactly. Later tokens
    outside the range widen it: the channels that overflow (and only those) get a range ``margin`` times the
    span needed, extended on the side that overflowed, so that widenings are rare, and the cell's existing
    codes in those channels are re-encoded onto the new grid (`widen`). Use::

        keys_range, stored = keys_range.widen(new_keys, stored)   # stored: the cell's packed codes so far
        new_codes = keys_range.encode(new_keys)

    Error: a key encoded fresh decodes within ``scale / 2``. Each re-encoding adds at most half the new step,
    and every widening multiplies a channel's step by at least ``margin``, so after widenings to steps
    s_1 < ... < s_k a key first encoded at step s_0 decodes within (s_0 + ... + s_k) / 2
    <= (s_k / 2) * margin / (margin - 1): at most 5x the fresh bound of the final grid for margin 1.25
    (errors add as random ones in practice, well under that; `accumulated_bound` gives the bound).
    The range never narrows when the extreme tokens are evicted (its owner may reset an emptied cell to scale 0).
    """

    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    margin: float = DEFAULT_MARGIN

    @classmethod
    def empty(
        cls,
        leading: tuple[int, ...] | torch.Size,
        head_dim: int,
        bits: int,
        device: torch.device | str | None = None,
        margin: float = DEFAULT_MARGIN,
    ) -> ChannelRange:
        """Cells ``leading`` (e.g. (batch, kv_heads)) with no key yet: the first `widen` fits each exactly."""
        check_bits(bits)
        _check_packable(head_dim, bits, "head_dim")
        if not margin >= 1:
            raise KVPolicyError(f"margin={margin!r} must be at least 1 (the widened span over the needed one; 1: "
                                "exactly the span needed), e.g. 1.25")
        zeros = torch.zeros((*leading, 1, head_dim), dtype=torch.float16, device=device)
        return cls(zeros, zeros.clone(), bits, margin)

    @classmethod
    def fit(
        cls, keys: torch.Tensor, bits: int, valid: torch.Tensor | None = None, margin: float = DEFAULT_MARGIN
    ) -> ChannelRange:
        """The range of each cell's ``keys`` [..., T, D] (only the ``valid`` [..., T] ones when given)."""
        empty = cls.empty(keys.shape[:-2], keys.shape[-1], bits, keys.device, margin)
        return empty.widen(keys, valid=valid)[0]

    @property
    def head_dim(self) -> int:
        return self.scale.shape[-1]

    @property
    def fitted(self) -> torch.Tensor:
        """bool [..., 1, 1]: the cell has a range (it has quantized a key)."""
        return (self.scale > 0).any(dim=-1, keepdim=True)

    def bound(self) -> torch.Tensor:
        """float32 [..., 1, D]: the largest error of a key encoded on this grid, half a step."""
        return self.scale.float() / 2

    def accumulated_bound(self, encodings: int | None = None) -> torch.Tensor:
        """float32 [..., 1, D]: the largest error of a key encoded on any earlier grid of this range, or re-encoded
        at most ``encodings`` times in all (the bound for margin 1, where each widening may be tiny)."""
        times = self.margin / (self.margin - 1) if self.margin > 1 else float("inf")
        return self.bound() * min(times, float("inf") if encodings is None else encodings)

    def _check(self, keys: torch.Tensor, name: str) -> None:
        if keys.shape[:-2] != self.scale.shape[:-2] or keys.shape[-1] != self.head_dim:
            raise KVPolicyError(
                f"{name} {list(keys.shape)} do not match the range's cells {list(self.scale.shape[:-2])} "
                f"and head_dim {self.head_dim}: pass [..., T, {self.head_dim}] with the same leading dims"
            )

    def widen(
        self, keys: torch.Tensor, codes: torch.Tensor | None = None, valid: torch.Tensor | None = None
    ) -> tuple[ChannelRange, torch.Tensor | None]:
        """The range that also covers ``keys`` [..., T, D] (the ``valid`` [..., T] ones), and ``codes``
        re-encoded onto it.

        ``codes``: the cells' packed keys so far, uint8 [..., S, D * bits / 8], encoded on this range; they
        are re-encoded in place (and returned) in the channels that widened, and only there: every other
        byte stays as it was. Cells with no range yet are fitted to ``keys`` exactly and their codes (no
        token's yet) left alone. Reads back which cells widened (a device sync).
        """
        self._check(keys, "keys")
        x = keys.float()
        if valid is None:
            new_low, new_high = torch.aminmax(x, dim=-2, keepdim=True)
        else:
            absent = ~valid[..., None]
            new_low = x.masked_fill(absent, torch.inf).amin(dim=-2, keepdim=True)
            new_high = x.masked_fill(absent, -torch.inf).amax(dim=-2, keepdim=True)
        fitted = self.scale > 0
        low = self.zero.float()
        high = low + levels(self.bits) * self.scale.float()  # the top level exactly as decoding computes it
        below, above = fitted & (new_low < low), fitted & (new_high > high)
        need_low, need_high = torch.minimum(low, new_low), torch.maximum(high, new_high)
        extra = (self.margin - 1) * (need_high - need_low)
        first = ~fitted & (new_low <= new_high)  # a cell's first tokens
        wide_low = torch.where(first, new_low, torch.where(below, need_low - extra, low))
        wide_high = torch.where(first, new_high, torch.where(above, need_high + extra, high))
        widened = below | above
        changed = widened | first
        scale, zero = _grid(wide_low, wide_high, self.bits)
        grown = ChannelRange(
            torch.where(changed, scale, self.scale), torch.where(changed, zero, self.zero), self.bits, self.margin
        )
        if codes is None:
            return grown, None
        self._check_codes(codes)
        cells = widened.any(dim=-1).squeeze(-1)  # [...]
        if not bool(cells.any()):
            return grown, codes
        old = unpack(codes[cells], self.bits, self.head_dim)  # [n, S, D]: only the cells that widened
        keys_now = _decode(old, self.scale[cells], self.zero[cells], torch.float32)
        fresh = _encode(keys_now, grown.scale[cells], grown.zero[cells], self.bits)
        codes[cells] = pack(torch.where(widened[cells], fresh, old), self.bits)
        return grown, codes

    def _check_codes(self, codes: torch.Tensor) -> None:
        width = self.head_dim * self.bits // 8
        if codes.dtype != torch.uint8 or codes.shape[:-2] != self.scale.shape[:-2] or codes.shape[-1] != width:
            raise KVPolicyError(
                f"codes must be uint8 [{', '.join(map(str, self.scale.shape[:-2]))}, S, {width}] "
                f"({self.bits}-bit keys of head_dim {self.head_dim}), got {codes.dtype} {list(codes.shape)}"
            )

    def encode(self, keys: torch.Tensor) -> torch.Tensor:
        """Packed codes uint8 [..., T, D * bits / 8] of ``keys`` [..., T, D] on this range.

        Keys outside the range are clipped to it: `widen` first with the same keys. A cell with no range
        yet encodes (finite) keys to code 0, which decodes to 0.
        """
        self._check(keys, "keys")
        scale = torch.where(self.scale > 0, self.scale, torch.full_like(self.scale, torch.inf))
        return pack(_encode(keys, scale, self.zero, self.bits), self.bits)

    def decode_into(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        """`decode` written into ``out`` [..., T, D] (see the module's `decode_into`)."""
        self._check_codes(codes)
        decode_into(unpack(codes, self.bits, self.head_dim), self.scale, self.zero, out)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The keys [..., T, D] of ``dtype`` that ``codes`` (uint8 [..., T, D * bits / 8]) hold on this range."""
        self._check_codes(codes)  # before the shapes are read: a bad input gets the message that names it
        out = codes.new_empty((*torch.broadcast_shapes(codes.shape[:-1], self.scale.shape[:-1]), self.head_dim),
                              dtype=dtype)
        self.decode_into(codes, out)
        return out


# --- bytes -----------------------------------------------------------------------------------------------


class TokenBytes(NamedTuple):
    """Bytes of one quantized token of one cell: its key codes, and its value codes with their scales."""

    keys: int
    values: int

    @property
    def total(self) -> int:
        return self.keys + self.values


def bytes_per_token(head_dim: int, bits: int, value_group: int) -> TokenBytes:
    """Exact bytes one token of one cell costs at ``bits``: key codes (the key range is per cell:
    `key_range_bytes`), and value codes plus a float16 (scale, zero) per ``value_group`` channels."""
    _check_packable(head_dim, bits, "head_dim")
    _check_group(head_dim, value_group)
    codes = head_dim * bits // 8
    return TokenBytes(keys=codes, values=codes + 2 * SCALE_BYTES * (head_dim // value_group))


def key_range_bytes(head_dim: int) -> int:
    """Bytes of one cell's key range (`ChannelRange`): a float16 scale and zero per channel, whatever the
    number of tokens (one range per bit width in use)."""
    return 2 * SCALE_BYTES * head_dim

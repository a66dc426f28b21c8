"""How a kernel reads a layer stored in precision tiers: one `KVRegion` per tier, in slot order.

A storage format describes its slots this way (`storage.tier_formats`), and a kernel that
de-quantizes in registers (`triton_tiered`) reads them without knowing which format wrote them.
Where a scale sits is two numbers per tensor, so every key codec and the values share one
description: scale row = slot // ``rows`` (1: per token, 32: blocks of slots, more than the tier's
slots: one per cell), scale column = channel // ``group`` (1: per channel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Scaled:
    """Packed codes [B, Hkv, slots, D * bits / 8] uint8 and their float16 ``scale``/``zero`` [B, Hkv, S, C]."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    rows: int  # slots per scale row
    group: int  # channels per scale column


@dataclass(frozen=True)
class KVRegion:
    """One tier's slots [start, start + count) of the layer: 16-bit ``keys``/``values`` [B, Hkv, >= count, D], or
    ``bits`` < 16 and both as `Scaled` codes."""

    start: int
    count: int
    bits: int
    keys: torch.Tensor | Scaled
    values: torch.Tensor | Scaled

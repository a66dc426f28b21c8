"""`TieredStore`: a layer's tokens kept at precision tiers (16-bit floats, 8/4/2-bit codes), chosen by policy scores.

Each tier owns a region of the slot table, lowest precision first and the 16-bit tier last,
where new tokens arrive: ``[tier T-1 | ... | tier 1 | tier 0 (+ this pass's tokens)]``. A
region may hold holes (masked invalid slots), so that a token stays where it is until it
moves down a tier or is evicted; only the 16-bit region is packed after each eviction, so
that the next tokens append at its end.

Eviction (`evict`) ranks each cell's tokens by the policies' scores (ties: the more recent
first) and fills the tiers best first: tier t takes the best ``sizes[t]`` tokens among those
now in tiers <= t that no better tier took (a token moves down, never up); the rest is
evicted. A token is scored at full precision before it is ever quantized, because it enters
at 16 bits. Tokens moving down are decoded from their tier and encoded into the next, whose
slots were freed by the tokens that left it; the lowest tier is filled first, so that every
source is read before its slot is reused.

Attention reads a transient copy of the layer at the compute dtype (`attention_kv`, reported
as workspace), rebuilt at every pass from the tiers: the cache itself never holds the layer
at full precision.
"""

from __future__ import annotations

import torch

from ..backend.regions import KVRegion
from ..errors import KVPolicyError
from ..recipe.budget import Tier
from .base import KVStore, headroom, storage_bytes
from .quant_tier import QuantTier
from .slots import SlotTable
from .tier_formats import FloatTier, TierCosts, TierFormat

#: Per-slot metadata of a tiered layer: positions fit int32 (2**31 tokens), and at a few bits per channel the
#: 8 bytes of an int64 would be a tenth of a token's cost.
POSITION_DTYPE = torch.int32


class TieredStore(KVStore):
    packed_tokens = None
    past_packed = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, token_state: dict[str, torch.dtype],
                 sizing: TierSizing, layer: int, tiers: tuple[Tier, ...]):
        """``keys``/``values``: the layer's first K/V ([B, Hkv, q, D]), for shapes, dtype and device only."""
        batch, heads, _, head_dim = keys.shape
        check_head_dim(head_dim, tiers, layer)
        self.compute_dtype = keys.dtype
        self.sizing = sizing
        self.tiers: list[TierFormat] = [make_tier(t.bits, t.group, t.keys, batch, heads, head_dim, keys.dtype, keys.device)
                                        for t in tiers]
        self.caps = [0] * len(self.tiers)  # slots of each tier's region
        self.slots = SlotTable(batch, heads, keys.device, token_state, position_dtype=POSITION_DTYPE)
        self.top_tokens = 0  # tokens in the 16-bit region (its first slots), the most over cells
        self.used = 0
        self._view: tuple[torch.Tensor, torch.Tensor] | None = None
        self.keys = self.values = keys.new_zeros(0)  # the interface's names; the tiers hold the bytes

    # --- layout ---------------------------------------------------------------------------------------------
    def offset(self, tier: int) -> int:
        """First slot of ``tier``'s region (lower tiers come first)."""
        return sum(self.caps[tier + 1 :])

    def _relayout(self, caps: list[int]) -> None:
        """Give each tier ``caps[t]`` slots, moving every region's tokens (and metadata) to its new place."""
        old = [self.offset(t) for t in range(len(self.tiers))]
        old_caps, self.caps = self.caps, caps
        capacity = sum(caps)
        fresh = SlotTable(*self.slots.valid.shape[:2], self.slots.valid.device,
                          {n: t.dtype for n, t in self.slots.token_state.items()}, position_dtype=POSITION_DTYPE)
        fresh.resize(capacity, 0)
        for tier, format_ in enumerate(self.tiers):
            keep = min(old_caps[tier], caps[tier])
            src, dst = slice(old[tier], old[tier] + keep), slice(self.offset(tier), self.offset(tier) + keep)
            fresh.valid[:, :, dst] = self.slots.valid[:, :, src]
            fresh.positions[:, :, dst] = self.slots.positions[:, :, src]
            for name, tensor in fresh.token_state.items():
                tensor[:, :, dst] = self.slots.token_state[name][:, :, src]
            format_.resize(caps[tier], keep)
        self.slots = fresh
        self.used = self.offset(0) + self.top_tokens

    # --- a pass -------------------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        count = keys.shape[2]
        if self.top_tokens + count > self.caps[0]:
            needed = self.top_tokens + count
            self._relayout([needed + headroom(needed), *self.caps[1:]])
        start = self.used
        self.tiers[0].write_range(start - self.offset(0), keys, values)
        self.slots.open(start, count)
        self.top_tokens += count
        self.used += count
        self._view = None
        return start

    def mark_pads(self) -> None:
        return None  # pads are invalid slots like any hole

    def attention_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V at the compute dtype, slot for slot (a transient copy: workspace, not cache)."""
        if self._view is None:
            batch, heads = self.slots.valid.shape[:2]
            keys = torch.empty((batch, heads, self.used, self.tiers[0].keys.shape[-1]), dtype=self.compute_dtype,
                               device=self.slots.valid.device)
            values = torch.empty_like(keys)
            for tier, format_ in enumerate(self.tiers):  # the regions tile [0, used): every slot is written
                start = self.offset(tier)
                count = max(0, min(self.caps[tier], self.used - start))
                if count:
                    format_.read_into(count, keys[:, :, start : start + count], values[:, :, start : start + count])
            self._view = (keys, values)
            self.workspace_bytes = max(self.workspace_bytes, storage_bytes(keys) + storage_bytes(values))
        return self._view

    def placeholder_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-stride K/V [B, Hkv, used, D] for a kernel that reads the tiers in place (`kernel_regions`): shapes and
        dtype only, no bytes."""
        batch, heads = self.slots.valid.shape[:2]
        dim = self.tiers[0].keys.shape[-1]
        empty = torch.zeros((), dtype=self.compute_dtype, device=self.slots.valid.device).expand(batch, heads, self.used, dim)
        return empty, empty

    def kernel_regions(self) -> list[KVRegion]:
        """The layer's slots [0, used) as a kernel reads them in place: one region per tier, lowest first."""
        regions = []
        for tier in range(len(self.tiers) - 1, -1, -1):
            start = self.offset(tier)
            count = max(0, min(self.caps[tier], self.used - start))
            regions.append(self.tiers[tier].kernel_region(start, count))
        return regions

    def slot_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys_values = self.attention_kv()
        self._view = None  # decoded for a policy's scores, between passes: an eviction is about to move tokens
        return keys_values

    def end_pass(self) -> None:
        self._view = None

    def wants_scores(self) -> bool:
        """A cell's 16-bit tier is over its size by more than the slack: tokens must move down even below the budget."""
        sizes, slack = self.sizing.tier_sizes, self.sizing.slack
        if sizes is None or self.top_tokens - int(sizes[0].min()) <= slack:
            return False
        if self.top_tokens - int(sizes[0].max()) > slack:
            return True
        # cells of different sizes (rows of different budgets in one batch): the packed width is the largest cell's,
        # so count each cell's own 16-bit tokens, or the smallest tier would end the slack of every cell at every step
        start = self.offset(0)
        held = self.slots.valid[:, :, start : self.used].sum(dim=2)
        return bool((held - sizes[0] > slack).any())

    def drop_one(self, victim: torch.Tensor) -> None:
        raise NotImplementedError("the layer takes its packed decode path on dense storage only")

    # --- eviction -------------------------------------------------------------------------------------------
    def evict(self, scores: torch.Tensor | None, keep: torch.Tensor, count: torch.Tensor) -> None:
        sizes = self.sizing.tier_sizes  # [T, B, Hkv]
        if sizes is None or scores is None:
            return  # nothing moves before the budgets are known, or when nothing is over
        scores = self._grow_regions(sizes, scores)
        tier_of_slot = self._tier_of_slots(self.used, scores.device)
        target = self._assign(scores, sizes, tier_of_slot)
        for tier in range(len(self.tiers) - 1, 0, -1):  # lowest first: sources are read before their slots are reused
            self._move_into(tier, target, tier_of_slot)
        self._pack_top(target)

    def _grow_regions(self, sizes: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Regions big enough for this eviction's tier sizes; ``scores`` [B, Hkv, used] moved with the slots."""
        caps = [self.caps[0]] + [max(self.caps[t], int(sizes[t].max())) for t in range(1, len(self.tiers))]
        if self.sizing.last_unbounded and len(self.tiers) > 1:
            # the last tier takes every token the others do not: room for all of them, amortized
            needed = int(self.slots.valid[:, :, : self.used].sum(dim=2).max())
            caps[-1] = self.caps[-1] if needed <= self.caps[-1] else needed + headroom(needed)
        if caps == self.caps:
            return scores
        old = [(self.offset(t), self.caps[t]) for t in range(len(self.tiers))]
        self._relayout(caps)
        moved = scores.new_full((*scores.shape[:2], self.used), -torch.inf)
        for tier, (start, cap) in enumerate(old):
            width = min(cap, scores.shape[2] - start)
            if width > 0:
                moved[:, :, self.offset(tier) : self.offset(tier) + width] = scores[:, :, start : start + width]
        return moved

    def _tier_of_slots(self, used: int, device: torch.device) -> torch.Tensor:
        tier = torch.empty(used, dtype=torch.long, device=device)
        for t in range(len(self.tiers)):
            tier[self.offset(t) : self.offset(t) + self.caps[t]] = t
        return tier[:used]

    def _assign(self, scores: torch.Tensor, sizes: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, used]: each slot's tier after this eviction (T: evicted), best-ranked first, never up a tier."""
        used = scores.shape[2]
        valid = self.slots.valid[:, :, :used] & (scores > -torch.inf)
        recency = self.slots.positions[:, :, :used].to(torch.float64)
        # rank: score first, then the more recent token (a policy that gives no scores ranks by recency)
        by_recency = torch.sort(recency, dim=2, descending=True, stable=True).indices
        by_score = torch.sort(scores.gather(2, by_recency), dim=2, descending=True, stable=True).indices
        order = by_recency.gather(2, by_score)
        rank = torch.empty_like(order).scatter_(2, order, torch.arange(used, device=scores.device).expand_as(order))
        tiers = len(self.tiers)
        target = torch.full_like(rank, tiers)
        for tier in range(tiers):
            eligible = valid & (target == tiers) & (current <= tier)
            # the best `sizes[tier]` eligible tokens: their rank among the eligible ones is below the size
            key = torch.where(eligible, rank, used)
            place = torch.empty_like(order).scatter_(2, torch.sort(key, dim=2).indices, torch.arange(used, device=scores.device).expand_as(order))
            target = torch.where(eligible & (place < sizes[tier][..., None]), tier, target)
        return target

    def _move_into(self, tier: int, target: torch.Tensor, tier_of_slot: torch.Tensor) -> None:
        """Encode the tokens that move down into ``tier`` into the slots its leaving tokens (and holes) free."""
        movers = (target == tier) & (tier_of_slot < tier)
        moves = int(movers.sum(dim=2).max())
        start, cap = self.offset(tier), self.caps[tier]
        region = slice(start, start + cap)
        staying = (target[:, :, region] == tier) & self.slots.valid[:, :, region]
        if moves:
            # k-th mover of a cell -> k-th free slot of its region (a stable sort puts the chosen first)
            src = torch.sort((~movers).to(torch.int8), dim=2, stable=True).indices[..., :moves]
            free = torch.sort(staying.to(torch.int8), dim=2, stable=True).indices[..., :moves]
            present = torch.arange(moves, device=target.device) < movers.sum(dim=2, keepdim=True)
            keys, values = self._read(src, tier_of_slot)
            self.tiers[tier].write(free, keys, values, present, staying)
            dst = free + start
            self.slots.positions.scatter_(2, torch.where(present, dst, src), self.slots.positions.gather(2, src))
            for tensor in self.slots.token_state.values():
                tensor.scatter_(2, torch.where(present, dst, src), tensor.gather(2, src))
            staying = staying.scatter(2, free, present | staying.gather(2, free))
        self.slots.valid[:, :, region] = staying
        self.slots.positions[:, :, region].masked_fill_(~staying, -1)

    def _read(self, slots: torch.Tensor, tier_of_slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [B, Hkv, m, D] at the compute dtype of ``slots`` [B, Hkv, m], whatever tier each is in."""
        keys = values = None
        source = tier_of_slot[slots]
        for tier, format_ in enumerate(self.tiers):
            here = source == tier
            if not bool(here.any()):
                continue
            local = (slots - self.offset(tier)).clamp(0, max(self.caps[tier] - 1, 0))
            k, v = format_.read(local, self.compute_dtype)
            keys = k if keys is None else torch.where(here[..., None], k, keys)
            values = v if values is None else torch.where(here[..., None], v, values)
        return keys, values

    def _pack_top(self, target: torch.Tensor) -> None:
        """The 16-bit tier keeps its chosen tokens, packed into its region's first slots."""
        start, used = self.offset(0), self.used
        kept = (target[:, :, start:used] == 0) & self.slots.valid[:, :, start:used]
        width = int(kept.sum(dim=2).max())
        order = torch.sort((~kept).to(torch.int8), dim=2, stable=True).indices[..., :width]
        present = torch.arange(width, device=target.device) < kept.sum(dim=2, keepdim=True)
        self.tiers[0].gather_into_front(order, width)
        self.slots.reorder(order, present, used, start=start)
        self.top_tokens = width
        self.used = start + width
        self._fit_top()

    def _fit_top(self) -> None:
        """Shrink the 16-bit region to its size, the slack and the next token, where budgets bound it."""
        sizes = self.sizing.tier_sizes
        if sizes is None:
            return
        target = max(int(sizes[0].max()) + self.sizing.slack + 1, self.top_tokens + 1)
        if self.caps[0] > target:
            self._relayout([target, *self.caps[1:]])

    # --- bytes ----------------------------------------------------------------------------------------------
    def costs(self, cell_state: dict[str, torch.Tensor]) -> TierCosts:
        """What a token costs in each tier (its K/V and its slot's metadata) and what each cell holds regardless."""
        slot = sum(t.element_size() for t in self.slots.tensors())  # zero-width tensors still know their dtype
        cell = sum(f.cell_bytes() for f in self.tiers) + sum(t.element_size() * t[0, 0].numel() for t in cell_state.values())
        reference = 2 * self.tiers[0].keys.shape[-1] * 2  # a 16-bit token's K and V
        return TierCosts(tuple(f.token_bytes() + slot for f in self.tiers), cell, reference)

    def kv_bytes(self) -> int:
        return sum(format_.nbytes() for format_ in self.tiers)

    def tier_bytes(self) -> dict[str, int]:
        """Bytes each tier's storage holds (codes, scales, ranges), by tier name."""
        return {format_.name: format_.nbytes() for format_ in self.tiers}

    def bytes_per_token(self) -> int:
        """K/V bytes of one token of one cell in the 16-bit tier (the memory report's live figure uses the tiers)."""
        return self.tiers[0].token_bytes()

    def live_kv_bytes(self) -> int:
        """K/V bytes of the tokens kept, each at its tier's cost."""
        valid = self.slots.valid[:, :, : self.used]
        return sum(int(valid[:, :, self.offset(t) : self.offset(t) + self.caps[t]].sum()) * f.token_bytes()
                   for t, f in enumerate(self.tiers))


def make_tier(bits: int, group: int, keys_per: str, batch: int, heads: int, head_dim: int, compute_dtype: torch.dtype,
              device: torch.device) -> TierFormat:
    if bits == 16:
        return FloatTier(batch, heads, head_dim, compute_dtype, device)
    return QuantTier(bits, group, batch, heads, head_dim, device, keys_per)


class TierSizing:
    """What a tiered store asks of the layer's budgets (`kvpolicy.cache.budgets.CellBudgets`)."""

    slack: int
    tier_sizes: torch.Tensor | None  # [T, B, Hkv] tokens per tier, once resolved
    last_unbounded: bool


def check_head_dim(head_dim: int, tiers: tuple[Tier, ...], layer: int) -> None:
    for tier in tiers:
        if tier.bits < 16 and tier.group < head_dim and head_dim % tier.group:
            raise KVPolicyError(f"layer {layer}: a {tier.bits}-bit tier groups {tier.group} channels per scale, but the "
                                f"head size is {head_dim}: give the tier a group that divides {head_dim} (e.g. group: "
                                f"{head_dim})")


__all__ = ["TieredStore", "TierSizing", "POSITION_DTYPE", "check_head_dim"]

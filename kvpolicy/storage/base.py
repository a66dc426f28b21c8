"""The storage interface of a cache layer, and the rules every format shares.

A store holds one layer's K/V and its `SlotTable`. The layer (`kvpolicy.cache.layer`) decides what
to keep; the store decides where the bytes go. "Slot" is the metadata's index: slot ``s`` of
cell ``(b, h)`` (a batch row and KV head) is ``slots.valid[b, h, s]``; where that token's K/V
physically sit is the store's business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from .slots import SlotTable


def headroom(slots: int | torch.Tensor, budgets_grow: bool = False) -> int | torch.Tensor:
    """The growth rule: free slots kept past ``slots`` when storage grows, and tolerated past it before it shrinks.

    Budgets that grow with the sequence (FastGen) get a thirty-second, so that memory stays
    close to what is kept; everything else a sixteenth (at least 16 slots), so that
    re-allocations are amortized.
    """
    if budgets_grow:
        return slots // 32 + 1
    extra = slots // 16
    return torch.clamp(extra, min=16) if isinstance(extra, torch.Tensor) else max(16, extra)


class Sizing(Protocol):
    """What a store asks of the layer's budgets when it sizes storage (`kvpolicy.cache.budgets.CellBudgets`)."""

    slack: int
    uniform_limit: int | None

    def segment_sizes(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def grown_segments(self, needed: torch.Tensor) -> torch.Tensor: ...

    @property
    def budgets_grow(self) -> bool: ...


class KVStore(ABC):
    """One layer's K/V and per-slot metadata. ``used``: slots in use, the high-water mark over cells."""

    slots: SlotTable
    used: int
    keys: torch.Tensor
    values: torch.Tensor
    #: n when every cell holds exactly n tokens in slots [0, n) (lets a decode step skip syncs), else None
    packed_tokens: int | None = None
    #: the cache was packed before this pass's tokens were appended (attention then needs no mask beyond causality)
    past_packed: bool = False
    #: largest transient copy that attention read (formats whose K/V attention cannot read in place)
    workspace_bytes: int = 0

    @abstractmethod
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Store this pass's tokens ([B, Hkv, q, D]) at slots [start, start + q) of every cell; return start."""

    @abstractmethod
    def attention_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the slots in use, [B, Hkv, used, D], slot for slot like the metadata."""

    @abstractmethod
    def evict(self, scores: torch.Tensor | None, keep: torch.Tensor, count: torch.Tensor) -> None:
        """Keep the ``keep`` [B, Hkv] best-``scores`` tokens of each cell (every valid one when ``scores`` is None).

        ``count`` [B, Hkv]: valid tokens per cell now. Called after every pass, so that a format can
        also settle the pass's new tokens where they belong.
        """

    @abstractmethod
    def drop_one(self, victim: torch.Tensor) -> None:
        """The decode step of a packed layer: evict slot ``victim`` [B, Hkv] of every cell."""

    @abstractmethod
    def mark_pads(self) -> None:
        """This pass's tokens include pads (the layer has marked them invalid)."""

    def wants_scores(self) -> bool:
        """Tokens must move (e.g. down a precision tier) even though no cell is over its budget."""
        return False

    def fit(self, tokens: int) -> None:
        """Free storage past ``tokens`` per cell (plus the slack and working slots) where far above it."""
        return None

    @abstractmethod
    def kv_bytes(self) -> int:
        """Bytes the K/V tensors really hold."""

    def bytes_per_token(self) -> int:
        """K/V bytes of one token of one cell."""
        return (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()

    def cell_rows(self) -> torch.Tensor | None:
        """K/V rows allocated per cell [B, Hkv], or None when every cell has an equal share."""
        return None

    def live_kv_bytes(self) -> int:
        """K/V bytes of the tokens kept (a format whose tokens cost different amounts counts each at its own)."""
        return int(self.slots.valid.sum()) * self.bytes_per_token()

    def tier_bytes(self) -> dict[str, int]:
        """Bytes each precision tier's storage holds, by tier name; empty for a format without tiers."""
        return {}

    def bookkeeping(self) -> list[torch.Tensor]:
        """Tensors the format keeps besides K/V and the slot table (counted as metadata)."""
        return []

    def end_pass(self) -> None:
        """Attention is done with this pass's K/V (drop transient copies)."""
        return None

    def truncate(self, used: int, packed_tokens: int | None) -> None:
        """Forget every slot from ``used`` on, appended since the store held ``used`` slots and ``packed_tokens``
        (a probe's passes, which nothing evicted in between)."""
        raise NotImplementedError(f"{type(self).__name__} cannot take back appended tokens")

    # --- merging (formats whose rows a merge can rewrite in place: dense and ragged) ------------------------
    def flat_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as ``[rows, D]`` views of the storage itself (writes land in the cache)."""
        raise NotImplementedError(f"{type(self).__name__} cannot merge tokens")

    def slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of `flat_kv` holding slots ``slots`` [B, Hkv, M] of each cell, between passes."""
        raise NotImplementedError(f"{type(self).__name__} cannot merge tokens")

    def slot_keys(self) -> torch.Tensor:
        """Keys of the slots in use, [B, Hkv, used, D], between passes (a copy where the format is not dense)."""
        return self.flat_kv()[0][self._rows_in_use()]

    def slot_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the slots in use, [B, Hkv, used, D] each, between passes, for a policy that reads them
        (`Policy.reads_kv`): copies where the format is not dense (ragged rows gathered, tiers decoded)."""
        rows = self._rows_in_use()
        keys, values = self.flat_kv()
        return keys[rows], values[rows]

    def _rows_in_use(self) -> torch.Tensor:
        """`slot_rows` of every slot in use, [B, Hkv, used]."""
        slots = torch.arange(self.used, device=self.slots.valid.device).expand(*self.slots.valid.shape[:2], -1)
        return self.slot_rows(slots)

    def merge(self, source: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, self_weight: torch.Tensor) -> None:
        """Merge slot ``source`` into slot ``target`` of the same cell (each [B, Hkv, M]; weight 0: nothing).

        Each target's K and V become the weighted mean of its own (``self_weight``) and of the sources merged into it
        (``weight``). Sources must not be targets; call it before `evict` drops them.
        """
        chosen = weight > 0
        if not bool(chosen.any()):
            return
        src, dst = self.slot_rows(source)[chosen], self.slot_rows(target)[chosen]
        targets, inverse = torch.unique(dst, return_inverse=True)
        own = torch.zeros(targets.shape[0], device=dst.device).scatter_(0, inverse, self_weight[chosen].float())
        total = own + torch.zeros_like(own).index_add_(0, inverse, weight[chosen].float())
        for flat in self.flat_kv():
            mixed = flat.index_select(0, targets).float() * own[:, None]
            mixed.index_add_(0, inverse, flat.index_select(0, src).float() * weight[chosen].float()[:, None])
            flat.index_copy_(0, targets, (mixed / total[:, None]).to(flat.dtype))


def top_kept(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, T] bool: the ``keep`` [B, Hkv] highest ``scores`` of each cell."""
    kmax = int(keep.max())
    top = torch.topk(scores, kmax, dim=2, sorted=True).indices
    chosen = torch.arange(kmax, device=scores.device) < keep[..., None]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(2, top, chosen)


def storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()

"""The records between a cache layer and the attention backends.

A layer hands the backend an `AttentionCall` (what to attend to, which keys each query may
see, which statistics to return) and gets an `AttentionResult` back; the backends see
nothing else of the layer, and every backend's ``attend(query, call)`` takes the same two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..policies.base import AttentionStats
from .regions import KVRegion
from .rotary import rotate


@dataclass
class AttentionCall:
    keys: torch.Tensor  # [B, Hkv, T, D], slot for slot like `valid` (T: the layer's slots in use)
    values: torch.Tensor  # [B, Hkv, T, D]
    valid: torch.Tensor  # [B, Hkv, T] bool: the slot holds a real token
    key_positions: torch.Tensor  # [B, Hkv, T] int64 (int32 on tiered layers): each slot's position among its row's real tokens
    query_positions: torch.Tensor  # [B, q] int64, -1 for pads
    query_valid: torch.Tensor | None  # [B, q] bool, None when the call has no pads
    past_slots: int  # the call's queries sit at slots past_slots + i, so later slots are never visible
    scaling: float
    needs: frozenset[str]  # statistics to return; empty: plain attention, no tracking
    last_rows_window: int = 0  # rows of `last_rows` asked for
    sliding_window: int | None = None
    backend: str = "torch"  # "torch" or "triton" (`select.select_backend`)
    #: no mask beyond causality: every cached slot is valid, no pads, no window (cheaper paths apply)
    causal_only: bool = False
    near_band: torch.Tensor | None = None  # [B, Hkv]: the local band of `near_colsum_heads`
    #: in-cache positions (StreamingLLM): (query deltas [B, Hkv, q], RoPE inverse frequencies); keys come rotated
    query_rotation: tuple[torch.Tensor, torch.Tensor] | None = None
    #: a tiered layer on the Triton backend: its slots as a kernel reads them in place (`regions`); ``keys`` and
    #: ``values`` are then zero-stride placeholders of the right shape, and `decoded` builds the real ones for the
    #: paths that need them (prefill, plain attention)
    regions: list[KVRegion] | None = None
    decode_kv: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    #: with "query_moments" in ``needs``: the model's RoPE inverse frequencies, and the positions below which a
    #: row's queries stay out of the moments
    inv_freq: torch.Tensor | None = None
    moments_skip: int = 0
    #: [B, Hkv, T] float32 added to every query's logit of each slot (natural log), or None: a slot that stands for n
    #: merged tokens draws attention as n tokens would, log n (a merging policy's `proportional_attention`)
    key_bias: torch.Tensor | None = None

    def decoded(self) -> AttentionCall:
        """This call with its keys and values decoded to the compute dtype (a transient copy: workspace)."""
        if self.decode_kv is None:
            return self
        keys, values = self.decode_kv()
        return replace(self, keys=keys, values=values, regions=None, decode_kv=None)

    def key_mask(self, lo: int, hi: int, width: int) -> torch.Tensor:
        """Which of the first ``width`` slots queries lo..hi-1 may attend: [B, Hkv, hi-lo, width] bool."""
        key_positions = self.key_positions[:, :, None, :width]
        query_positions = self.query_positions[:, None, lo:hi, None]
        mask = self.valid[:, :, None, :width] & (key_positions <= query_positions)
        if self.sliding_window is not None:
            mask &= key_positions > query_positions - self.sliding_window
        return mask

    def near_mask(self, lo: int, hi: int, width: int) -> torch.Tensor:
        """[B, Hkv, hi-lo, width] bool: keys within the local band of each query (`near_colsum_heads`)."""
        distance = self.query_positions[:, None, lo:hi, None] - self.key_positions[:, :, None, :width]
        return distance < self.near_band[:, :, None, None]

    def prepare_query(self, query: torch.Tensor) -> torch.Tensor:
        """``query`` [B, Hq, q, D] as the keys see it (re-rotated for in-cache positions)."""
        if self.query_rotation is None:
            return query
        delta, inv_freq = self.query_rotation
        batch, q_heads, queries, dim = query.shape
        kv_heads = self.keys.shape[1]
        grouped = query.reshape(batch, kv_heads, q_heads // kv_heads, queries, dim)
        return rotate(grouped, delta[:, :, None], inv_freq).reshape(batch, q_heads, queries, dim)


@dataclass
class AttentionResult:
    output: torch.Tensor  # [B, q, Hq, D], the query's dtype
    stats: AttentionStats | None  # None when the call asked for none

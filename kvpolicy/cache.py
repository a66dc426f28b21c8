"""`PolicyCache`: a transformers `Cache` whose layers really evict.

Storage per layer is ``[batch, kv_heads, slots, head_dim]`` with a validity flag and
the token's position per slot, so every (batch row, KV head) may keep its own set of
tokens. New tokens are appended at a common slot offset; eviction keeps each head's
top-scoring tokens and packs them into the first slots by moving the few survivors
that sit past the new length into the holes (a decode step moves one token per head,
not the whole cache). After the prompt, storage shrinks to the budget, so the memory
is freed rather than masked.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import KVPolicyError
from .memory import MemoryReport
from .plan import Budget, LayerPlan
from .policies.base import AttentionStats, Policy, TokenView

# The attention function gets no handle to the cache, so each layer announces itself
# here in `update`, right before the model calls attention for that same layer.
_active = threading.local()


def active_layer(layer_idx: int) -> PolicyLayer | None:
    layer = getattr(_active, "layer", None)
    if layer is not None and layer.layer_idx == layer_idx and layer.pending is not None:
        return layer
    return None


@dataclass
class PolicyGroup:
    """The KV heads of one layer that share one policy instance (and its state)."""

    policy: Policy
    heads: torch.Tensor  # [rows, Hkv] bool: the (batch row, KV head) cells it owns; rows is 1 or B
    prefix: str  # namespace of its state tensors


class PolicyLayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer_idx: int, rows: list[LayerPlan], groups: list[PolicyGroup], prompt_tokens: int | None):
        """``rows``: one LayerPlan shared by every batch row, or one per batch row."""
        super().__init__()
        self.layer_idx = layer_idx
        self.rows = rows
        self.groups = groups
        self.needs = frozenset().union(*(g.policy.needs for g in groups))
        self.last_rows_window = max([g.policy.last_rows_window for g in groups if "last_rows" in g.policy.needs] or [0])
        cells = [head for row in rows for head in row.heads]
        self.bounded_cells = torch.tensor(
            [[h.budget.tokens is not None or h.budget.ratio is not None for h in row.heads] for row in rows]
        )
        self.bounded = bool(self.bounded_cells.any())
        self.slack = max((h.budget.slack for h in cells), default=0)
        self.drops_early = any(g.policy.drops_early for g in groups)
        # (row, head) cells whose keys move to in-cache RoPE positions (StreamingLLM), or None
        in_cache = [g.heads for g in groups if getattr(g.policy.params, "positions", "original") == "in_cache"]
        self.in_cache_heads = torch.stack(in_cache).any(dim=0) if in_cache else None
        self.inv_freq: torch.Tensor | None = None
        # python-side facts that let a decode step skip tensor reductions (and their syncs):
        # packed_tokens = n means every (row, head) holds exactly n tokens in slots [0, n)
        self.packed_tokens: int | None = 0
        self.past_packed = True
        self.uniform_limit: int | None = None  # one budget for every cell, once resolved
        self.appended_pads = False
        self.prompt_tokens = prompt_tokens
        self.budget: torch.Tensor | None = None  # [B, Hkv], resolved at the first forward
        self.seen = 0  # slots' worth of tokens seen, pads included (what `generate` counts)
        self.used = 0  # slots in use: the high-water mark over (row, head)
        self.pending: tuple[int, int] | None = None  # (first slot, count) of tokens appended by this forward
        self.evictions = 0
        self.backend = "torch"  # set by the session: "torch" or "triton" for the tracking attention

    # --- storage -------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys = key_states.new_zeros((batch, heads, 0, key_states.shape[-1]))
        self.values = value_states.new_zeros((batch, heads, 0, value_states.shape[-1]))
        self.positions = torch.full((batch, heads, 0), -1, dtype=torch.long, device=self.device)
        self.valid = torch.zeros((batch, heads, 0), dtype=torch.bool, device=self.device)
        self.state = {
            f"{g.prefix}{name}": torch.zeros((batch, heads, 0), dtype=dtype, device=self.device)
            for g in self.groups
            for name, dtype in g.policy.state.items()
        }
        self.real_seen = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def _reallocate(self, capacity: int) -> None:
        """Move storage to ``capacity`` slots (grow, or shrink to free memory)."""

        def resize(tensor: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
            shape = (*tensor.shape[:2], capacity, *tensor.shape[3:])
            fresh = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
            keep = min(self.used, capacity)
            fresh[:, :, :keep] = tensor[:, :, :keep]
            return fresh

        self.keys, self.values = resize(self.keys, 0), resize(self.values, 0)
        self.positions, self.valid = resize(self.positions, -1), resize(self.valid, False)
        self.state = {name: resize(tensor, 0) for name, tensor in self.state.items()}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        count = key_states.shape[2]
        needed = self.used + count + 1  # +1: a scratch slot for no-op moves in `_compact`
        if needed > self.capacity:
            # amortized growth for unbounded heads; bounded layers shrink back after eviction
            self._reallocate(needed + max(16, needed // 8))
        start = self.used
        self.past_packed = self.packed_tokens is not None
        self.keys[:, :, start : start + count] = key_states
        self.values[:, :, start : start + count] = value_states
        self.valid[:, :, start : start + count] = True
        for tensor in self.state.values():
            tensor[:, :, start : start + count] = 0
        self.used += count
        self.seen += count
        self.pending = (start, count)
        _active.layer = self
        return self.keys[:, :, : self.used], self.values[:, :, : self.used]

    # --- called by the attention function --------------------------------------------------------
    def begin_attention(self, query_valid: torch.Tensor | None) -> torch.Tensor:
        """Mark the appended tokens' pads and positions; return the queries' positions [B, q] (-1 = pad)."""
        start, count = self.pending
        offsets = torch.arange(count, device=self.device)
        if query_valid is None:
            query_positions = self.real_seen[:, None] + offsets
        else:
            query_valid = query_valid.to(self.device)
            ranks = torch.cumsum(query_valid.long(), dim=1) - 1
            query_positions = torch.where(query_valid, self.real_seen[:, None] + ranks, -1)
            self.valid[:, :, start : start + count] &= query_valid[:, None, :]
        self.positions[:, :, start : start + count] = query_positions[:, None, :]
        if query_valid is None and self.packed_tokens is not None:
            self.packed_tokens += count
        else:
            self.packed_tokens = None
        self.appended_pads = query_valid is not None
        new_real = count if query_valid is None else query_valid.sum(dim=1)
        self.real_seen = self.real_seen + new_real
        if self.budget is None:
            self._resolve_budget(count)
        return query_positions

    def _resolve_budget(self, first_call_tokens: int) -> None:
        batch = self.real_seen.shape[0]
        if self.prompt_tokens is not None:
            prompt = torch.full((batch,), self.prompt_tokens, dtype=torch.long, device=self.device)
        else:
            prompt = self.real_seen
            if first_call_tokens == 1 and any(h.budget.ratio is not None for row in self.rows for h in row.heads):
                raise KVPolicyError(
                    "a ratio budget is resolved from the prompt, but the first forward pass had one token; "
                    "pass the prompt length: session.new_cache(prompt_tokens=N), or use a budget in tokens"
                )
        if len(self.rows) not in (1, batch):
            raise KVPolicyError(f"the cache was made for {len(self.rows)} batch rows but the batch has {batch}")
        budget = [
            [h.budget.resolve(prompt[b : b + 1])[0] for h in self.rows[b if len(self.rows) > 1 else 0].heads]
            for b in range(batch)
        ]
        self.budget = torch.tensor(budget, dtype=torch.long, device=self.device)
        if bool(self.bounded_cells.all()) and int(self.budget.min()) == int(self.budget.max()):
            self.uniform_limit = int(self.budget.max())

    def key_mask(self, query_positions: torch.Tensor, slots: int, sliding_window: int | None) -> torch.Tensor:
        """Which slots each query may attend: [B, Hkv, q, slots] bool (valid, causal, inside the window)."""
        key_positions = self.positions[:, :, None, :slots]
        query_positions = query_positions[:, None, :, None]
        mask = self.valid[:, :, None, :slots] & (key_positions <= query_positions)
        if sliding_window is not None:
            mask &= key_positions > query_positions - sliding_window
        return mask

    def end_attention(self, stats: AttentionStats | None) -> None:
        """Let the policies observe this call, then evict what is over budget."""
        if stats is not None:
            for group in self.groups:
                if group.policy.needs:
                    group.policy.observe(self._group_state(group), stats)
        self.pending = None
        _active.layer = None
        self._evict()

    def _group_state(self, group: PolicyGroup) -> dict[str, torch.Tensor]:
        return {name: self.state[f"{group.prefix}{name}"][:, :, : self.used] for name in group.policy.state}

    # --- eviction --------------------------------------------------------------------------------
    def _scores(self) -> torch.Tensor:
        view = TokenView(
            positions=self.positions[:, :, : self.used],
            valid=self.valid[:, :, : self.used],
            seen=self.real_seen,
            budget=self.budget,
        )
        scores = None
        for group in self.groups:
            group_scores = _checked(group.policy, group.policy.score(self._group_state(group), view), view.valid)
            heads = group.heads.to(self.device)[:, :, None]
            scores = group_scores if scores is None else torch.where(heads, group_scores, scores)
        return scores.masked_fill(~view.valid, -torch.inf)

    def _evict(self) -> None:
        if self.packed_tokens is not None and not self.drops_early:
            if not self.bounded:
                return
            if self.uniform_limit is not None:
                over = self.packed_tokens - self.uniform_limit
                if over <= self.slack:
                    return
                if over == 1:
                    self._drop_one(self._scores())  # the decode step: one token out per head
                    self.evictions += 1
                    return
        count = self.valid[:, :, : self.used].sum(dim=2)
        unbounded = ~self.bounded_cells.to(self.device)
        limit = torch.where(unbounded, count, self.budget)
        packed = int(count.min()) == self.used  # every head's tokens fill slots [0, used)
        # gaps left by rows that keep fewer tokens are harmless (masked); pads just appended are not kept
        if not self.appended_pads and int((count - limit).max()) <= self.slack:
            return
        scores = self._scores()
        keep = torch.minimum(limit, (scores > -torch.inf).sum(dim=2))
        drop = count - keep
        if packed and int(drop.min()) == 1 and int(drop.max()) == 1:
            self._drop_one(scores)  # the decode step: one token out per head
        else:
            self._compact(scores, keep)
        self.evictions += 1
        target = int(keep.max()) + self.slack + 2  # room for the next token and the scratch slot
        if self.bounded and self.capacity > target + max(16, target // 8):
            self._reallocate(target)

    def _drop_one(self, scores: torch.Tensor) -> None:
        """Evict each head's lowest-scoring token by moving its last slot into the gap."""
        last = self.used - 1
        dst = scores.argmin(dim=2, keepdim=True)
        src = torch.full_like(dst, last)
        for name in ("keys", "values", "positions"):
            setattr(self, name, _move(getattr(self, name), src, dst))
        self.state = {name: _move(tensor, src, dst) for name, tensor in self.state.items()}
        self.valid[:, :, last] = False
        self.positions[:, :, last] = -1
        self.used = last
        self.packed_tokens = last

    def _compact(self, scores: torch.Tensor, keep: torch.Tensor) -> None:
        """Keep the ``keep`` [B, Hkv] best slots of each head, packed into slots [0, keep)."""
        slots = scores.shape[2]
        kmax = int(keep.max())
        top = torch.topk(scores, kmax, dim=2, sorted=True).indices
        chosen = torch.arange(kmax, device=self.device) < keep[..., None]
        kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(2, top, chosen)
        slot = torch.arange(slots, device=self.device)
        holes = ~kept & (slot < keep[..., None])  # slots to fill
        movers = kept & (slot >= keep[..., None])  # survivors that sit past the new length
        moves = int(movers.sum(dim=2).max())
        if moves:
            scratch = self.capacity - 1
            if moves == 1:
                present = movers.any(dim=2, keepdim=True)
                dst, src = holes.float().argmax(2, keepdim=True), movers.float().argmax(2, keepdim=True)
            else:
                dst = torch.sort((~holes).to(torch.int8), dim=2, stable=True).indices[..., :moves]
                src = torch.sort((~movers).to(torch.int8), dim=2, stable=True).indices[..., :moves]
                present = torch.arange(moves, device=self.device) < movers.sum(dim=2, keepdim=True)
            dst = torch.where(present, dst, scratch)
            src = torch.where(present, src, scratch)
            for name in ("keys", "values", "positions"):
                setattr(self, name, _move(getattr(self, name), src, dst))
            self.state = {name: _move(tensor, src, dst) for name, tensor in self.state.items()}
        new_used = kmax
        self.valid[:, :, : max(self.used, new_used)] = torch.arange(max(self.used, new_used), device=self.device) < keep[..., None]
        self.positions[:, :, :new_used].masked_fill_(~self.valid[:, :, :new_used], -1)
        self.used = new_used
        self.packed_tokens = new_used if int(keep.min()) == new_used else None

    # --- transformers' Cache protocol --------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.used + query_length, self.seen - self.used

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self.budget, self.seen, self.used, self.pending = None, 0, 0, None
        self.packed_tokens, self.uniform_limit = 0, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KVPolicyError("beam search is not supported with a kvpolicy cache; use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise KVPolicyError("num_return_sequences/beam expansion is not supported with a kvpolicy cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise KVPolicyError("beam search is not supported with a kvpolicy cache")

    def crop(self, max_length: int) -> None:
        raise KVPolicyError("cropping (assisted decoding) is not supported with a kvpolicy cache")

    # --- inspection --------------------------------------------------------------------------------
    def kept_positions(self) -> list[list[list[int]]]:
        """Sorted real-token positions kept per [batch row][KV head] (for tests and reports)."""
        if not self.is_initialized:
            return []
        positions = self.positions[:, :, : self.used]
        return [
            [sorted(positions[b, h][self.valid[b, h, : self.used]].tolist()) for h in range(positions.shape[1])]
            for b in range(positions.shape[0])
        ]

    def memory(self) -> dict[str, int]:
        if not self.is_initialized:
            return {"live_kv_bytes": 0, "allocated_kv_bytes": 0, "metadata_bytes": 0, "tokens_min": 0, "tokens_max": 0}
        tokens = self.valid.sum(dim=2)
        per_token = (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()
        metadata = [self.positions, self.valid, *self.state.values()]
        return {
            "live_kv_bytes": int(tokens.sum()) * per_token,
            "allocated_kv_bytes": _storage_bytes(self.keys) + _storage_bytes(self.values),
            "metadata_bytes": sum(_storage_bytes(t) for t in metadata),
            "tokens_min": int(tokens.min()),
            "tokens_max": int(tokens.max()),
        }


def _checked(policy: Policy, scores: object, valid: torch.Tensor) -> torch.Tensor:
    """A policy's scores, or a clear error naming the policy when they cannot be used."""
    if not isinstance(scores, torch.Tensor) or scores.shape != valid.shape:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise KVPolicyError(
            f"policy {policy.name!r} returned scores of shape {shape}; expected [batch, kv_heads, slots] = "
            f"{tuple(valid.shape)}"
        )
    if bool(torch.isnan(scores).any()):
        raise KVPolicyError(f"policy {policy.name!r} returned NaN scores; use -inf to drop a token, +inf to pin it")
    return scores.float()


def _move(tensor: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """tensor[b, h, dst] = tensor[b, h, src] along dim 2 (src/dst: [B, Hkv, m])."""
    index_shape = (*src.shape, *tensor.shape[3:])
    src_index = src.reshape(*src.shape, *([1] * (tensor.dim() - 3))).expand(index_shape)
    dst_index = dst.reshape(*dst.shape, *([1] * (tensor.dim() - 3))).expand(index_shape)
    return tensor.scatter_(2, dst_index, tensor.gather(2, src_index))


def _storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


class PolicyCache(Cache):
    """A KV cache that evicts per (batch row, KV head) as its recipe's policies decide."""

    def __init__(self, layers: list[PolicyLayer]):
        super().__init__(layers=layers)

    def memory_report(self) -> MemoryReport:
        return MemoryReport([layer.memory() for layer in self.layers])

    def kept_positions(self, layer_idx: int) -> list[list[list[int]]]:
        return self.layers[layer_idx].kept_positions()


def build_groups(rows: list[LayerPlan], policies: dict[tuple[str, str], Policy]) -> list[PolicyGroup]:
    """One PolicyGroup per distinct (policy, params) among the layer's (row, head) cells."""
    masks: dict[tuple[str, str], torch.Tensor] = {}
    for row_index, row in enumerate(rows):
        for head_index, head in enumerate(row.heads):
            key = (head.policy, repr(head.params))
            mask = masks.setdefault(key, torch.zeros(len(rows), len(row.heads), dtype=torch.bool))
            mask[row_index, head_index] = True
    return [PolicyGroup(policies[key], mask, f"{index}.") for index, (key, mask) in enumerate(masks.items())]


__all__ = ["PolicyCache", "PolicyLayer", "MemoryReport", "Budget", "active_layer", "build_groups"]

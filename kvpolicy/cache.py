"""`PolicyCache`: a transformers `Cache` whose layers really evict.

Storage per layer starts *dense*: ``[batch, kv_heads, slots, head_dim]`` with a validity
flag and the token's position per slot, so every (batch row, KV head) "cell" may keep its
own set of tokens. New tokens are appended at a common slot offset; eviction keeps each
cell's top-scoring tokens and packs them into its first slots by moving the few survivors
that sit past the new length into the holes (a decode step moves one token per cell, not
the whole cache). After the prompt, storage shrinks to the budget, so the memory is freed
rather than masked.

Dense storage gives every cell the room of the largest one. When the cells of a layer keep
different numbers of tokens (per-head budgets from a recipe's ``heads:`` rules, a policy that
splits the budget among heads such as AdaKV, ratio budgets over prompts of different
lengths, a full-cache row next to evicting ones), the layer switches to *ragged* storage
at the compaction that makes them differ, if equal-width storage would hold more than
`RAGGED_MIN_SAVING` more slots:

* K and V live in one flat buffer per layer, ``[sum of capacities, head_dim]``; cell ``c``
  owns the contiguous segment ``[offset[c], offset[c] + cap[c])``, sized to its budget
  plus ``slack`` plus one slot for the token a decode step appends before it evicts.
  Between forward passes a cell's ``n[c]`` tokens sit at the start of its segment.
* The per-slot metadata (``valid``, ``positions``, policy ``state``: a few bytes per token
  against ``2 * head_dim * dtype`` bytes of K/V) keeps the dense ``[B, Hkv, slots]``
  layout, so policies, statistics and masks work unchanged: slot ``s < n[c]`` of cell ``c``
  is flat row ``offset[c] + s``; a forward pass appends its tokens at the common slots
  ``[used, used + q)`` of the metadata and at ``offset[c] + n[c] + i`` of each cell's segment.
  The metadata is counted in the memory report (``metadata_bytes``).
* Attention reads a dense padded copy of the one layer being computed (a gather; cells
  with fewer tokens padded with masked slots): transient workspace, one layer at a time,
  reported as ``workspace_kv_bytes``, not cache. Both the torch reference and the Triton
  kernels take that copy as they take dense storage (the kernels could read the segments
  through per-cell base offsets instead; not done yet).
* After each pass the cell's tokens are packed back to the start of its segment. A decode
  step moves at most one K/V row per cell: the new token lands in the slot of the evicted
  one (or stays put when the cell is under budget). A segment that runs out of room (a
  full-cache cell that keeps growing, a long prompt chunk) triggers a re-layout of the
  layer with amortized headroom; after a compaction the buffer shrinks back when it holds
  more than 1/16 over its cells' targets.

Dense layers (every cell alike, the common case) keep the dense layout and its fast paths.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import KVPolicyError
from .memory import MemoryReport
from .plan import Budget, LayerPlan
from .policies.base import AttentionStats, Policy, TokenView

# The attention function gets no handle to the cache, so each layer announces itself
# here in `update`, right before the model calls attention for that same layer.
_active = threading.local()

#: A layer goes ragged when equal-width storage would hold this much more than per-cell segments.
RAGGED_MIN_SAVING = 1 / 16


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
        # statistics only the first attention call reads (a policy's `profile` of the prompt, e.g. FastGen)
        self.profile_needs = frozenset().union(*(g.policy.profile_needs for g in groups)) - self.needs
        self.profiling = [g for g in groups if g.policy.profile_needs]
        self.profiled = not self.profiling
        self.near_ratio = torch.zeros(len(rows), len(rows[0].heads), dtype=torch.float64)  # per cell
        for g in groups:
            if "near_colsum_heads" in g.policy.needs | g.policy.profile_needs:
                self.near_ratio[g.heads] = g.policy.near_ratio
        # per-slot token ids, kept only when a policy reads them (FastGen's special/punctuation tokens)
        self.token_id_policies = [g.policy.name for g in groups if g.policy.needs_token_ids]
        self.token_feed: TokenFeed | None = None  # set by the PolicyCache: the input_ids of the current forward
        # policies that set their cells' budgets at every eviction (FastGen: shares of the current length)
        self.dynamic = [g for g in groups if g.policy.dynamic_budget]
        self.dynamic_cells = torch.stack([g.heads for g in self.dynamic]).any(dim=0) if self.dynamic else None
        self.last_rows_window = max([g.policy.last_rows_window for g in groups if "last_rows" in g.policy.needs] or [0])
        cells = [head for row in rows for head in row.heads]
        self.bounded_cells = torch.tensor(
            [[h.budget.tokens is not None or h.budget.ratio is not None for h in row.heads] for row in rows]
        )
        if self.dynamic_cells is not None:
            self.bounded_cells |= self.dynamic_cells
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
        self._nan_check = NaNCheck()
        self.backend = "torch"  # set by the session: "torch" or "triton" for the tracking attention
        # policies that split a row's budget among their heads (AdaKV), once per row at its first eviction
        self.allocating = [g for g in groups if g.policy.allocates]
        self.allocated: torch.Tensor | None = None  # [B, Hkv] bool: cells whose budgets are fixed
        self._allocation_done = False
        # ragged storage (see the module docstring); None/0 while the layer is dense
        self.ragged = False
        self.offset: torch.Tensor | None = None  # [B, Hkv] first flat row of each cell's segment
        self.cap: torch.Tensor | None = None  # [B, Hkv] rows in each cell's segment
        self.cell_tokens: torch.Tensor | None = None  # [B, Hkv] tokens at the start of each segment
        self.room = 0  # min over cells of cap - cell_tokens, between forward passes
        self.appended = 0  # slot of the first token appended by the last forward (ragged bookkeeping)
        self._view: tuple[torch.Tensor, torch.Tensor] | None = None  # the dense copy attention reads
        self.workspace_bytes = 0  # largest such copy so far
        self.cell_state: dict[str, torch.Tensor] = {}  # per-cell policy state, [B, Hkv] each (set at initialization)

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
        if self.token_id_policies:
            self.state["token_ids"] = torch.zeros((batch, heads, 0), dtype=torch.int32, device=self.device)
        self.cell_state = {
            f"{g.prefix}{name}": torch.zeros((batch, heads), dtype=dtype, device=self.device)
            for g in self.groups
            for name, dtype in g.policy.cell_state.items()
        }
        self.real_seen = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        """Slots per cell in the metadata (and in K/V while the layer is dense)."""
        return self.valid.shape[2]

    def _reallocate(self, capacity: int) -> None:
        """Move storage to ``capacity`` slots (grow, or shrink to free memory); ragged K/V stay as they are."""

        def resize(tensor: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
            shape = (*tensor.shape[:2], capacity, *tensor.shape[3:])
            fresh = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
            keep = min(self.used, capacity)
            fresh[:, :, :keep] = tensor[:, :, :keep]
            return fresh

        if not self.ragged:
            self.keys, self.values = resize(self.keys, 0), resize(self.values, 0)
        self.positions, self.valid = resize(self.positions, -1), resize(self.valid, False)
        self.state = {name: resize(tensor, 0) for name, tensor in self.state.items()}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.ragged:
            return self._ragged_update(key_states, value_states)
        count = key_states.shape[2]
        needed = self.used + count + 1  # +1: a scratch slot for no-op moves in `_compact`
        if needed > self.capacity:
            # amortized growth for unbounded heads; bounded layers shrink back after eviction
            grown = needed + self._margin(needed)
            if self.uniform_limit is not None:
                # every head bounded alike: a cache streaming at its budget needs the budget, the slack, this
                # call's tokens and the scratch slot, and no more (growth past it would never be freed)
                grown = min(grown, max(needed, self.uniform_limit + self.slack + count + 1))
            self._reallocate(grown)
        start = self.used
        self.past_packed = self.packed_tokens is not None
        self.keys[:, :, start : start + count] = key_states
        self.values[:, :, start : start + count] = value_states
        self._append_slots(start, count)
        return self.keys[:, :, : self.used], self.values[:, :, : self.used]

    def _margin(self, slots: int) -> int:
        """Free slots kept past ``slots`` when storage grows (and tolerated before it shrinks back).

        Growing unbounded heads get an eighth; layers whose budgets grow with the sequence (FastGen)
        a thirty-second, so that their memory stays close to what they keep.
        """
        return slots // 32 + 4 if self.dynamic else max(16, slots // 8)

    def _append_token_ids(self, start: int, count: int) -> None:
        ids = self.token_feed.ids if self.token_feed is not None else None
        if ids is None:
            raise KVPolicyError(
                f"policy {self.token_id_policies[0]!r} reads the token ids of the cached tokens, but this forward pass "
                "gave none: call the model with input_ids (not inputs_embeds alone), on the model the session was "
                "attached to, with the cache made by session.new_cache()"
            )
        if ids.shape != (self.valid.shape[0], count):
            raise KVPolicyError(
                f"the forward pass's input_ids have shape {tuple(ids.shape)} but layer {self.layer_idx} got "
                f"{count} new tokens for {self.valid.shape[0]} rows"
            )
        self.state["token_ids"][:, :, start : start + count] = ids.to(self.device, torch.int32)[:, None, :]

    def attention_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the slots in use as [B, Hkv, used, D]: views of dense storage, or the ragged layer's copy."""
        if self._view is not None:
            return self._view
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
        if self.allocating:
            self.allocated = torch.zeros_like(self.budget, dtype=torch.bool)
        elif self.dynamic:
            pass  # budgets that change at every eviction: no one limit for the dense decode fast path
        elif bool(self.bounded_cells.all()) and int(self.budget.min()) == int(self.budget.max()):
            self.uniform_limit = int(self.budget.max())

    def key_mask(self, query_positions: torch.Tensor, slots: int, sliding_window: int | None) -> torch.Tensor:
        """Which slots each query may attend: [B, Hkv, q, slots] bool (valid, causal, inside the window)."""
        key_positions = self.positions[:, :, None, :slots]
        query_positions = query_positions[:, None, :, None]
        mask = self.valid[:, :, None, :slots] & (key_positions <= query_positions)
        if sliding_window is not None:
            mask &= key_positions > query_positions - sliding_window
        return mask

    @property
    def call_needs(self) -> frozenset[str]:
        """The statistics this attention call must return: the first call adds the profiling ones."""
        return self.needs if self.profiled else self.needs | self.profile_needs

    def near_band(self) -> torch.Tensor:
        """[B, Hkv]: the width of each cell's local band for ``near_colsum_heads`` (ceil(near_ratio x seen))."""
        ratio = self.near_ratio.to(self.device)
        return torch.ceil(self.real_seen[:, None].double() * ratio - 1e-9).long().clamp(min=1)

    def end_attention(self, stats: AttentionStats | None) -> None:
        """Let the policies observe this call, then evict what is over budget."""
        if not self.profiled:
            view = self._view_of_tokens()
            for group in self.profiling:
                group.policy.profile(self._group_state(group), stats, view)
            self.profiled = True
        if stats is not None:
            for group in self.groups:
                if group.policy.needs:
                    group.policy.observe(self._group_state(group), _stats_for(group.policy, stats))
        self.appended = self.pending[0]
        self.pending = None
        _active.layer = None
        self._view = None
        self._evict()

    def _group_state(self, group: PolicyGroup) -> dict[str, torch.Tensor]:
        state = {name: self.state[f"{group.prefix}{name}"][:, :, : self.used] for name in group.policy.state}
        state.update((name, self.cell_state[f"{group.prefix}{name}"]) for name in group.policy.cell_state)
        return state

    def _view_of_tokens(self) -> TokenView:
        ids = self.state.get("token_ids")
        return TokenView(
            positions=self.positions[:, :, : self.used],
            valid=self.valid[:, :, : self.used],
            seen=self.real_seen,
            budget=self.budget,
            token_ids=ids[:, :, : self.used] if ids is not None else None,
        )

    # --- eviction --------------------------------------------------------------------------------
    def _scores(self) -> torch.Tensor:
        view = self._view_of_tokens()
        scores = None
        for group in self.groups:
            group_scores = _checked(group.policy, group.policy.score(self._group_state(group), view), view.valid)
            self._nan_check.note(group.policy, group_scores)
            heads = group.heads.to(self.device)[:, :, None]
            scores = group_scores if scores is None else torch.where(heads, group_scores, scores)
        return scores.masked_fill(~view.valid, -torch.inf)

    def _evict(self) -> None:
        if self.dynamic:
            self._set_dynamic_budgets()
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
        if self.allocated is not None and not self.allocation_done:
            self._allocate(count, unbounded)
        limit = torch.where(unbounded, count, self.budget)
        if self.ragged:
            self._ragged_evict(count, limit)
            return
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
            if self.bounded and self._ragged_pays(keep):
                self._to_ragged(keep)
                self.evictions += 1
                return
        self.evictions += 1
        target = int(keep.max()) + self.slack + 2  # room for the next token and the scratch slot
        if self.bounded and self.capacity > target + self._margin(target):
            self._reallocate(target)

    def _set_dynamic_budgets(self) -> None:
        """Budgets of the cells whose policies set them (FastGen), asked again at every eviction."""
        view = self._view_of_tokens()
        budget = self.budget
        for group in self.dynamic:
            given = group.policy.budgets(self._group_state(group), view)
            if not isinstance(given, torch.Tensor) or given.shape != budget.shape:
                shape = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
                raise KVPolicyError(
                    f"policy {group.policy.name!r} returned budgets of shape {shape}; expected [batch, kv_heads] = "
                    f"{tuple(budget.shape)}"
                )
            budget = torch.where(group.heads.to(self.device), given.to(budget).clamp(min=0), budget)
        self.budget = budget

    def _allocate(self, count: torch.Tensor, unbounded: torch.Tensor) -> None:
        """Let budget-splitting policies set the budgets of rows at their first eviction; fixed afterwards."""
        over = (count - torch.where(unbounded, count, self.budget)) > self.slack
        view = self._view_of_tokens()
        budget = self.budget
        for group in self.allocating:
            heads = group.heads.to(self.device).expand_as(over)
            rows = (over & heads).any(dim=1) & (heads & ~self.allocated).any(dim=1)
            if not bool(rows.any()):
                continue
            cells = heads & rows[:, None]
            given = group.policy.allocate(self._group_state(group), view, cells)
            if not isinstance(given, torch.Tensor) or given.shape != cells.shape:
                shape = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
                raise KVPolicyError(
                    f"policy {group.policy.name!r} allocated budgets of shape {shape}; expected [batch, kv_heads] = "
                    f"{tuple(cells.shape)}"
                )
            budget = torch.where(cells, given.to(budget).clamp(min=0), budget)
            self.allocated |= cells
        self.budget = budget
        if self.allocation_done and not self.dynamic and bool(self.bounded_cells.all()) and int(budget.min()) == int(budget.max()):
            self.uniform_limit = int(budget.max())  # an even split: the dense decode fast path applies again

    @property
    def allocation_done(self) -> bool:
        """Every cell of a budget-splitting policy has its budget fixed (a sync; only asked while pending)."""
        if self._allocation_done:
            return True
        owned = torch.stack([g.heads.to(self.device).expand_as(self.allocated) for g in self.allocating]).any(dim=0)
        self._allocation_done = bool((self.allocated | ~owned).all())
        return self._allocation_done

    # --- ragged storage (module docstring) --------------------------------------------------------
    def _targets(self, tokens: torch.Tensor) -> torch.Tensor:
        """Segment size [B, Hkv] for cells holding ``tokens``: budget + slack + 1, or amortized growth when unbounded."""
        bounded = self.bounded_cells.to(self.device).expand_as(tokens)
        grow = tokens + torch.clamp(tokens // 16, min=16)
        target = torch.maximum(self.budget, tokens) + self.slack + 1
        if self.dynamic_cells is not None:  # budgets that grow with the sequence: a little headroom
            target = torch.where(self.dynamic_cells.to(self.device), target + target // 32 + 1, target)
        return torch.where(bounded, target, grow)

    def _ragged_pays(self, keep: torch.Tensor) -> bool:
        targets = self._targets(keep)
        return int(targets.max()) * targets.numel() > (1 + RAGGED_MIN_SAVING) * int(targets.sum())

    def _segments(self, caps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        caps = caps.clamp(min=1)
        flat = caps.reshape(-1)
        return caps, (torch.cumsum(flat, 0) - flat).view_as(caps), int(flat.sum())

    def _to_ragged(self, keep: torch.Tensor) -> None:
        """Dense -> ragged, right after a compaction packed each cell's ``keep`` tokens into slots [0, keep)."""
        caps, offset, total = self._segments(self._targets(keep))
        width = int(keep.max())
        slot = torch.arange(width, device=self.device)
        present = slot < keep[..., None]
        rows = (offset[..., None] + slot)[present]
        flat = []
        for tensor in (self.keys, self.values):
            fresh = tensor.new_zeros(total, tensor.shape[-1])
            fresh.index_copy_(0, rows, tensor[:, :, :width][present])
            flat.append(fresh)
        self.keys, self.values = flat
        self.ragged, self.offset, self.cap, self.cell_tokens = True, offset, caps, keep.clone()
        self.packed_tokens, self.uniform_limit = None, None
        self.room = int((caps - keep).min())
        target = width + self.slack + 2
        if self.capacity > target + max(16, target // 8):
            self._reallocate(target)

    def _relayout(self, caps: torch.Tensor) -> None:
        """Move every cell's tokens into fresh segments of ``caps`` rows (grow or shrink)."""
        caps, offset, total = self._segments(caps)
        tokens = self.cell_tokens
        slot = torch.arange(int(tokens.max()), device=self.device)
        present = slot < tokens[..., None]
        src, dst = (self.offset[..., None] + slot)[present], (offset[..., None] + slot)[present]
        flat = []
        for tensor in (self.keys, self.values):
            fresh = tensor.new_zeros(total, tensor.shape[-1])
            fresh.index_copy_(0, dst, tensor.index_select(0, src))
            flat.append(fresh)
        self.keys, self.values = flat
        self.offset, self.cap = offset, caps
        self.room = int((caps - tokens).min())

    def _append_slots(self, start: int, count: int) -> None:
        """Per-slot metadata of ``count`` tokens just stored at slots [start, start + count); announce the layer."""
        self.valid[:, :, start : start + count] = True
        for tensor in self.state.values():
            tensor[:, :, start : start + count] = 0
        if self.token_id_policies:
            self._append_token_ids(start, count)
        self.used += count
        self.seen += count
        self.pending = (start, count)
        _active.layer = self

    def _ragged_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Append at each cell's own next segment row; return the dense copy of the layer attention reads."""
        batch, heads, count, _ = key_states.shape
        if count > self.room:
            needed = self.cell_tokens + count
            bounded = self.bounded_cells.to(self.device).expand_as(needed)
            grown = torch.where(bounded, needed, needed + torch.clamp(needed // 16, min=16))
            if self.dynamic_cells is not None:  # growing budgets (FastGen): amortize the re-layouts
                grown = torch.where(self.dynamic_cells.to(self.device), needed + needed // 32 + 1, grown)
            self._relayout(torch.where(self.cap >= needed, self.cap, grown))
        start = self.used
        if start + count > self.capacity:
            needed = start + count
            self._reallocate(needed + max(16, needed // 8))
        home = self.offset + self.cell_tokens
        rows = (home[..., None] + torch.arange(count, device=self.device)).reshape(-1)
        self.keys.index_copy_(0, rows, key_states.reshape(-1, key_states.shape[-1]).to(self.keys.dtype))
        self.values.index_copy_(0, rows, value_states.reshape(-1, value_states.shape[-1]).to(self.values.dtype))
        self.past_packed = False
        self._append_slots(start, count)
        # slot s of a cell: its row s below its token count, then (gap: any row, masked) this pass's rows
        slot = torch.arange(self.used, device=self.device)
        tokens = self.cell_tokens[..., None]
        local = torch.where(slot < tokens, slot, torch.where(slot >= start, tokens + slot - start, 0))
        index = (self.offset[..., None] + local).reshape(-1)
        keys = self.keys.index_select(0, index).view(batch, heads, self.used, -1)
        values = self.values.index_select(0, index).view(batch, heads, self.used, -1)
        self._view = (keys, values)
        self.workspace_bytes = max(self.workspace_bytes, _storage_bytes(keys) + _storage_bytes(values))
        return keys, values

    def _ragged_evict(self, count: torch.Tensor, limit: torch.Tensor) -> None:
        if not self.appended_pads and int((count - limit).max()) <= self.slack:
            scores, keep = None, count  # nothing to drop: only pack this pass's tokens into their segments
        else:
            scores = self._scores()
            keep = torch.minimum(limit, (scores > -torch.inf).sum(dim=2))
            self.evictions += 1
        one_step = self.used - self.appended == 1 and not self.appended_pads
        if one_step and (scores is None or int((count - keep).max()) <= 1):
            self._ragged_step(scores, count > keep)
        else:
            self._ragged_compact(scores, keep)

    def _ragged_step(self, scores: torch.Tensor | None, drop: torch.Tensor) -> None:
        """A decode step: the new token (common slot ``appended``) fills the evicted slot, or the cell's next one."""
        new, tokens, offset = self.appended, self.cell_tokens, self.offset
        if scores is None:
            victim = tokens
        else:
            victim = scores.masked_fill(~self.valid[:, :, : self.used], torch.inf).argmin(dim=2)
        gone = drop & (victim == new)  # the new token itself is evicted
        dst = torch.where(drop, victim, tokens)
        src = torch.full_like(dst, new)[..., None]
        self.positions = _move(self.positions, src, dst[..., None])
        self.state = {name: _move(tensor, src, dst[..., None]) for name, tensor in self.state.items()}
        leaves = (dst != new) | gone
        self.valid[:, :, new] &= ~leaves
        self.positions[:, :, new].masked_fill_(leaves, -1)
        self.valid.scatter_(2, dst[..., None], ~gone[..., None])
        rows = (offset + torch.where(drop & ~gone, victim, tokens)).reshape(-1)
        home = (offset + tokens).reshape(-1)
        for tensor in (self.keys, self.values):
            tensor.index_copy_(0, rows, tensor.index_select(0, home))
        self.cell_tokens = tokens + 1 - drop.long()
        self.used, self.room = torch.stack([self.cell_tokens.max(), (self.cap - self.cell_tokens).min()]).tolist()

    def _ragged_compact(self, scores: torch.Tensor | None, keep: torch.Tensor) -> None:
        """Keep ``keep`` [B, Hkv] tokens per cell (the best ``scores``, or every valid one when None), packed."""
        used, start = self.used, self.appended
        valid = self.valid[:, :, :used]
        if scores is None:
            kept = valid
        else:
            kmax = int(keep.max())
            top = torch.topk(scores, kmax, dim=2, sorted=True).indices
            chosen = torch.arange(kmax, device=self.device) < keep[..., None]
            kept = torch.zeros_like(valid).scatter_(2, top, chosen)
        width = int(keep.max())
        order = torch.sort((~kept).to(torch.int8), dim=2, stable=True).indices[..., :width]  # kept slots, in order
        slot = torch.arange(width, device=self.device)
        present = slot < keep[..., None]
        tokens, offset = self.cell_tokens[..., None], self.offset[..., None]
        src = offset + torch.where(order < tokens, order, tokens + order - start)
        dst = offset + slot
        move = present & (src != dst)
        if bool(move.any()):
            src, dst = src[move], dst[move]
            for tensor in (self.keys, self.values):
                tensor.index_copy_(0, dst, tensor.index_select(0, src))
        self.positions[:, :, :width] = self.positions[:, :, :used].gather(2, order).masked_fill_(~present, -1)
        self.positions[:, :, width:used] = -1
        for tensor in self.state.values():
            tensor[:, :, :width] = tensor[:, :, :used].gather(2, order).masked_fill_(~present, 0)
        self.valid[:, :, :used] = torch.arange(used, device=self.device) < keep[..., None]
        self.cell_tokens, self.used = keep.clone(), width
        targets = self._targets(keep)
        if self.keys.shape[0] > (1 + RAGGED_MIN_SAVING) * int(targets.sum()):
            self._relayout(targets)
        else:
            self.room = int((self.cap - keep).min())
        target = width + self.slack + 2
        if self.capacity > target + max(16, target // 8):
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
        self.allocated, self._allocation_done = None, False
        self.profiled = not self.profiling
        self.ragged, self.offset, self.cap, self.cell_tokens, self.room, self._view = False, None, None, None, 0, None

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

    def memory(self) -> dict[str, Any]:
        if not self.is_initialized:
            return {"live_kv_bytes": 0, "allocated_kv_bytes": 0, "metadata_bytes": 0, "tokens_min": 0, "tokens_max": 0,
                    "ragged": 0, "workspace_kv_bytes": 0, "by_label": {}}
        tokens = self.valid.sum(dim=2)
        per_token = (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()
        metadata = [self.positions, self.valid, *self.state.values(), *self.cell_state.values()]
        if self.ragged:
            metadata += [self.offset, self.cap, self.cell_tokens]
        allocated = _storage_bytes(self.keys) + _storage_bytes(self.values)
        return {
            "live_kv_bytes": int(tokens.sum()) * per_token,
            "allocated_kv_bytes": allocated,
            "metadata_bytes": sum(_storage_bytes(t) for t in metadata),
            "tokens_min": int(tokens.min()),
            "tokens_max": int(tokens.max()),
            "ragged": int(self.ragged),
            "workspace_kv_bytes": self.workspace_bytes,
            "by_label": self._memory_by_label(tokens, per_token, allocated),
        }

    def cell_labels(self) -> list[list[str]]:
        """A label per [batch row][KV head]: the policy's own (FastGen: the head's pattern), else its name."""
        batch, heads = self.valid.shape[:2]
        labels = [[""] * heads for _ in range(batch)]
        for group in self.groups:
            given = group.policy.cell_labels(self._group_state(group))
            owned = group.heads.expand(batch, heads).tolist()
            for b in range(batch):
                for h in range(heads):
                    if owned[b][h]:
                        labels[b][h] = given[b][h] if given is not None else group.policy.name
        return labels

    def _memory_by_label(self, tokens: torch.Tensor, per_token: int, allocated: int) -> dict[str, dict[str, int]]:
        """Cells, tokens, live and allocated K/V bytes per cell label (report time only: Python loops are fine)."""
        cells = tokens.numel()
        rows = self.cap.tolist() if self.ragged else None
        counts = tokens.tolist()  # one device sync, not one per cell
        out: dict[str, dict[str, int]] = {}
        for b, row in enumerate(self.cell_labels()):
            for h, label in enumerate(row):
                entry = out.setdefault(label, {"cells": 0, "tokens": 0, "live_kv_bytes": 0, "allocated_kv_bytes": 0})
                entry["cells"] += 1
                entry["tokens"] += counts[b][h]
                entry["live_kv_bytes"] += counts[b][h] * per_token
                # dense storage gives every cell the same share; ragged storage each cell its own segment
                entry["allocated_kv_bytes"] += rows[b][h] * per_token if rows is not None else allocated // cells
        return out


def _stats_for(policy: Policy, stats: AttentionStats) -> AttentionStats:
    """``stats`` as ``policy`` asked for them: ``last_rows`` holds the layer's widest window, so cut it to the policy's."""
    rows = stats.last_rows
    if rows is None or "last_rows" not in policy.needs or rows.shape[2] <= policy.last_rows_window:
        return stats
    return dataclasses.replace(stats, last_rows=rows[:, :, rows.shape[2] - policy.last_rows_window :])


def _checked(policy: Policy, scores: object, valid: torch.Tensor) -> torch.Tensor:
    """A policy's scores, or a clear error naming the policy when they cannot be used."""
    if not isinstance(scores, torch.Tensor) or scores.shape != valid.shape:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise KVPolicyError(
            f"policy {policy.name!r} returned scores of shape {shape}; expected [batch, kv_heads, slots] = "
            f"{tuple(valid.shape)}"
        )
    return scores.float()


class NaNCheck:
    """Raises when a policy's scores hold NaN (a plugin bug that would otherwise evict arbitrary tokens).

    On CPU every call is checked. On a GPU, reading a flag back waits for the device to drain
    its queue, once per layer and step: there the flags accumulate on the device and are
    read every ``every`` calls, so a bad policy is stopped within that many evictions.
    """

    def __init__(self, every: int = 32):
        self.every = every
        self.calls = 0
        self.flags: dict[str, torch.Tensor] = {}

    def note(self, policy: Policy, scores: torch.Tensor) -> None:
        nan = torch.isnan(scores).any()
        if scores.device.type == "cpu":
            if bool(nan):
                self._raise(policy.name)
            return
        flag = self.flags.get(policy.name)
        self.flags[policy.name] = nan if flag is None else flag | nan
        self.calls += 1
        if self.calls % self.every == 0:
            for name, flag in self.flags.items():
                if bool(flag):
                    self._raise(name)

    @staticmethod
    def _raise(name: str) -> None:
        raise KVPolicyError(f"policy {name!r} returned NaN scores; use -inf to drop a token, +inf to pin it")


def _move(tensor: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """tensor[b, h, dst] = tensor[b, h, src] along dim 2 (src/dst: [B, Hkv, m])."""
    index_shape = (*src.shape, *tensor.shape[3:])
    src_index = src.reshape(*src.shape, *([1] * (tensor.dim() - 3))).expand(index_shape)
    dst_index = dst.reshape(*dst.shape, *([1] * (tensor.dim() - 3))).expand(index_shape)
    return tensor.scatter_(2, dst_index, tensor.gather(2, src_index))


def _storage_bytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes()


@dataclass
class TokenFeed:
    """The ``input_ids`` [B, q] of the forward pass in progress, for layers that keep token ids (set by the session)."""

    ids: torch.Tensor | None = None


class PolicyCache(Cache):
    """A KV cache that evicts per (batch row, KV head) as its recipe's policies decide."""

    def __init__(self, layers: list[PolicyLayer]):
        super().__init__(layers=layers)
        # only when a policy reads token ids: the session's forward pre-hook fills it (attach.py)
        self.token_feed = TokenFeed() if any(layer.token_id_policies for layer in layers) else None
        for layer in layers:
            layer.token_feed = self.token_feed

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


__all__ = ["PolicyCache", "PolicyLayer", "MemoryReport", "Budget", "TokenFeed", "active_layer", "build_groups"]

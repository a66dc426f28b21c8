"""A paged KV cache with kvpolicy's policies: reading a batch of requests' blocks, writing new tokens, evicting.

Torch only (no vLLM), so that the tests of the main environment check it against a dense reference. The
engine's cache of one layer is seen as ``keys``/``values`` ``[blocks, kv_heads, block_size, head_dim]``; beside
it, per slot and KV head, the token's position (-1: empty) and the policies' state. Tokens are written at their
own slot (vLLM's slot mapping); an eviction moves each KV head's kept tokens into the free slots of the request's
arena (`schedule`), so heads hold different tokens in the same blocks and the blocks after the arena empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...backend.call import AttentionCall
from ...backend.dispatch import attend
from ...policies.base import TokenView
from ...policy_calls import NaNCheck, PolicyGroup, call_policy, checked, stats_for
from ...storage.base import top_kept


@dataclass
class PagedLayerCache:
    """One layer's paged storage: the engine's K/V blocks and kvpolicy's per-slot metadata beside them."""

    keys: torch.Tensor  # [blocks, Hkv, bs, D]
    values: torch.Tensor  # [blocks, Hkv, bs, D]
    positions: torch.Tensor  # [blocks, Hkv, bs] int32, -1: empty
    state: dict[str, torch.Tensor]  # name -> [blocks, Hkv, bs]

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, groups: list[PolicyGroup]) -> PagedLayerCache:
        blocks, heads, block_size, _ = keys.shape
        shape = (blocks, heads, block_size)
        state = {f"{g.prefix}{name}": torch.zeros(shape, dtype=dtype, device=keys.device)
                 for g in groups for name, dtype in g.policy.state.items()}
        return cls(keys, values, torch.full(shape, -1, dtype=torch.int32, device=keys.device), state)

    @property
    def block_size(self) -> int:
        return self.keys.shape[2]

    def metadata_bytes_per_block(self) -> int:
        tensors = [self.positions, *self.state.values()]
        return sum(t[0].numel() * t.element_size() for t in tensors)

    def write(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """New tokens (keys/values ``[N, Hkv, D]``) at their ``slots`` [N] (vLLM's slot mapping; < 0: padding)."""
        real = slots >= 0
        if not bool(real.all()):
            keys, values, slots, positions = keys[real], values[real], slots[real], positions[real]
        block, offset = slots // self.block_size, slots % self.block_size
        self.keys[block, :, offset] = keys.to(self.keys.dtype)
        self.values[block, :, offset] = values.to(self.values.dtype)
        self.positions[block, :, offset] = positions.to(torch.int32)[:, None]
        for tensor in self.state.values():
            tensor[block, :, offset] = 0  # a new token starts with no history


@dataclass
class RowBlocks:
    """The slots a batch of requests reads in one layer: each request's blocks in logical order, cut at its last
    token and left-padded with block 0 (vLLM's null block), so that every request's newest tokens end the row as
    they do in a dense cache.

    ``arena`` counts the leading logical blocks whose slots hold kept tokens in any order (their stored positions
    say which; 0 before the request's first eviction); the other blocks hold tokens at their own positions,
    valid from ``first`` to ``end`` (the tokens in so far).
    """

    block: torch.Tensor  # [R, T] int64 physical block of each slot
    offset: torch.Tensor  # [R, T] int64 slot within its block
    logical: torch.Tensor  # [R, T] int64 logical block of each slot, -1 for padding
    arena: torch.Tensor  # [R] int64
    first: torch.Tensor  # [R] int64
    end: torch.Tensor  # [R] int64

    @classmethod
    def of(cls, rows: list[tuple[list[int], list[int], int, int, int]], block_size: int) -> RowBlocks:
        """From (physical blocks, logical blocks, arena blocks, first position, end) per row."""
        per_row = []
        for physical, logical, arena, _, end in rows:
            offset = torch.arange(block_size).repeat(len(physical))
            logical_slot = torch.tensor(logical, dtype=torch.long).repeat_interleave(block_size)
            block = torch.tensor(physical, dtype=torch.long).repeat_interleave(block_size)
            # slots past the last token (the rest of the block being filled) are never read
            keep = (logical_slot < arena) | (logical_slot * block_size + offset < end)
            per_row.append((block[keep], offset[keep], logical_slot[keep]))
        width = max(1, max(len(block) for block, _, _ in per_row))
        block = torch.zeros(len(rows), width, dtype=torch.long)
        offset = torch.zeros(len(rows), width, dtype=torch.long)
        logical = torch.full((len(rows), width), -1, dtype=torch.long)
        for index, (row_block, row_offset, row_logical) in enumerate(per_row):
            size = len(row_block)
            block[index, width - size:], offset[index, width - size:] = row_block, row_offset
            logical[index, width - size:] = row_logical
        numbers = torch.tensor([row[2:] for row in rows], dtype=torch.long).view(len(rows), 3)
        return cls(block, offset, logical, numbers[:, 0], numbers[:, 1], numbers[:, 2])

    def within(self, arena: torch.Tensor) -> torch.Tensor:
        """[R, T] bool: the slots of each request's first ``arena`` [R] logical blocks."""
        return (self.logical >= 0) & (self.logical < arena[:, None])

    def layout(self, stored: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [R, Hkv, T] int64, -1 where empty; valid [R, Hkv, T]) from the ``stored`` positions gathered."""
        in_place = self.logical * block_size + self.offset  # the position a slot's token has if it never moved
        placed_ok = (self.logical >= 0) & (in_place >= self.first[:, None]) & (in_place < self.end[:, None])
        stored = stored.long()
        valid = torch.where(self.within(self.arena)[:, None], stored >= 0, placed_ok[:, None])
        return torch.where(valid, stored, -1), valid


class PagedPolicies:
    """One layer's policies over a paged cache: evict, and attend with the statistics they read."""

    def __init__(self, groups: list[PolicyGroup], backend: str = "torch"):
        self.groups, self.backend = groups, backend
        self.needs = frozenset().union(*(g.policy.needs for g in groups))
        self.last_rows_window = max([g.policy.last_rows_window for g in groups if "last_rows" in g.policy.needs] or [0])
        self.nan_check = NaNCheck()

    def _gather_state(self, cache: PagedLayerCache, block: torch.Tensor, offset: torch.Tensor) -> dict[str, torch.Tensor]:
        # [R, T] indices on dims 0 and 2 of [blocks, Hkv, bs] give [R, T, Hkv]
        return {name: tensor[block, :, offset].transpose(1, 2) for name, tensor in cache.state.items()}

    def _state_of(self, group: PolicyGroup, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: state[f"{group.prefix}{name}"] for name in group.policy.state}

    def scores(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        scores = None
        for group in self.groups:
            given = call_policy(group.policy, "score", group.policy.score, self._state_of(group, state), view)
            group_scores = checked(group.policy, "returned scores", given, view.valid.shape,
                                   "requests, kv_heads, slots").float()
            self.nan_check.note(group.policy, group_scores)
            cells = group.cells.to(group_scores.device)[:, :, None]
            scores = group_scores if scores is None else torch.where(cells, group_scores, scores)
        return scores.masked_fill(~view.valid, -torch.inf)

    def evict(self, cache: PagedLayerCache, rows: RowBlocks, budget: torch.Tensor, seen: torch.Tensor,
              arena: torch.Tensor) -> None:
        """Keep each (request, KV head)'s ``budget`` [R] best tokens of ``rows`` in the request's first ``arena`` [R]
        blocks: kept tokens already there stay, the others move into the slots freed there."""
        block, offset = rows.block, rows.offset
        positions, valid = rows.layout(cache.positions[block, :, offset].transpose(1, 2), cache.block_size)
        state = self._gather_state(cache, block, offset)
        heads = positions.shape[1]
        view = TokenView(positions=positions, valid=valid, seen=seen, budget=budget[:, None].expand(-1, heads))
        scores = self.scores(state, view)
        keep = top_kept(scores, torch.minimum(view.budget, valid.sum(dim=2)))
        in_arena = rows.within(arena)[:, None]
        holes = in_arena & ~keep
        incoming = keep & ~in_arena
        hole_order = (~holes).to(torch.int8).argsort(dim=2, stable=True)  # each cell's holes first, in slot order
        rank = incoming.long().cumsum(dim=2) - 1
        target = hole_order.gather(2, rank.clamp(min=0))
        row, head, source = incoming.nonzero(as_tuple=True)
        dest = target[row, head, source]
        src_block, src_offset = block[row, source], offset[row, source]
        dst_block, dst_offset = block[row, dest], offset[row, dest]
        for tensor in (cache.keys, cache.values, cache.positions, *cache.state.values()):
            tensor[dst_block, head, dst_offset] = tensor[src_block, head, src_offset]
        # arena slots left over (the head kept fewer newcomers than it dropped) are empty from now on
        filled = incoming.sum(dim=2, keepdim=True)
        unused = holes & ((holes.long().cumsum(dim=2) - 1) >= filled)
        row, head, slot = unused.nonzero(as_tuple=True)
        cache.positions[block[row, slot], head, offset[row, slot]] = -1

    def attend(self, cache: PagedLayerCache, rows: RowBlocks, query: torch.Tensor, query_index: torch.Tensor,
               query_positions: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of ``query`` [N, Hq, D] rows ``query_index`` [R, q] (-1: pad; a request's tokens right-aligned)
        at ``query_positions`` [R, q] over the requests' blocks; the policies observe its statistics.
        Returns the output [R, q, Hq, D]."""
        block, offset = rows.block, rows.offset
        positions, valid = rows.layout(cache.positions[block, :, offset].transpose(1, 2), cache.block_size)
        keys = cache.keys[block, :, offset].transpose(1, 2)  # [R, Hkv, T, D]
        values = cache.values[block, :, offset].transpose(1, 2)
        query_valid = query_index >= 0
        grouped_query = query[query_index.clamp(min=0)].permute(0, 2, 1, 3)  # [R, Hq, q, D]
        width = query_index.shape[1]
        call = AttentionCall(
            keys=keys, values=values, valid=valid, key_positions=positions,
            query_positions=torch.where(query_valid, query_positions, -1),
            query_valid=None if bool(query_valid.all()) else query_valid,
            past_slots=keys.shape[2] - width, scaling=scaling, needs=self.needs,
            last_rows_window=self.last_rows_window, backend=self.backend,
        )
        result = attend(grouped_query, call)
        if result.stats is not None and self.needs:
            state = self._gather_state(cache, block, offset)
            for group in self.groups:
                if group.policy.needs:
                    call_policy(group.policy, "observe", group.policy.observe, self._state_of(group, state),
                                stats_for(group.policy, result.stats))
            for name, tensor in cache.state.items():
                tensor[block, :, offset] = state[name].transpose(1, 2)
        return result.output

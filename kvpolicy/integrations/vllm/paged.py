"""A paged KV cache with kvpolicy's policies: reading a batch of requests' blocks, writing new tokens, evicting.

Torch only (no vLLM), so that the tests of the main environment check it against a dense reference. The
engine's cache of one layer is seen as ``keys``/``values`` ``[blocks, kv_heads, block_size, head_dim]``; beside
it, per slot and KV head, the token's position (-1: empty) and the policies' state. Tokens are written at their
own slot (vLLM's slot mapping); an eviction moves each KV head's kept tokens into the free slots of the request's
arena (`schedule`), so heads hold different tokens in the same blocks and the blocks after the arena empty.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from ...backend.call import AttentionCall
from ...backend.dispatch import attend
from ...cache.policy_group import LayerPolicies, PolicyGroup
from ...policies.base import AttentionStats, TokenView
from ...storage.base import top_kept


@dataclass
class PagedLayerCache:
    """One layer's paged storage: the engine's K/V blocks and kvpolicy's per-slot metadata beside them."""

    keys: torch.Tensor  # [blocks, Hkv, bs, D]
    values: torch.Tensor  # [blocks, Hkv, bs, D]
    positions: torch.Tensor  # [blocks, Hkv, bs] int32, -1: empty
    state: dict[str, torch.Tensor]  # name -> [blocks, Hkv, bs]

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, policies: LayerPolicies) -> PagedLayerCache:
        blocks, heads, block_size, _ = keys.shape
        shape = (blocks, heads, block_size)
        state = {name: torch.zeros(shape, dtype=dtype, device=keys.device) for name, dtype in policies.token_state().items()}
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
        count, heads = keys.shape[0], self.keys.shape[1]
        block, offset = slots // self.block_size, slots % self.block_size
        # each (token, KV head) as one row of the cache seen as [blocks * Hkv * bs, ...]: one index_copy_ per tensor
        # (indexing [block, :, offset] takes torch's slow path; it cost ~0.4 ms a layer at 9 requests)
        head = torch.arange(heads, device=slots.device)
        rows = ((block[:, None] * heads + head) * self.block_size + offset[:, None]).reshape(-1)  # [N * Hkv]
        both = self.both_halves()
        if both is not None:
            new = torch.cat([keys, values], dim=-1).to(both.dtype)
            _slot_rows(both).index_copy_(0, rows, new.reshape(count * heads, -1))
        else:
            self.keys[block, :, offset] = keys.to(self.keys.dtype)
            self.values[block, :, offset] = values.to(self.values.dtype)
        _slot_rows(self.positions).index_copy_(0, rows, positions.to(torch.int32)[:, None].expand(count, heads).reshape(-1))
        for tensor in self.state.values():
            _slot_rows(tensor).index_fill_(0, rows, 0)  # a new token starts with no history

    def both_halves(self) -> torch.Tensor | None:
        """Keys and values as one [blocks, Hkv, bs, 2D] tensor where they are the two halves of vLLM's slots."""
        if not _halves_of_one_slot(self.keys, self.values):
            return None
        return torch.as_strided(self.keys, (*self.keys.shape[:-1], 2 * self.keys.shape[-1]), self.keys.stride())


def _slot_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A cache tensor [blocks, Hkv, bs, ...] as one row per slot (a view: writes land in the cache)."""
    return tensor.view(-1, *tensor.shape[3:])


def _halves_of_one_slot(keys: torch.Tensor, values: torch.Tensor) -> bool:
    dim = keys.shape[-1]
    return (keys.data_ptr() + dim * keys.element_size() == values.data_ptr() and keys.stride() == values.stride()
            and keys.stride(-2) == 2 * dim and keys.stride(-1) == 1)


class Workspace:
    """Buffers reused from one call to the next, grown as needed: what a layer's attention reads for one step.
    What `take` returns is valid until the next `take` of that name (the next layer), so it must not escape."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # a buffer made under inference mode (vLLM's steps) cannot be written outside it (a benchmark's call): one each
        key = (name, dtype, torch.device(device), torch.is_inference_mode_enabled())
        size = math.prod(shape)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = self._buffers[key] = torch.empty(size, dtype=dtype, device=device)
        return buffer[:size].view(shape)


#: the K/V every layer's attention reads, gathered from the blocks (one engine runs its layers one after another)
GATHER_WORKSPACE = Workspace()


@dataclass
class RowBlocks:
    """The blocks a batch of requests reads in one layer, in logical order, padded at the end with block 0 (vLLM's
    null block). Gathered, their slots are ``[R, Hkv, width]``: every block whole, or, for one request, cut right
    after its newest token, so that its newest tokens end the row as in a dense cache (SnapKV's observation window
    is the call's last slots; a batch of decode steps has one query per request and no such window).

    ``arena`` counts the leading logical blocks whose slots hold kept tokens in any order (their stored positions
    say which; 0 before the request's first eviction); the other blocks hold tokens at their own positions,
    valid from ``first`` to ``end`` (the tokens in so far).
    """

    blocks: torch.Tensor  # [R, nblk] int64 physical block ids
    logical: torch.Tensor  # [R, nblk] int64 logical block index, -1 for padding
    arena: torch.Tensor  # [R] int64
    first: torch.Tensor  # [R] int64
    end: torch.Tensor  # [R] int64
    block_size: int
    width: int
    _flat_rows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, rows: list[tuple[list[int], list[int], int, int, int]], block_size: int) -> RowBlocks:
        """From (physical blocks, logical blocks, arena blocks, first position, end) per row."""
        count = max(1, max(len(physical) for physical, *_ in rows))
        blocks = torch.zeros(len(rows), count, dtype=torch.long)
        logical = torch.full((len(rows), count), -1, dtype=torch.long)
        for index, (physical, logical_ids, *_) in enumerate(rows):
            blocks[index, : len(physical)] = torch.tensor(physical, dtype=torch.long)
            logical[index, : len(logical_ids)] = torch.tensor(logical_ids, dtype=torch.long)
        numbers = torch.tensor([row[2:] for row in rows], dtype=torch.long).view(len(rows), 3)
        width = count * block_size
        if len(rows) == 1 and rows[0][1] and rows[0][1][-1] >= rows[0][2]:  # one request; its last block in place
            width -= (rows[0][1][-1] + 1) * block_size - rows[0][4]
        return cls(blocks, logical, numbers[:, 0], numbers[:, 1], numbers[:, 2], block_size, width)

    def _rows_of(self, heads: int) -> torch.Tensor:
        # the (block, KV head) runs of bs slots, as rows of the cache seen as [blocks * Hkv, bs, ...], in attention's
        # [R, Hkv, nblk] order: index_select copies each run whole (advanced indexing on two dims was ~9x slower)
        index = self._flat_rows.get(heads)
        if index is None:
            head = torch.arange(heads, device=self.blocks.device)
            index = self._flat_rows[heads] = (self.blocks[:, None, :] * heads + head[None, :, None]).reshape(-1)
        return index

    def gather(self, tensor: torch.Tensor, into: tuple[Workspace, str, torch.dtype] | None = None) -> torch.Tensor:
        """``tensor`` [blocks, Hkv, bs, ...] at these rows' slots: [R, Hkv, width, ...] (one copy of whole blocks).
        ``into``: (workspace, name, dtype): the copy lands in that workspace buffer, converted to ``dtype``, valid
        until that name's next use."""
        rows, heads = self.blocks.shape[0], tensor.shape[1]
        source, index = tensor.view(-1, *tensor.shape[2:]), self._rows_of(heads)
        if into is None:
            picked = source.index_select(0, index)  # [R * Hkv * nblk, bs, ...]
        else:
            workspace, name, dtype = into
            shape = (index.numel(), *source.shape[1:])
            picked = torch.index_select(source, 0, index, out=workspace.take(name, shape, tensor.dtype, tensor.device))
            if dtype != tensor.dtype:
                picked = workspace.take(f"{name}:{dtype}", shape, dtype, tensor.device).copy_(picked)
        return picked.view(rows, heads, -1, *tensor.shape[3:])[:, :, : self.width]

    def scatter(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` [R, Hkv, width, ...] back into these rows' slots of ``tensor``."""
        rows, heads = self.blocks.shape[0], tensor.shape[1]
        runs = tensor.view(-1, *tensor.shape[2:])  # the cache's tensors are contiguous over (block, head)
        index = self._rows_of(heads)
        if self.width < self.blocks.shape[1] * self.block_size:  # the last block is cut: keep its tail as it is
            full = runs.index_select(0, index).view(rows, heads, -1, *tensor.shape[3:])
            full[:, :, : self.width] = values
        else:
            full = values
        runs.index_copy_(0, index, full.reshape(-1, *runs.shape[1:]).to(runs.dtype))

    def slot(self, row: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical (block, offset) of gathered slot ``index`` of ``row`` (equal-shaped index tensors)."""
        return self.blocks[row, index // self.block_size], index % self.block_size

    @functools.cached_property
    def slot_logical(self) -> torch.Tensor:
        """[R, width]: the logical block of each gathered slot (-1: padding)."""
        return self.logical.repeat_interleave(self.block_size, dim=1)[:, : self.width]

    def within(self, arena: torch.Tensor) -> torch.Tensor:
        """[R, width] bool: the slots of each request's first ``arena`` [R] logical blocks."""
        logical = self.slot_logical
        return (logical >= 0) & (logical < arena[:, None])

    @functools.cached_property
    def _placement(self) -> tuple[torch.Tensor, torch.Tensor]:
        # the same for every layer of a step: which slots hold kept tokens in any order, which hold theirs in place
        logical = self.slot_logical
        in_place = logical * self.block_size + torch.arange(self.width) % self.block_size
        placed_ok = (logical >= 0) & (in_place >= self.first[:, None]) & (in_place < self.end[:, None])
        return self.within(self.arena)[:, None], placed_ok[:, None]

    def layout(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [R, Hkv, T] int64, -1 where empty; valid [R, Hkv, T]) from the ``stored`` positions gathered."""
        in_arena, placed_ok = self._placement
        stored = stored.long()
        valid = torch.where(in_arena, stored >= 0, placed_ok)
        return torch.where(valid, stored, -1), valid


#: the statistics the Triton kernels compute from the blocks in place (`backend.triton_paged`), for a decode step
IN_PLACE_STATS = frozenset({"colsum", "last_rows"})


class PagedPolicies:
    """One layer's policies over a paged cache: evict, and attend with the statistics they read.

    ``backend="triton"`` (CUDA, or the interpreter in tests): a batch of decode steps whose policies read only
    `IN_PLACE_STATS` attends with `backend.triton_paged`, reading the blocks where they lie; anything else
    gathers the blocks and runs kvpolicy's attention over the copy with that backend.
    """

    def __init__(self, policies: LayerPolicies, backend: str = "torch"):
        self.policies, self.backend = policies, backend

    @staticmethod
    def _gather_state(cache: PagedLayerCache, rows: RowBlocks) -> dict[str, torch.Tensor]:
        return {name: rows.gather(tensor) for name, tensor in cache.state.items()}

    def _state_of(self, group: PolicyGroup, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: state[f"{group.prefix}{name}"] for name in group.policy.state}

    def scores(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        return self.policies.scores(lambda group: self._state_of(group, state), view)

    def evict(self, cache: PagedLayerCache, rows: RowBlocks, budget: torch.Tensor, seen: torch.Tensor,
              arena: torch.Tensor) -> None:
        """Keep each (request, KV head)'s ``budget`` [R] best tokens of ``rows`` in the request's first ``arena`` [R]
        blocks: kept tokens already there stay, the others move into the slots freed there."""
        positions, valid = rows.layout(rows.gather(cache.positions))
        state = self._gather_state(cache, rows)
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
        src_block, src_offset = rows.slot(row, source)
        dst_block, dst_offset = rows.slot(row, target[row, head, source])
        for tensor in (cache.keys, cache.values, cache.positions, *cache.state.values()):
            tensor[dst_block, head, dst_offset] = tensor[src_block, head, src_offset]
        # arena slots left over (the head kept fewer newcomers than it dropped) are empty from now on
        filled = incoming.sum(dim=2, keepdim=True)
        unused = holes & ((holes.long().cumsum(dim=2) - 1) >= filled)
        row, head, slot = unused.nonzero(as_tuple=True)
        block, offset = rows.slot(row, slot)
        cache.positions[block, head, offset] = -1

    def attend(self, cache: PagedLayerCache, rows: RowBlocks, query: torch.Tensor, query_index: torch.Tensor,
               query_positions: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of ``query`` [N, Hq, D] rows ``query_index`` [R, q] (-1: pad; a request's tokens right-aligned)
        at ``query_positions`` [R, q] over the requests' blocks; the policies observe its statistics.
        Returns the output [R, q, Hq, D]."""
        positions, valid = rows.layout(rows.gather(cache.positions))
        if self.backend == "triton" and query_index.shape[1] == 1 and bool((query_index >= 0).all()) \
                and self.policies.needs <= IN_PLACE_STATS:
            return self._attend_in_place(cache, rows, valid, query[query_index[:, 0]], scaling)
        # the torch path computes these in fp32: one conversion here, not one per matmul or query chunk
        dtype = torch.float32 if self.policies.needs or query_index.shape[1] == 1 else cache.keys.dtype
        # into buffers reused by every layer and step: in isolation, index_select into a reused buffer took half the
        # time of one into a fresh multi-MB tensor (end to end, at most ~10% of the layer, within this CPU's noise)
        dim, both = cache.keys.shape[-1], cache.both_halves()
        if both is not None:  # one gather for keys and values (faster than two of strided halves, matmuls included)
            gathered = rows.gather(both, (GATHER_WORKSPACE, "kv", dtype))  # [R, Hkv, T, 2D]
            keys, values = gathered[..., :dim], gathered[..., dim:]
        else:
            keys = rows.gather(cache.keys, (GATHER_WORKSPACE, "keys", dtype))
            values = rows.gather(cache.values, (GATHER_WORKSPACE, "values", dtype))
        query_valid = query_index >= 0
        grouped_query = query[query_index.clamp(min=0)].permute(0, 2, 1, 3).to(keys.dtype)  # [R, Hq, q, D]
        width = query_index.shape[1]
        call = AttentionCall(
            keys=keys, values=values, valid=valid, key_positions=positions,
            query_positions=torch.where(query_valid, query_positions, -1),
            query_valid=None if bool(query_valid.all()) else query_valid,
            past_slots=keys.shape[2] - width, scaling=scaling, needs=self.policies.needs,
            last_rows_window=self.policies.last_rows_window, backend=self.backend,
            # a request never evicted reads its tokens in place, one slot each, none missing: causality is the mask
            causal_only=len(rows.arena) == 1 and int(rows.arena[0]) == 0 and int(rows.first[0]) == 0
            and bool(query_valid.all()),
        )
        result = attend(grouped_query, call)
        if result.stats is not None and self.policies.needs:
            self._observe(cache, rows, result.stats)
        return result.output

    def _observe(self, cache: PagedLayerCache, rows: RowBlocks, stats: AttentionStats) -> None:
        state = self._gather_state(cache, rows)
        self.policies.observe(lambda group: self._state_of(group, state), stats)
        for name, tensor in cache.state.items():
            rows.scatter(tensor, state[name])

    def _attend_in_place(self, cache: PagedLayerCache, rows: RowBlocks, valid: torch.Tensor, query: torch.Tensor,
                         scaling: float) -> torch.Tensor:
        """One query per request (``query`` [R, Hq, D]) by the paged Triton kernels; the score pass runs only
        for policies that read statistics."""
        from ...backend.triton_paged import paged_column_sums, paged_decode

        slots = rows.blocks.shape[1] * rows.block_size
        valid = torch.nn.functional.pad(valid, (0, slots - rows.width))  # a cut last block: its tail holds nothing
        table = rows.blocks.to(query.device)
        out, lse = paged_decode(query, cache.keys, cache.values, table, valid, scaling)
        if self.policies.needs:
            colsum = paged_column_sums(query, cache.keys, table, valid, lse, scaling)[:, :, : rows.width]
            queries = torch.ones(query.shape[0], dtype=torch.long, device=query.device)
            needs, window = self.policies.needs, self.policies.last_rows_window
            last_rows = colsum[:, :, None] if "last_rows" in needs and window > 0 else None
            self._observe(cache, rows, AttentionStats(queries=queries, colsum=colsum, last_rows=last_rows))
        return out[:, None]

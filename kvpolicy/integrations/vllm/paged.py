"""kvpolicy's part of a paged engine's step: the statistics its policies read, and compaction when they evict.

The engine's own attention kernel computes every output. For that, each request's kept tokens stay *compact*:
the slots the kernel reads through a block table, from the first up to a length, all hold tokens (every KV head
the same count, each head its own tokens), so a table and a length (`schedule.RequestSchedule.compact`) are all
the kernel needs. What is left to kvpolicy:

- an eviction ranks the tokens of each (request, KV head) by its policies' scores and moves the kept ones that
  lie past the first ``budget`` slots into the slots freed before them (`PagedPolicies.evict`);
- policies that read attention statistics get them from a score pass over the keys (`PagedPolicies.observe`,
  `score_pass`); policies that read none (``streaming``, ``window``) pay nothing else.

Torch only (no vLLM), so that the tests of the main environment check it against kvpolicy's dense layer. The
engine's cache of one layer is seen as ``keys``/``values`` ``[blocks, kv_heads, block_size, head_dim]`` views of
any strides (vLLM's CPU cache stores each block's keys transposed: `cpu_cache_views`); beside them, per slot and
KV head, the token's position and the policies' state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...cache.policy_group import LayerPolicies, PolicyGroup
from ...policies.base import TokenView
from ...storage.base import top_kept
from . import score_pass
from .compact_rows import CompactRows, slot_rows


def cpu_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) ``[blocks, Hkv, bs, D]`` of vLLM's CPU cache ``[blocks, Hkv, bs, 2D]``: each (block, KV head)
    holds its keys as ``[D, bs]`` (transposed, for its kernel's vector loads), then its values as ``[bs, D]``. The
    integration checks this against vLLM's own write once per process (`backend.check_cpu_layout`)."""
    blocks, heads, block_size, both = kv_cache.shape
    dim = both // 2
    flat = kv_cache.view(blocks, heads, block_size * both)
    keys = flat[..., : block_size * dim].view(blocks, heads, dim, block_size).transpose(-1, -2)
    values = flat[..., block_size * dim :].view(blocks, heads, block_size, dim)
    return keys, values


@dataclass
class PagedLayerCache:
    """One layer's paged storage: the engine's K/V blocks and kvpolicy's per-slot metadata beside them."""

    keys: torch.Tensor  # [blocks, Hkv, bs, D], any strides (a view of the engine's cache)
    values: torch.Tensor  # [blocks, Hkv, bs, D], any strides
    positions: torch.Tensor  # [blocks, Hkv, bs] int32: the token a slot holds (stale past a request's length)
    state: dict[str, torch.Tensor]  # name -> [blocks, Hkv, bs]
    # the decode queries stored until a pass reads them (`deferred`): [entries, Hq, D], grown as requests arrive
    queries: torch.Tensor | None = None
    # with prefix caching: the policies' state of a prompt's first P slots as a full prefill leaves it after P
    # tokens, by the block holding token P - 1 (name -> [P, Hkv]); a request that hits the cache there starts with it
    snapshots: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, policies: LayerPolicies) -> PagedLayerCache:
        blocks, heads, block_size, _ = keys.shape
        shape = (blocks, heads, block_size)
        state = {name: torch.zeros(shape, dtype=dtype, device=keys.device)
                 for name, dtype in policies.token_state().items()}
        return cls(keys, values, torch.full(shape, -1, dtype=torch.int32, device=keys.device), state)

    @property
    def block_size(self) -> int:
        return self.keys.shape[2]

    def metadata_bytes_per_block(self) -> int:
        tensors = [self.positions, *self.state.values()]
        return sum(t[0].numel() * t.element_size() for t in tensors)

    def write(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """New tokens (keys/values ``[N, Hkv, D]``) at ``slots`` [N], the engine's way (an engine calls its own
        write for the K/V and `write_metadata` for the rest)."""
        block, offset = slots // self.block_size, slots % self.block_size
        self.keys[block, :, offset] = keys.to(self.keys.dtype)
        self.values[block, :, offset] = values.to(self.values.dtype)
        self.write_metadata(slots, positions)

    def store_queries(self, query: torch.Tensor, entries: torch.Tensor, capacity: int) -> None:
        """Keep ``query`` [n, Hq, D] at ``entries`` [n] of the stored queries, which hold ``capacity`` entries."""
        if self.queries is None or self.queries.shape[0] < capacity:
            grown = query.new_zeros(capacity, *query.shape[1:])
            if self.queries is not None:
                grown[: self.queries.shape[0]] = self.queries
            self.queries = grown
        self.queries.index_copy_(0, entries, query.to(self.queries.dtype))

    def stored_queries(self) -> torch.Tensor:
        if self.queries is None:
            raise RuntimeError("kvpolicy: a score pass over stored queries, but none were stored in this layer")
        return self.queries

    def save_snapshot(self, block: int, slots: torch.Tensor) -> None:
        """Keep the state of ``slots`` [P] (a prompt's first P, in order) with ``block``, the one holding token P-1."""
        rows = slot_rows(slots, slots, self.positions.shape[1], self.block_size)[0]
        heads = self.positions.shape[1]
        self.snapshots[block] = {name: tensor.view(-1)[rows].view(len(slots), heads)
                                 for name, tensor in self.state.items()}

    def restore_snapshot(self, block: int, slots: torch.Tensor) -> None:
        """The state of a prefix-cache hit's slots [P] from the snapshot its last block carries."""
        if not self.state:  # this layer's heads read no statistics (another rank's may: the hit is cut for them)
            return
        kept = self.snapshots.get(block)
        if kept is None or any(tensor.shape[0] != len(slots) for tensor in kept.values()):
            raise RuntimeError(f"kvpolicy: a request starts at a prefix-cache hit of {len(slots)} tokens, but no "
                               f"state was kept for them with block {block} (please report this)")
        rows = slot_rows(slots, slots, self.positions.shape[1], self.block_size)[0]
        for name, tensor in self.state.items():
            tensor.view(-1).index_copy_(0, rows, kept[name].reshape(-1).to(tensor.dtype))

    def move_snapshots(self, allocated: set[int], copies: list[tuple[int, int]]) -> None:
        """Follow vLLM's blocks: a block handed to a request holds other tokens now; a block copy carries its
        source's snapshot (or its absence) to its destination."""
        for block in allocated:
            self.snapshots.pop(block, None)
        for source, destination in copies:
            kept = self.snapshots.get(source)
            if kept is None:
                self.snapshots.pop(destination, None)
            else:
                self.snapshots[destination] = kept

    def write_metadata(self, slots: torch.Tensor, positions: torch.Tensor,
                       rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The positions of new tokens at ``slots`` [N]; their policy state starts empty. ``rows``: `slot_rows` of
        them, made once for every layer of a step."""
        index, values = rows if rows is not None else slot_rows(slots, positions, self.positions.shape[1],
                                                                self.block_size)
        self.positions.view(-1).index_copy_(0, index, values)
        for tensor in self.state.values():
            tensor.view(-1).index_fill_(0, index, 0)  # a new token starts with no history


def defers_statistics(policies: LayerPolicies) -> bool:
    """Whether a layer's decode queries may be stored and observed together later (`deferred`): every policy that
    reads statistics reads only sums over queries (`Policy.additive`) of `score_pass.ADDITIVE_STATS`."""
    reading = [group.policy for group in policies.groups if group.policy.needs]
    return bool(reading) and all(policy.additive and policy.needs <= score_pass.ADDITIVE_STATS for policy in reading)


class PagedPolicies:
    """One layer's policies over a paged cache: compact at eviction, and observe the statistics they read.

    ``backend="triton"`` (CUDA, or the interpreter in tests): the compaction's K/V moves, and the score pass of a
    batch of decode steps whose policies read only `score_pass.IN_PLACE_STATS`, run in `backend.triton_paged`,
    reading the blocks where they lie.
    """

    def __init__(self, policies: LayerPolicies, backend: str = "torch"):
        self.policies, self.backend = policies, backend
        self.defers = defers_statistics(policies)

    def _state_of(self, group: PolicyGroup, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: state[f"{group.prefix}{name}"] for name in group.policy.state}

    def evict(self, cache: PagedLayerCache, rows: CompactRows, budget: torch.Tensor, seen: torch.Tensor) -> None:
        """Keep each (request, KV head)'s ``budget`` [R] best tokens of ``rows`` in its first ``budget`` slots: kept
        tokens already there stay, the kept ones past them move into the slots of the dropped ones."""
        heads = cache.positions.shape[1]
        valid = rows.valid().expand(-1, heads, -1)
        positions = torch.where(valid, rows.gather(cache.positions).long(), -1)
        state = {name: rows.gather(tensor) for name, tensor in cache.state.items()}
        view = TokenView(positions=positions, valid=valid, seen=seen, budget=budget[:, None].expand(-1, heads))
        scores = self.policies.scores(lambda group: self._state_of(group, state), view)
        kept = torch.minimum(view.budget, valid.sum(dim=2))  # [R, Hkv]: the same for every head of a request
        keep = top_kept(scores, kept)
        front = torch.arange(rows.width, device=keep.device) < kept[..., None]
        row, head, source = (keep & ~front).nonzero(as_tuple=True)
        # every cell keeps exactly `kept` tokens: as many leave its front as arrive, and nonzero lists both in
        # (request, head) order, so the i-th newcomer fills the i-th hole
        target = (front & ~keep).nonzero(as_tuple=True)[2]
        if target.numel() != source.numel():
            raise RuntimeError("kvpolicy: an eviction kept a different number of tokens in the heads of one request")
        src_block, src_offset = rows.slot(row, source)
        dst_block, dst_offset = rows.slot(row, target)
        moved = [cache.positions, *cache.state.values()]
        if self.backend == "triton":  # the K/V in one kernel over the cache as it lies
            from ...backend.triton_paged import move_slots

            move_slots(cache.keys, cache.values, (src_block, src_offset), (dst_block, dst_offset), head)
        else:
            moved += [cache.keys, cache.values]
        for tensor in moved:
            tensor[dst_block, head, dst_offset] = tensor[src_block, head, src_offset]

    def observe(self, cache: PagedLayerCache, rows: CompactRows, query: torch.Tensor, query_index: torch.Tensor,
                query_positions: torch.Tensor, scaling: float) -> None:
        """The policies observe the attention of ``query`` [N, Hq, D] rows ``query_index`` [R, q] (-1: pad; a
        request's tokens right-aligned, its last ones at the end of its slots) at ``query_positions`` [R, q] over
        the requests' slots, the step's new tokens included. A score pass: the keys are read once, and the output
        is the engine's."""
        needs, window = self.policies.needs, self.policies.last_rows_window
        if not needs:
            return
        part = score_pass.rows_at_once(cache.keys, rows, query, query_index, needs, self.backend)
        if len(rows.lengths) > part:  # a batch too large to score at once goes in parts
            for lo in range(0, len(rows.lengths), part):
                hi = lo + part
                self.observe(cache, rows.part(lo, hi), query, query_index[lo:hi], query_positions[lo:hi], scaling)
            return
        stats = score_pass.scores(cache.keys, cache.values, cache.positions, rows, query, query_index,
                                  query_positions, scaling, needs, window, self.backend)
        state = {name: rows.gather(tensor) for name, tensor in cache.state.items()}
        self.policies.observe(lambda group: self._state_of(group, state), stats)
        for name, tensor in cache.state.items():
            rows.scatter(tensor, state[name])

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

import functools
from dataclasses import dataclass, field

import torch

from ...cache.policy_group import LayerPolicies, PolicyGroup
from ...policies.base import TokenView
from ...storage.base import top_kept
from . import score_pass


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


def slot_rows(slots: torch.Tensor, positions: torch.Tensor, heads: int, block_size: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (new token, KV head) as one row of a per-slot tensor ``[blocks * Hkv * bs]`` and the token's position
    there: one index_copy_ per tensor writes them (indexing [block, :, offset] takes torch's slow path; it cost
    ~0.4 ms a layer at 9 requests)."""
    block, offset = slots // block_size, slots % block_size
    head = torch.arange(heads, device=slots.device)
    rows = ((block[:, None] * heads + head) * block_size + offset[:, None]).reshape(-1)  # [N * Hkv]
    return rows, positions.to(torch.int32)[:, None].expand(len(slots), heads).reshape(-1)


@dataclass
class CompactRows:
    """A batch of requests as the engine's kernel reads them: each request's blocks in the order it reads them
    (``blocks`` [R, nblk], padded with block 0, vLLM's null block) and how many slots hold tokens (``lengths``
    [R]). Slot ``i`` of a request is offset ``i % bs`` of its block ``i // bs``.

    The same rows serve every layer of a step: what indexes them (the valid slots, each slot's place in a per-slot
    tensor, each block's row in a layer's keys) is made once, at the first layer that asks."""

    blocks: torch.Tensor  # [R, nblk] int64 physical block ids
    lengths: torch.Tensor  # [R] int64
    block_size: int
    _made: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, rows: list[tuple[list[int], int]], block_size: int, device: torch.device | str = "cpu"
           ) -> CompactRows:
        """From (physical blocks, length) per request."""
        count = max(1, max(len(blocks) for blocks, _ in rows))
        table = torch.zeros(len(rows), count, dtype=torch.long)
        for index, (blocks, _) in enumerate(rows):
            table[index, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        lengths = torch.tensor([length for _, length in rows], dtype=torch.long)
        return cls(table.to(device), lengths.to(device), block_size)

    def _once(self, key: tuple, make) -> torch.Tensor:
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    @functools.cached_property
    def width(self) -> int:
        return int(self.lengths.max())

    def valid(self) -> torch.Tensor:
        """[R, 1, width] bool: the slots that hold tokens (the same for every KV head)."""
        return self._once(("valid",), lambda: (torch.arange(self.width, device=self.lengths.device)
                                               < self.lengths[:, None])[:, None])

    def slot_index(self, heads: int) -> torch.Tensor:
        """[R, Hkv, width] each slot's element in a contiguous per-slot tensor ``[blocks, Hkv, bs]``."""
        def make() -> torch.Tensor:
            slot = torch.arange(self.width, device=self.blocks.device)
            block = self.blocks[:, slot // self.block_size]  # [R, width]
            head = torch.arange(heads, device=self.blocks.device)[:, None]
            return (block[:, None] * heads + head) * self.block_size + slot % self.block_size
        return self._once(("slot_index", heads), make)

    def key_rows(self, heads: int) -> torch.Tensor:
        """[R, Hkv, nblk] each (block, KV head)'s row in a layer's cache seen as ``[blocks * Hkv, ...]``."""
        return self._once(("key_rows", heads), lambda: self.blocks[:, None] * heads
                          + torch.arange(heads, device=self.blocks.device)[:, None])

    def part(self, lo: int, hi: int) -> CompactRows:
        """Rows ``lo`` to ``hi`` alone."""
        lengths = self.lengths[lo:hi]
        count = -(-int(lengths.max()) // self.block_size)
        return CompactRows(self.blocks[lo:hi, :count], lengths, self.block_size)

    def gather_blocks(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` [blocks, ...] at these rows' blocks: [R, nblk, ...] (one copy)."""
        picked = tensor.index_select(0, self.blocks.reshape(-1).to(tensor.device))
        return picked.view(*self.blocks.shape, *tensor.shape[1:])

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` [blocks, Hkv, bs, ...] at these rows' slots: [R, Hkv, width, ...]."""
        if tensor.dim() == 3 and tensor.is_contiguous():  # per-slot metadata: one take
            return tensor.view(-1)[self.slot_index(tensor.shape[1])]
        picked = self.gather_blocks(tensor)  # [R, nblk, Hkv, bs, ...]
        rows, count, heads = picked.shape[:3]
        picked = picked.transpose(1, 2).reshape(rows, heads, count * self.block_size, *tensor.shape[3:])
        return picked[:, :, : self.width]

    def scatter(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` [R, Hkv, width] back into these rows' slots of the contiguous per-slot ``tensor``
        [blocks, Hkv, bs]. The slots past a row's length within ``width`` are written too: they must hold what
        `gather` read from them (a slot no request holds, or one the next token overwrites)."""
        if tensor.dim() != 3 or not tensor.is_contiguous():
            raise ValueError("CompactRows.scatter writes contiguous per-slot tensors [blocks, Hkv, bs]")
        index = self.slot_index(tensor.shape[1])
        tensor.view(-1).index_copy_(0, index.reshape(-1), values.to(tensor.dtype).reshape(-1))

    def slot(self, row: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical (block, offset) of slot ``index`` of ``row`` (equal-shaped index tensors)."""
        return self.blocks[row, index // self.block_size], index % self.block_size


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

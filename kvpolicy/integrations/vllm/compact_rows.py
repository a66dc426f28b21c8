"""How a batch of requests lies in a paged cache: each request's blocks in the order the engine's kernel reads them
and how many slots hold tokens (`CompactRows`), and where new tokens' metadata goes (`slot_rows`).

Shared by the compaction (`paged`), the score pass (`score_pass`) and the step that drives them (`compact_step`),
so that none of them imports another for it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


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

"""Each storage format on its own, against a brute-force reference of what each cell must hold.

A token's key is its position (every dim), its value minus that, its policy state the
position again: after any mix of appends (chunks, decode steps, pads) and evictions, every
valid slot of every cell must hold exactly the tokens the reference kept, with their own K,
V and state, and attention must read the same through the format's view.
"""

from __future__ import annotations

import pytest
import torch

from kvpolicy.storage.base import headroom, top_kept
from kvpolicy.storage.dense import DenseStore
from kvpolicy.storage.ragged import RaggedStore, ragged_pays

B, H, D = 2, 3, 4


class FixedSizing:
    """The `Sizing` a store asks for, from fixed per-cell limits (``None``: unlimited cells)."""

    def __init__(self, limits: torch.Tensor, slack: int = 0, unlimited: torch.Tensor | None = None):
        self.limits, self.slack = limits, slack
        self.unlimited = unlimited if unlimited is not None else torch.zeros_like(limits, dtype=torch.bool)
        self.uniform_limit = int(limits.max()) if int(limits.min()) == int(limits.max()) and not self.unlimited.any() else None
        self.budgets_grow = False

    def segment_sizes(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.where(self.unlimited, tokens + headroom(tokens), torch.maximum(self.limits, tokens) + self.slack + 1)

    def grown_segments(self, needed: torch.Tensor) -> torch.Tensor:
        return torch.where(self.unlimited, needed + headroom(needed), needed)


class Reference:
    """Per cell, the positions it keeps: the ``keep`` highest scores, brute force."""

    def __init__(self, seed: int):
        self.cells = {(b, h): set() for b in range(B) for h in range(H)}
        self.seen = [0] * B
        self.score_of = torch.rand(B, H, 10_000, generator=torch.Generator().manual_seed(seed))

    def append(self, count: int, pads: list[int]) -> torch.Tensor:
        """Positions [B, count] of the new tokens (-1 for the ``pads[b]`` leading pads of row b)."""
        out = torch.full((B, count), -1, dtype=torch.long)
        for b in range(B):
            real = count - pads[b]
            out[b, pads[b] :] = torch.arange(self.seen[b], self.seen[b] + real)
            for h in range(H):
                self.cells[(b, h)].update(range(self.seen[b], self.seen[b] + real))
            self.seen[b] += real
        return out

    def evict(self, limits: torch.Tensor) -> None:
        for (b, h), kept in self.cells.items():
            ranked = sorted(kept, key=lambda p: float(self.score_of[b, h, p]), reverse=True)
            self.cells[(b, h)] = set(ranked[: int(limits[b, h])])


def step(store, ref: Reference, count: int, limits: torch.Tensor, pads=(0, 0), slack: int = 0):
    positions = ref.append(count, list(pads))
    k = positions[:, None, :, None].expand(B, H, count, D).float()
    start = store.append(k, -k)
    store.slots.positions[:, :, start : start + count] = positions[:, None, :]
    store.slots.token_state["x"][:, :, start : start + count] = positions[:, None, :].float()
    if any(pads):
        store.slots.valid[:, :, start : start + count] &= (positions >= 0)[:, None, :]
        store.mark_pads()
    keys, values = store.attention_kv()
    used = keys.shape[2]
    valid, at = store.slots.valid[:, :, :used], store.slots.positions[:, :, :used]
    assert torch.equal(keys[..., 0][valid], at[valid].float()) and torch.equal(values[..., 0][valid], -at[valid].float())
    store.end_pass()
    count_now = valid.sum(dim=2)
    keep = torch.minimum(limits, count_now)
    if not any(pads) and int((count_now - keep).max()) <= slack:
        store.evict(None, count_now, count_now)
        return count_now
    safe = at.clamp(min=0)
    scores = ref.score_of.gather(2, safe).masked_fill(~valid, -torch.inf)
    store.evict(scores, keep, count_now)
    ref.evict(limits)
    return keep


def check(store, ref: Reference) -> None:
    used = store.used
    valid, positions = store.slots.valid[:, :, :used], store.slots.positions[:, :, :used]
    for (b, h), kept in ref.cells.items():
        assert sorted(positions[b, h][valid[b, h]].tolist()) == sorted(kept), (b, h)
    assert torch.equal(store.slots.token_state["x"][:, :, :used][valid], positions[valid].float())
    assert bool((positions[~valid] == -1).all())
    if isinstance(store, DenseStore):
        keys = store.keys[:, :, :used, 0]
    else:  # between passes each cell's tokens sit at the start of its segment, slot for slot
        assert torch.equal(valid.sum(dim=2), store.cell_tokens)
        assert bool((valid == (torch.arange(used) < store.cell_tokens[..., None])).all())
        rows = store.offset[..., None] + torch.arange(used)
        keys = store.keys[:, 0][rows.clamp(max=store.keys.shape[0] - 1)]
    assert torch.equal(keys[valid], positions[valid].float())


def new_dense(sizing) -> DenseStore:
    like = torch.zeros(B, H, 1, D)
    return DenseStore(like, like, {"x": torch.float32}, sizing)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_store_keeps_what_the_reference_keeps(seed):
    limits = torch.full((B, H), 6)
    store, ref = new_dense(FixedSizing(limits)), Reference(seed)
    step(store, ref, 9, limits, pads=(0, 3))  # a padded prompt over budget
    check(store, ref)
    for _ in range(12):  # decode steps: one token out per cell (the packed drop-one path)
        step(store, ref, 1, limits)
        check(store, ref)
    assert store.packed_tokens == 6 and store.capacity <= 6 + 2 + headroom(8)
    step(store, ref, 5, limits)  # a chunk
    check(store, ref)


@pytest.mark.parametrize("seed", [0, 1])
def test_dense_store_with_slack_and_unequal_limits(seed):
    limits = torch.tensor([[3, 7, 5], [6, 2, 4]])
    store, ref = new_dense(FixedSizing(limits, slack=2)), Reference(seed)
    for count in (11, 1, 1, 4, 1, 1, 1, 3, 1):
        step(store, ref, count, limits, slack=2)
        # cells may run up to `slack` over their limits before a compaction
        assert bool((store.slots.valid.sum(dim=2) <= limits + 2).all())
    ref.evict(limits + 2)  # the reference evicted at each compaction; within slack it kept everything
    check(store, ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ragged_store_keeps_what_the_reference_keeps(seed):
    limits = torch.tensor([[9, 2, 5], [4, 7, 1]])
    sizing = FixedSizing(limits)
    dense, ref = new_dense(sizing), Reference(seed)
    keep = step(dense, ref, 12, limits, pads=(2, 0))
    assert ragged_pays(sizing.segment_sizes(keep))
    store = RaggedStore.from_dense(dense, keep)
    check(store, ref)
    assert torch.equal(store.cap, limits + 1) and store.keys.shape[0] == int((limits + 1).sum())
    for count in (1, 1, 3, 1, 1, 6, 1):  # decode steps move one row per cell; chunks compact
        step(store, ref, count, limits)
        check(store, ref)
    assert store.kv_bytes() == int(store.cap.sum()) * 2 * D * 4


def test_ragged_store_grows_unlimited_cells_and_shrinks_back():
    limits = torch.tensor([[4, 10_000, 4], [2, 3, 4]])
    unlimited = torch.zeros(B, H, dtype=torch.bool)
    unlimited[0, 1] = True
    sizing = FixedSizing(limits, unlimited=unlimited)
    dense, ref = new_dense(sizing), Reference(3)
    keep = step(dense, ref, 8, limits)
    store = RaggedStore.from_dense(dense, keep)
    for count in [1] * 30 + [20]:  # the unlimited cell outgrows its segment: re-layouts with headroom
        step(store, ref, count, limits)
        check(store, ref)
    assert int(store.cap[0, 1]) >= ref.seen[0] and int(store.cap[0, 0]) == 5
    assert store.keys.shape[0] <= (1 + 1 / 16) * int(sizing.segment_sizes(store.cell_tokens).sum()) + 1


def test_top_kept_and_headroom():
    scores = torch.tensor([[[0.1, 0.9, 0.5, -torch.inf]]])
    assert top_kept(scores, torch.tensor([[2]])).tolist() == [[[False, True, True, False]]]
    assert headroom(100) == 16 and headroom(1600) == 100 and headroom(64, budgets_grow=True) == 3
    assert torch.equal(headroom(torch.tensor([10, 1600])), torch.tensor([16, 100]))
    assert not ragged_pays(torch.tensor([[10, 10]])) and ragged_pays(torch.tensor([[10, 2]]))

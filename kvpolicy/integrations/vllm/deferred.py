"""Decode steps' attention statistics, batched until a policy reads them.

A policy whose statistics add up over queries (`Policy.additive`: H2O's accumulated attention, RoCo's sums) reads
its state only when its request evicts. Its layers then need no score pass per decode step: each step stores the
step's query (one copy per layer), and one pass runs over a request's stored queries right before its next
eviction, or once `WINDOW` of them are stored. That pass reads the keys once for all of them, where a pass per
step read them every step. Between evictions a request's compact layout only grows at its end (only an eviction
moves tokens), so each stored query sees exactly the keys it saw at its step: the pass is causal over the request's
last slots, as a prompt chunk's is.

This module is the builder's bookkeeping (no vLLM): which row of each layer's query buffer a request
uses, and when its stored queries must be read. A layer's buffer is ``[rows * WINDOW, Hq, D]``; a request's
``k``-th stored query of a rule is at ``row * WINDOW + k``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compact_rows import CompactRows

#: decode queries stored per request before a pass reads them (a block's worth at SmolLM2's block size: a request
#: evicting once a block flushes once per eviction)
WINDOW = 32


@dataclass
class Flush:
    """A score pass over one request's stored queries of one rule: buffer entries ``entries`` (in step order), the
    queries of the tokens at positions ``[end - len(entries), end)``."""

    key: str
    entries: list[int]
    end: int


@dataclass
class StoredPlan:
    before: list[tuple[int, Flush]]  # read before the step's eviction, over the layout as it was
    stores: list[tuple[int, int]]  # (request, buffer entry) of each one-token step
    after: list[tuple[int, Flush]]  # read after the step, over the layout with its token in


class QueryWindows:
    """Each request's stored decode queries, per budget rule (a rule's layers evict at their own steps)."""

    def __init__(self, rules: int, window: int = WINDOW):
        self.rules, self.window = rules, window
        self.rows: dict[str, int] = {}  # request id -> buffer row
        self.counts: dict[str, list[int]] = {}  # and the queries stored per rule
        self.free: list[int] = []
        self.capacity = 0  # rows handed out so far: each layer's buffer holds this many

    def forget(self, key: str) -> None:
        """The request ``key`` ended or starts over (a recomputation after a preemption)."""
        row = self.rows.pop(key, None)
        if row is not None:
            self.counts.pop(key)
            self.free.append(row)

    def pending(self, key: str, rule: int) -> int:
        counts = self.counts.get(key)
        return counts[rule] if counts is not None else 0

    def take(self, key: str, rule: int, end: int) -> Flush | None:
        """The request's stored queries of ``rule`` (its tokens through position ``end``), now read: None if none."""
        count = self.pending(key, rule)
        if count == 0:
            return None
        self.counts[key][rule] = 0
        base = self.rows[key] * self.window
        return Flush(key, list(range(base, base + count)), end)

    def plan(self, rule: int, steps: list[tuple[str, int, int, bool]]) -> StoredPlan:
        """One step of a rule's layers, for its requests ``steps`` (key, start, end, evicts now): which requests'
        stored queries a pass reads before the step's eviction (a request about to evict, or to run a longer chunk,
        whose layout must not move under them), where each one-token step's query goes, and which windows that
        fills. Each list holds (index in ``steps``, ...)."""
        plan = StoredPlan([], [], [])
        for index, (key, start, end, evicts) in enumerate(steps):
            one = end - start == 1
            if evicts or not one:
                flush = self.take(key, rule, start)
                if flush is not None:
                    plan.before.append((index, flush))
            if one:
                entry, full = self.store(key, rule, end)
                plan.stores.append((index, entry))
                if full is not None:
                    plan.after.append((index, full))
        return plan

    def store(self, key: str, rule: int, end: int) -> tuple[int, Flush | None]:
        """Where the query of the request's token at position ``end - 1`` goes for ``rule``, and the pass that
        reads the window if that fills it."""
        if key not in self.rows:
            if self.free:
                self.rows[key] = self.free.pop()
            else:
                self.rows[key] = self.capacity
                self.capacity += 1
            self.counts[key] = [0] * self.rules
        entry = self.rows[key] * self.window + self.counts[key][rule]
        self.counts[key][rule] += 1
        full = self.take(key, rule, end) if self.counts[key][rule] == self.window else None
        return entry, full


def stored_observation(flushes: list[tuple[tuple[list[int], int], Flush]], block_size: int, device: torch.device
                        ) -> tuple[CompactRows, torch.Tensor, torch.Tensor] | None:
    """A score pass over stored queries: the requests' layouts, and their stored queries right-aligned (-1: pad)."""
    if not flushes:
        return None
    width = max(len(flush.entries) for _, flush in flushes)
    index = torch.full((len(flushes), width), -1, dtype=torch.long)
    positions = torch.full((len(flushes), width), -1, dtype=torch.long)
    for i, (_, flush) in enumerate(flushes):
        count = len(flush.entries)
        index[i, width - count:] = torch.tensor(flush.entries)
        positions[i, width - count:] = torch.arange(flush.end - count, flush.end)
    rows = CompactRows.of([layout for layout, _ in flushes], block_size, device)
    return rows, index.to(device), positions.to(device)

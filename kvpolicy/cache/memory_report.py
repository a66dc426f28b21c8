"""The KV memory report: live vs allocated bytes per layer, as the cache's own tensors hold them.

``live`` counts the tokens kept; ``allocated`` is the K/V storage really held (dense layers:
every (row, KV head) sized like the largest, plus the slots kept free for the next token;
ragged layers: each cell's own segment). ``policy state`` is the per-slot metadata
(positions, validity, the policies' per-token state, ragged segment tables). Tiered layers
(precision tiers) also give their K/V bytes per tier (``tier_bytes``: codes, scales, ranges),
and count each kept token at its tier's cost in ``live``. Attention on a
ragged layer reads a transient dense copy of that one layer: ``workspace`` is the largest
such copy, memory in use only during that layer's attention call, not cache.

Each layer also breaks its cells down by label (``by_label``): the policy's own label for
each (row, KV head) where it gives one (FastGen: the head's pattern), else the policy's
name. When some layer holds more than one label, the table gains a column per layer and a
summary per label: heads, tokens, live and allocated bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypedDict

import torch

from ..storage.base import KVStore


class LayerMemory(TypedDict):
    """One layer's figures (`layer_memory`): K/V bytes live and allocated, metadata, tokens per cell, per label."""

    live_kv_bytes: int
    tier_bytes: dict[str, int]  # per precision tier (tiered layers; empty otherwise)
    allocated_kv_bytes: int
    metadata_bytes: int
    tokens_min: int
    tokens_max: int
    ragged: int
    workspace_kv_bytes: int
    by_label: dict[str, dict[str, int]]


class MeasuredLayer(Protocol):
    """What the report reads of a cache layer (`kvpolicy.cache.layer.PolicyLayer`)."""

    store: KVStore | None
    cell_state: dict[str, torch.Tensor]

    @property
    def ragged(self) -> bool: ...

    def cell_labels(self) -> list[list[str]]: ...


@dataclass
class MemoryReport:
    layers: list[LayerMemory]

    @property
    def live_kv_bytes(self) -> int:
        return sum(layer["live_kv_bytes"] for layer in self.layers)

    @property
    def allocated_kv_bytes(self) -> int:
        return sum(layer["allocated_kv_bytes"] for layer in self.layers)

    @property
    def metadata_bytes(self) -> int:
        return sum(layer["metadata_bytes"] for layer in self.layers)

    def tier_bytes(self) -> dict[str, int]:
        """K/V bytes (codes, scales, ranges) per precision tier, over every tiered layer."""
        out: dict[str, int] = {}
        for layer in self.layers:
            for name, size in layer.get("tier_bytes", {}).items():
                out[name] = out.get(name, 0) + size
        return out

    @property
    def workspace_kv_bytes(self) -> int:
        """The largest transient dense copy of a ragged layer (one layer at a time, so the max, not the sum)."""
        return max((layer.get("workspace_kv_bytes", 0) for layer in self.layers), default=0)

    def by_label(self) -> dict[str, dict[str, int]]:
        """Cells (heads x rows), tokens, live and allocated K/V bytes per cell label, over every layer."""
        out: dict[str, dict[str, int]] = {}
        for layer in self.layers:
            for label, numbers in layer.get("by_label", {}).items():
                entry = out.setdefault(label, dict.fromkeys(numbers, 0))
                for key, value in numbers.items():
                    entry[key] += value
        return out

    def __str__(self) -> str:
        labelled = any(len(layer.get("by_label", {})) > 1 for layer in self.layers)
        lines = [f"{'layer':>5} {'tokens/head':>13} {'live KV':>10} {'allocated KV':>13} {'policy state':>13} {'layout':>7}"
                 + ("  heads by label (live / allocated)" if labelled else "")]
        for index, layer in enumerate(self.layers):
            span = f"{layer['tokens_min']}" if layer["tokens_min"] == layer["tokens_max"] else f"{layer['tokens_min']}-{layer['tokens_max']}"
            layout = "tiered" if layer.get("tier_bytes") else "ragged" if layer.get("ragged") else "dense"
            labels = "  " + ", ".join(
                f"{label} x{n['cells']} ({human_bytes(n['live_kv_bytes'])} / {human_bytes(n['allocated_kv_bytes'])})"
                for label, n in sorted(layer.get("by_label", {}).items())
            ) if labelled else ""
            lines.append(
                f"{index:>5} {span:>13} {human_bytes(layer['live_kv_bytes']):>10} "
                f"{human_bytes(layer['allocated_kv_bytes']):>13} {human_bytes(layer['metadata_bytes']):>13} {layout:>7}{labels}"
            )
        lines.append(
            f"{'total':>5} {'':>13} {human_bytes(self.live_kv_bytes):>10} {human_bytes(self.allocated_kv_bytes):>13} "
            f"{human_bytes(self.metadata_bytes):>13}"
        )
        if labelled:
            for label, n in sorted(self.by_label().items()):
                lines.append(
                    f"  {label}: {n['cells']} heads, {n['tokens']} tokens, {human_bytes(n['live_kv_bytes'])} live, "
                    f"{human_bytes(n['allocated_kv_bytes'])} allocated"
                )
        tiers = self.tier_bytes()
        if tiers:
            lines.append("precision tiers (allocated K/V): " + ", ".join(f"{name} {human_bytes(size)}"
                                                                      for name, size in tiers.items())
                         + "; attention reads a transient copy of one layer at the compute dtype (workspace, not "
                         f"cache): at most {human_bytes(self.workspace_kv_bytes)}")
        if any(layer.get("ragged") for layer in self.layers):
            lines.append(
                f"ragged layers hold each (row, KV head)'s tokens in a segment of its own size; attention reads "
                f"a transient dense copy of one layer at a time (workspace, not cache): at most "
                f"{human_bytes(self.workspace_kv_bytes)}"
            )
        return "\n".join(lines)


def human_bytes(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)


def layer_memory(layer: MeasuredLayer) -> LayerMemory:
    """One cache layer's figures: the bytes its tensors really hold, and per cell label."""
    store = layer.store
    if store is None:
        return {"live_kv_bytes": 0, "tier_bytes": {}, "allocated_kv_bytes": 0, "metadata_bytes": 0, "tokens_min": 0,
                "tokens_max": 0, "ragged": 0, "workspace_kv_bytes": 0, "by_label": {}}
    tokens = store.slots.valid.sum(dim=2)
    per_token = store.bytes_per_token()
    metadata = [*store.slots.tensors(), *layer.cell_state.values(), *store.bookkeeping()]
    allocated = store.kv_bytes()
    return {
        "live_kv_bytes": store.live_kv_bytes(),
        "tier_bytes": store.tier_bytes(),
        "allocated_kv_bytes": allocated,
        "metadata_bytes": sum(t.untyped_storage().nbytes() for t in metadata),
        "tokens_min": int(tokens.min()),
        "tokens_max": int(tokens.max()),
        "ragged": int(layer.ragged),
        "workspace_kv_bytes": store.workspace_bytes,
        "by_label": _by_label(layer.cell_labels(), tokens, store.cell_rows(), per_token, allocated),
    }


def _by_label(labels: list[list[str]], tokens: torch.Tensor, rows: torch.Tensor | None, per_token: int,
              allocated: int) -> dict[str, dict[str, int]]:
    """Cells, tokens, live and allocated K/V bytes per cell label (report time only: Python loops are fine)."""
    cells = tokens.numel()
    rows = rows.tolist() if rows is not None else None
    counts = tokens.tolist()  # one device sync, not one per cell
    out: dict[str, dict[str, int]] = {}
    for b, row in enumerate(labels):
        for h, label in enumerate(row):
            entry = out.setdefault(label, {"cells": 0, "tokens": 0, "live_kv_bytes": 0, "allocated_kv_bytes": 0})
            entry["cells"] += 1
            entry["tokens"] += counts[b][h]
            entry["live_kv_bytes"] += counts[b][h] * per_token
            # equal-width storage gives every cell the same share; ragged storage each cell its own segment
            entry["allocated_kv_bytes"] += rows[b][h] * per_token if rows is not None else allocated // cells
    return out

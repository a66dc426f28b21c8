"""The KV memory report: live vs allocated bytes per layer, as the cache's own tensors hold them.

``live`` counts the tokens kept; ``allocated`` is the K/V storage really held (dense layers:
every (row, KV head) sized like the largest, plus the slots kept free for the next token;
ragged layers: each cell's own segment). ``policy state`` is the per-slot metadata
(positions, validity, the policies' per-token state, ragged segment tables). Attention on a
ragged layer reads a transient dense copy of that one layer: ``workspace`` is the largest
such copy, memory in use only during that layer's attention call, not cache.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryReport:
    layers: list[dict[str, int]]

    @property
    def live_kv_bytes(self) -> int:
        return sum(layer["live_kv_bytes"] for layer in self.layers)

    @property
    def allocated_kv_bytes(self) -> int:
        return sum(layer["allocated_kv_bytes"] for layer in self.layers)

    @property
    def metadata_bytes(self) -> int:
        return sum(layer["metadata_bytes"] for layer in self.layers)

    @property
    def workspace_kv_bytes(self) -> int:
        """The largest transient dense copy of a ragged layer (one layer at a time, so the max, not the sum)."""
        return max((layer.get("workspace_kv_bytes", 0) for layer in self.layers), default=0)

    def __str__(self) -> str:
        lines = [f"{'layer':>5} {'tokens/head':>13} {'live KV':>10} {'allocated KV':>13} {'policy state':>13} {'layout':>7}"]
        for index, layer in enumerate(self.layers):
            span = f"{layer['tokens_min']}" if layer["tokens_min"] == layer["tokens_max"] else f"{layer['tokens_min']}-{layer['tokens_max']}"
            layout = "ragged" if layer.get("ragged") else "dense"
            lines.append(
                f"{index:>5} {span:>13} {_human(layer['live_kv_bytes']):>10} "
                f"{_human(layer['allocated_kv_bytes']):>13} {_human(layer['metadata_bytes']):>13} {layout:>7}"
            )
        lines.append(
            f"{'total':>5} {'':>13} {_human(self.live_kv_bytes):>10} {_human(self.allocated_kv_bytes):>13} "
            f"{_human(self.metadata_bytes):>13}"
        )
        if any(layer.get("ragged") for layer in self.layers):
            lines.append(
                f"ragged layers hold each (row, KV head)'s tokens in a segment of its own size; attention reads "
                f"a transient dense copy of one layer at a time (workspace, not cache): at most "
                f"{_human(self.workspace_kv_bytes)}"
            )
        return "\n".join(lines)


def _human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)

"""The KV memory report: live vs allocated bytes per layer, as the cache's own tensors hold them."""

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

    def __str__(self) -> str:
        lines = [f"{'layer':>5} {'tokens/head':>13} {'live KV':>10} {'allocated KV':>13} {'policy state':>13}"]
        for index, layer in enumerate(self.layers):
            span = f"{layer['tokens_min']}" if layer["tokens_min"] == layer["tokens_max"] else f"{layer['tokens_min']}-{layer['tokens_max']}"
            lines.append(
                f"{index:>5} {span:>13} {_human(layer['live_kv_bytes']):>10} "
                f"{_human(layer['allocated_kv_bytes']):>13} {_human(layer['metadata_bytes']):>13}"
            )
        lines.append(
            f"{'total':>5} {'':>13} {_human(self.live_kv_bytes):>10} {_human(self.allocated_kv_bytes):>13} "
            f"{_human(self.metadata_bytes):>13}"
        )
        return "\n".join(lines)


def _human(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)

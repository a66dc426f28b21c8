"""What `kvpolicy bench` measures memory with: a cache's bytes, their peak while it runs, the process's RSS."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def _layer_bytes(layer: Any) -> int:
    """K/V storage plus metadata of one cache layer: a kvpolicy layer's own count, else a plain layer's K/V."""
    if hasattr(layer, "nbytes"):
        return layer.nbytes()
    tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
    return sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor))


class PeakMeter:
    """The peak of a cache's bytes, sampled after every layer's update.

    Layers run one after another, and each evicts right after its attention: so when
    layer i updates, layer i-1 has already shrunk. The sum of the latest per-layer figures
    is then exact at every update, including the moment one layer holds the whole prompt.
    A kvpolicy cache reports its updates (`PolicyCache.update_watchers`); a plain cache never
    shrinks, so its peak is its size at the end.
    """

    def __init__(self, cache: Any):
        self.cache = cache
        self.sizes = [0] * len(cache.layers)
        self.peak = 0
        self._watchers = getattr(cache, "update_watchers", None)
        if self._watchers is not None:
            self._watchers.append(self._updated)

    def _updated(self, index: int) -> None:
        if index:
            self._refresh(index - 1)
        self._refresh(index)

    def _refresh(self, index: int) -> None:
        self.sizes[index] = _layer_bytes(self.cache.layers[index])
        self.peak = max(self.peak, sum(self.sizes))

    def stop(self) -> int:
        """Take the last layer's state, stop watching and return the peak."""
        watched = self._watchers is not None
        for index in range(len(self.sizes) - 1 if watched else 0, len(self.sizes)):
            self._refresh(index)
        if self._watchers is not None and self._updated in self._watchers:
            self._watchers.remove(self._updated)
        return self.peak


def cache_bytes(cache: Any) -> int:
    return sum(_layer_bytes(layer) for layer in cache.layers)


def resident_bytes() -> int | None:
    """The process's resident set size now (Linux /proc), or None where unavailable."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


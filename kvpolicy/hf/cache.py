"""`PolicyCache`: a transformers `Cache` whose layers are `PolicyLayer`s (`kvpolicy/cache/layer.py`).

Transformers hands each layer's new K/V to ``cache.update`` and then calls the attention
function, which gets no handle to the cache: each layer's `update` announces itself here,
right before the model calls attention for that same layer (`active_layer`).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache.layer import PolicyLayer, TokenFeed
from ..cache.memory_report import MemoryReport
from ..errors import KVPolicyError
from .probe import Probe

_active = threading.local()


def active_layer(layer_idx: int) -> CacheLayer | None:
    """The layer whose `update` ran last on this thread, if it is ``layer_idx`` and waits for its attention call."""
    layer = getattr(_active, "layer", None)
    if layer is not None and layer.layer_idx == layer_idx and layer.pending is not None:
        return layer
    return None


def cache_keyword(model: torch.nn.Module) -> str:
    """``cache`` where the installed transformers names it so (5.24+), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class CacheLayer(PolicyLayer, CacheLayerMixin):
    """A `PolicyLayer` speaking transformers' cache-layer protocol."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False
    update_watchers: list[Callable[[int], None]] = []

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._initialize(key_states, value_states)

    #: the model's attention implementation now (set by `PolicyCache`), or None where unknown
    attention: Callable[[], str | None] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.static_step.active:  # a compiled decode step (`static_step`): checked by the engine before the step
            keys_values = self.static_step.append(key_states, value_states)
            _active.layer = self
            return keys_values
        current = self.attention() if self.attention is not None else None
        if current is not None and current != "kvpolicy":
            raise KVPolicyError(
                f"a kvpolicy cache was given to a model that runs {current!r} attention, not kvpolicy's, so it would "
                "evict nothing: the session was detached (or the attention switched); attach the recipe again and use "
                "that session's new_cache()"
            )
        if self.pending is not None:  # the previous pass never reached kvpolicy's attention for this layer
            raise KVPolicyError(
                f"layer {self.layer_idx} of this kvpolicy cache got new tokens before its previous ones were attended "
                "(a forward pass that failed midway, or attention other than kvpolicy's): make a fresh cache with "
                "session.new_cache()"
            )
        keys_values = self.append(key_states, value_states)
        _active.layer = self
        for watcher in self.update_watchers:
            watcher(self.layer_idx)
        return keys_values

    def end_call(self, stats) -> None:
        _active.layer = None
        super().end_call(stats)

    def abandon_call(self) -> None:
        """The attention call failed: stop announcing this layer (its cache refuses more tokens, see `update`)."""
        _active.layer = None

    def get_seq_length(self) -> int:  # (a compiled step passes positions and mask, so never asks)
        return self.slots_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.used + query_length, self.slots_seen - self.used

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KVPolicyError("beam search is not supported with a kvpolicy cache; use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise KVPolicyError("num_return_sequences/beam expansion is not supported with a kvpolicy cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise KVPolicyError("beam search is not supported with a kvpolicy cache")

    def crop(self, max_length: int) -> None:
        raise KVPolicyError("cropping (assisted decoding) is not supported with a kvpolicy cache")


class PolicyCache(Cache):
    """A KV cache that evicts per (batch row, KV head) as its recipe's policies decide."""

    def __init__(self, layers: list[CacheLayer], attention: Callable[[], str | None] | None = None):
        """``attention``: tells the model's attention implementation now, checked at every update."""
        super().__init__(layers=layers)
        # only when a policy reads token ids: the session's forward pre-hook fills it (session.py)
        self.token_feed = TokenFeed() if any(layer.token_id_policies for layer in layers) else None
        #: called with a layer's index right after it stored a pass's K/V (e.g. `kvpolicy bench`'s peak meter)
        self.update_watchers: list[Callable[[int], None]] = []
        for layer in layers:
            layer.token_feed = self.token_feed
            layer.update_watchers = self.update_watchers
            layer.attention = attention
        #: the probe a policy scores the prompt by (`kvpolicy.hf.probe`), run by the session's forward hooks
        self.probe = Probe() if any(layer.probing for layer in layers) else None
        if self.probe is not None:
            tiered = [layer.layer_idx for layer in layers if layer.budgets.tiers]
            if tiered:
                raise KVPolicyError(
                    f"policy {self.probe_policy_names()} scores the prompt by a probe, which precision tiers do not "
                    f"support yet (layer {tiered[0]} has tiers): drop the budget's tiers/memory, or run the tiered "
                    "recipe in a batch of its own")
            for layer in layers:
                layer.probed_cache = layer.awaits_probe = True

    def stop_evicting(self) -> None:
        """Keep every token from now on, whatever the budget: a context compressed once, then questions and answers
        kept whole on top of it (kvpress's protocol, `kvpolicy compare --question after`)."""
        for layer in self.layers:
            layer.evicting = False

    def probe_policy_names(self) -> str:
        """The probing policies' names, for messages."""
        return ", ".join(sorted({g.policy.name for layer in self.layers for g in layer.probing})) or "(none)"

    def memory_report(self) -> MemoryReport:
        return MemoryReport([layer.memory() for layer in self.layers])

    def kept_positions(self, layer_idx: int) -> list[list[list[int]]]:
        return self.layers[layer_idx].kept_positions()


__all__ = ["CacheLayer", "MemoryReport", "PolicyCache", "TokenFeed", "active_layer"]

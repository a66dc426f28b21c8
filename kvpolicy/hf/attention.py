"""The attention function kvpolicy registers with transformers, one for every model.

`register` adds ``"kvpolicy"`` to transformers' `AttentionInterface` (and a mask function to
`AttentionMaskInterface`); `session.attach` switches a model to it. No model forward is
copied: any model whose attention goes through transformers' attention interface works.
The function finds the layer being computed (`cache.active_layer`), asks it for an
`AttentionCall`, runs the backend and hands the statistics back.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..backend import torch_ref
from ..backend.dispatch import attend
from ..errors import KVPolicyError
from .cache import active_layer

ATTENTION_NAME = "kvpolicy"
_registered = False
_warned_no_cache = False
_quiet = 0


def _padding_mask(batch_size: int, q_length: int, attention_mask: torch.Tensor | None = None, **kwargs) -> Any:
    """Mask function for ``"kvpolicy"``: pass the 2D padding mask through (None when nothing is padded).

    Validity of cached columns comes from the cache; the 2D mask only tells which new
    tokens are pads (its last ``q_length`` columns).
    """
    if attention_mask is None or attention_mask.ndim != 2:
        return attention_mask
    attention_mask = attention_mask.bool()
    return None if bool(attention_mask.all()) else attention_mask


def kvpolicy_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for one layer: output [B, q, Hq, D]; statistics go to the cache's policies."""
    if softcap is not None:
        raise KVPolicyError("attention logit soft-capping (softcap) is not supported by kvpolicy's attention yet")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = active_layer(getattr(module, "layer_idx", -1))
    if layer is not None and layer.static_step.active:  # a compiled decode step: no mask, no pads, nothing read back
        result = torch_ref.attend(query, layer.static_step.call(scaling))
        layer.static_step.end_call(result.stats)
        layer.abandon_call()  # the call is done: stop announcing the layer
        return result.output, None
    if layer is None:
        return _attention_without_policy_cache(query, key, value, attention_mask, scaling, sliding_window), None
    queries = query.shape[2]
    query_valid = attention_mask[:, -queries:] if isinstance(attention_mask, torch.Tensor) else None
    if query_valid is not None and bool(query_valid.all()):
        query_valid = None
    try:
        result = attend(query, layer.begin_call(query_valid, scaling, sliding_window))
    except BaseException:
        layer.abandon_call()  # a later call, of any model on this thread, must not find this layer waiting
        raise
    layer.end_call(result.stats)
    return result.output, None


@contextlib.contextmanager
def no_cache_warning_off() -> Iterator[None]:
    """Within it, running without a kvpolicy cache is intended (the caller has warned in its own words)."""
    global _quiet
    _quiet += 1
    try:
        yield
    finally:
        _quiet -= 1


def _attention_without_policy_cache(query, key, value, attention_mask, scaling, sliding_window):
    """The model ran without a PolicyCache (plain DynamicCache, or no cache): plain causal attention, [B, q, Hq, D].

    What transformers' SDPA attention gives: causal, the 2D padding mask over every key (the
    mask function passes it through), the sliding window; pad queries see every key so that
    softmax stays finite (their outputs are never used).
    """
    global _warned_no_cache
    if not _warned_no_cache and not _quiet:
        warnings.warn(
            "kvpolicy attention ran without a kvpolicy cache, so nothing is evicted (plain attention over every token); "
            "pass cache=session.new_cache() to generate (past_key_values= in older transformers), or use session.generate",
            stacklevel=3,
        )
        _warned_no_cache = True
    queries, keys = query.shape[2], key.shape[2]
    key_pos = torch.arange(keys, device=query.device)
    query_pos = torch.arange(keys - queries, keys, device=query.device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if sliding_window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
    mask = mask[None, None]
    if isinstance(attention_mask, torch.Tensor):
        mask = mask & attention_mask[:, None, None, -keys:]
    return torch_ref.attend_sdpa(query, key, value, mask, scaling)


def register() -> None:
    """Register kvpolicy's attention and mask functions with transformers (idempotent)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, kvpolicy_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, _padding_mask)
        _registered = True

"""The `query_moments` statistic: the first and second moments of a call's queries, their rotation taken off.

Expected attention models the queries to come as a Gaussian of the queries seen so far. Queries reach the
attention function after RoPE at their own positions; rotating each back by its position (`rotary.rotate`
by minus it) leaves what the query projection produced, so queries of different positions compare. The sums
depend only on the queries, not on the keys, so one function serves every backend.
"""

from __future__ import annotations

import torch

from ..policies.base import AttentionStats
from .call import AttentionCall
from .rotary import rotate


def query_moments(query: torch.Tensor, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count [B], sum [B, Hkv, G, D], sum of outer products [B, Hkv, G, D, D]) of the real queries of ``query``
    [B, Hq, q, D] at positions >= ``call.moments_skip``, each times ``call.scaling`` and rotated back to position 0."""
    if call.inv_freq is None:
        raise ValueError("query_moments needs the model's RoPE inverse frequencies (AttentionCall.inv_freq)")
    batch, q_heads, _, dim = query.shape
    kv_heads = call.keys.shape[1]
    positions = call.query_positions  # [B, q], -1 for pads
    counted = positions >= call.moments_skip
    # times the scaling, so that a query's product with a key is the attention logit
    unrotated = rotate(query.float() * call.scaling, -positions.clamp(min=0)[:, None, :], call.inv_freq)
    unrotated = unrotated * counted[:, None, :, None]
    grouped = unrotated.reshape(batch, kv_heads, q_heads // kv_heads, -1, dim)
    total = grouped.sum(dim=3)
    outer = torch.einsum("bhgqd,bhgqe->bhgde", grouped, grouped)
    return counted.sum(dim=1).float(), total, outer


def with_query_moments(stats: AttentionStats | None, query: torch.Tensor, call: AttentionCall) -> AttentionStats:
    """``stats`` (a backend's, or None when it computed none) with the call's query moments added."""
    count, total, outer = query_moments(query, call)
    if stats is None:
        real = call.query_positions >= 0
        stats = AttentionStats(queries=real.sum(dim=1))
    stats.query_count, stats.query_sum, stats.query_outer = count, total, outer
    return stats

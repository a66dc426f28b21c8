"""Attention with score tracking in plain torch: the CPU path and the reference for the Triton kernels.

Queries are processed in chunks so that at most ``chunk x slots`` probabilities exist at
once (never a T x T matrix). The G query heads of each KV head are folded into the
rows of one matmul, so K/V are never repeated for GQA. Layers whose policies need no
statistics skip all of this and run `scaled_dot_product_attention`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..policies.base import AttentionStats
from .call import AttentionCall, AttentionResult

#: the statistics a one-query decode step computes without the general (chunked, masked) path
DECODE_STATS = frozenset({"colsum", "colsum_sq", "below_uniform", "last_rows"})
# probabilities held at once per chunk, summed over batch and heads: small enough to stay in cache
_CHUNK_ELEMENTS = 1 << 22
# and at most this many queries per chunk: SmolLM2's prefill with H2O's statistics on one thread ran 1.09x / 1.21x
# plain SDPA at 2K / 4K tokens with 32, 1.12x / 1.24x with 4M elements alone (~100-400 queries), 1.13x / 1.30x with
# 64; one layer at 4K, after the shift-free exp2 and the logits buffer: 16 / 24 / 32 / 48 queries 1.41x / 1.32x /
# 1.28x / 1.23x SDPA. (SDPA's fused output plus a separate exp2(qk - lse) pass for the statistics measured 1.42x /
# 1.47x: two passes over Q K^T cost more than one softmax here.)
_CHUNK_QUERIES = 32
_LOG2_E = 1.4426950408889634
# a chunk's row sums of exp2(logits) without the row maximum subtracted are used as they are inside this range: far
# from float32's limits (2^-126, 2^128), no weight, output or 1 / sum overflows or loses precision to subnormals
_SUM_FLOOR, _SUM_CEILING = 2.0 ** -60, 2.0 ** 60
# statistics that read every normalized probability (the column sums do not: see `attend_tracking`)
_ELEMENT_STATS = frozenset({"colsum_sq", "colsum_heads", "near_colsum_heads", "below_uniform", "colmax"})


def attend(query: torch.Tensor, call: AttentionCall) -> AttentionResult:
    """One layer's attention call: plain SDPA when no statistics are asked for, else with score tracking (and with
    a key bias, which SDPA's boolean masks cannot carry, always: its statistics are then computed and not read)."""
    query = call.prepare_query(query)
    # one query per row sees every valid slot (they are all older): no position mask to build
    one_query = query.shape[2] == 1 and call.sliding_window is None and call.query_valid is None
    if not call.needs and call.key_bias is None:
        if one_query and not call.causal_only:
            # gaps in the slots: SDPA masked per KV head, the G queries of each folded into rows (interleaved A/B on
            # one thread, vLLM's paged decode at 12 requests x 300 / 1,500 tokens: 10% / 18% under the
            # matmul-softmax-matmul path this replaced)
            return AttentionResult(attend_sdpa(query, call.keys, call.values, call.valid[:, :, None], call.scaling),
                                   None)
        return AttentionResult(attend_plain(query, call), None)
    return AttentionResult(*_attend_with_stats(query, call, one_query))


def _attend_with_stats(query: torch.Tensor, call: AttentionCall, one_query: bool
                       ) -> tuple[torch.Tensor, AttentionStats]:
    """Output and statistics of a call that asks for some (``query`` prepared): a decode step's few ops, or the
    chunked, masked path."""
    if one_query and call.needs <= DECODE_STATS:
        valid = None if call.causal_only else call.valid
        return _decode_step(query, call.keys, call.values, call.scaling, call.needs, call.last_rows_window, valid,
                            call.key_bias)
    near_for = call.near_mask if "near_colsum_heads" in call.needs else None
    return attend_tracking(
        query, call.keys, call.values, None if call.causal_only else call.key_mask, call.scaling, call.needs,
        call.query_valid, call.past_slots, call.last_rows_window, near_for, call.key_bias,
    )


def score_pass(query: torch.Tensor, call: AttentionCall) -> AttentionStats:
    """The statistics ``call.needs`` (not empty) of `attend`, without its output: for an engine whose own kernel
    computes the output. The same path as `attend`'s, with no value columns (no value matmul)."""
    query = call.prepare_query(query)
    one_query = query.shape[2] == 1 and call.sliding_window is None and call.query_valid is None
    return _attend_with_stats(query, replace(call, values=call.values[..., :0]), one_query)[1]


def attend_plain(query: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    """SDPA with the cheapest mask that is exact, for calls that need no statistics."""
    queries, slots = query.shape[2], call.keys.shape[2]
    if call.causal_only and queries == 1:
        return attend_sdpa(query, call.keys, call.values, None, call.scaling)  # a decode step sees every slot
    if call.causal_only and slots == queries:  # a fresh, unpadded prompt
        out = F.scaled_dot_product_attention(
            query, call.keys, call.values, is_causal=True, scale=call.scaling,
            enable_gqa=query.shape[1] != call.keys.shape[1],
        )
        return out.transpose(1, 2)
    mask = call.key_mask(0, queries, slots)
    if bool((mask == mask[:, :1]).all()):
        mask = mask[:, :1]  # every KV head keeps the same tokens: one mask broadcast over heads
    return attend_sdpa(query, call.keys, call.values, mask, call.scaling)


def attend_sdpa(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Plain attention; ``mask`` is [B, Hkv, q, T] or [B, 1, q, T] bool (or None for all keys)."""
    batch, q_heads, queries, dim = query.shape
    kv_heads = keys.shape[1]
    groups = q_heads // kv_heads
    if mask is None or mask.shape[1] == 1:
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=_no_empty_rows(mask), scale=scaling, enable_gqa=groups > 1
        )
        return out.transpose(1, 2)
    # per-KV-head masks: fold each head's G queries into rows so K/V need no repeat
    folded = query.reshape(batch, kv_heads, groups * queries, dim)
    rows = mask[:, :, None].expand(batch, kv_heads, groups, queries, mask.shape[-1])
    rows = rows.reshape(batch, kv_heads, groups * queries, mask.shape[-1])
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=_no_empty_rows(rows), scale=scaling)
    return out.reshape(batch, q_heads, queries, dim).transpose(1, 2)


def _no_empty_rows(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Pad queries see no key; let them see all so softmax stays finite (their output is never used)."""
    if mask is None:
        return None
    return mask | ~mask.any(dim=-1, keepdim=True)


def attend_tracking(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask_for: Callable[[int, int, int], torch.Tensor] | None,
    scaling: float,
    needs: frozenset[str],
    query_valid: torch.Tensor | None,
    past_slots: int,
    last_rows: int = 0,
    near_for: Callable[[int, int, int], torch.Tensor] | None = None,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AttentionStats]:
    """Attention output [B, q, Hq, D] plus the requested statistics over the ``T`` key slots.

    ``mask_for(lo, hi, slots)`` returns the [B, Hkv, hi-lo, slots] bool mask of queries
    lo..hi-1 over the first ``slots`` slots; ``None`` means every cached slot is valid and
    only causality applies. New queries sit at slots ``past_slots + i``, so a chunk never
    needs keys past its last query's slot (the causal half is skipped).
    ``query_valid`` [B, q] marks real (non-pad) queries; pads add nothing to statistics.
    ``near_for(lo, hi, slots)`` ([B, Hkv, hi-lo, slots] bool, like ``mask_for``) says which keys are
    within the local band of each query, for ``near_colsum_heads``. ``key_bias`` [B, Hkv, T] is added to every
    query's logit of each slot (`AttentionCall.key_bias`).
    """
    batch, q_heads, queries, dim = query.shape
    kv_heads, total_slots = keys.shape[1], keys.shape[2]
    groups = q_heads // kv_heads
    stats_dtype = torch.float32
    if queries == 1 and mask_for is None and needs <= DECODE_STATS:
        return _decode_step(query, keys, values, scaling, needs, last_rows, key_bias=key_bias)
    per_key = (batch, kv_heads, total_slots)
    colsum = torch.zeros(per_key, dtype=stats_dtype, device=query.device) if "colsum" in needs else None
    colsum_sq = torch.zeros(per_key, dtype=stats_dtype, device=query.device) if "colsum_sq" in needs else None
    below = torch.zeros(per_key, dtype=stats_dtype, device=query.device) if "below_uniform" in needs else None
    colmax = torch.zeros(per_key, dtype=stats_dtype, device=query.device) if "colmax" in needs else None
    # per query head, for policies that do not reduce over the group by the mean (FastGen's profile)
    per_head = (batch, kv_heads, groups, total_slots)
    heads_sum = torch.zeros(per_head, dtype=stats_dtype, device=query.device) if "colsum_heads" in needs else None
    near_sum = None
    if "near_colsum_heads" in needs:
        if near_for is None:
            raise ValueError("near_colsum_heads needs near_for (the local band of each query)")
        near_sum = torch.zeros(per_head, dtype=stats_dtype, device=query.device)
    rows_out = None
    if "last_rows" in needs and last_rows > 0:
        window = min(last_rows, queries)
        rows_out = torch.zeros(batch, kv_heads, window, total_slots, dtype=stats_dtype, device=query.device)
    outputs = []
    chunk = max(1, min(queries, _CHUNK_QUERIES, _CHUNK_ELEMENTS // max(1, batch * q_heads * total_slots)))
    # base-2 logits: exp2 is cheaper than exp, and the scale folds into the (small) query
    grouped = (query.to(stats_dtype) * (scaling * _LOG2_E)).view(batch, kv_heads, groups, queries, dim)
    operands = _ChunkOperands(keys, values, stats_dtype, batch * kv_heads * groups * chunk * total_slots, key_bias)
    # its range check reads each chunk's row sums on the host: free on a CPU. Not for `below_uniform`: it compares each
    # probability with 1/t, and a lone key's exp2(l) * (1 / exp2(l)) can round below 1 where exp2(0) * 1 does not
    shift_free = query.device.type == "cpu" and "below_uniform" not in needs
    for lo in range(0, queries, chunk):
        hi = min(queries, lo + chunk)
        slots = min(total_slots, past_slots + hi)
        rows = groups * (hi - lo)
        q_chunk = grouped[:, :, :, lo:hi].reshape(batch, kv_heads, rows, dim)
        mask = None if mask_for is None else mask_for(lo, hi, slots)[:, :, None]  # [B, Hkv, 1, c, slots]
        real_rows = None
        if query_valid is not None:
            real_rows = query_valid[:, None, None, lo:hi].expand(batch, kv_heads, groups, hi - lo)
            real_rows = real_rows.reshape(batch, kv_heads, rows, 1)
        values_and_ones = operands.values_and_ones[:, :, :slots]
        attended = None
        if shift_free:
            attended = _exp2_attend(operands.logits(q_chunk, hi - lo, slots, mask), values_and_ones, real_rows)
        if attended is None:  # off CPU, or a row out of exp2's range without its maximum: the exact path
            attended = _shifted_exp2_attend(operands.logits(q_chunk, hi - lo, slots, mask), values_and_ones)
        weights, inverse, out = attended
        outputs.append(out.view(batch, q_heads, hi - lo, values.shape[-1]))
        if real_rows is not None:  # pads add nothing to the statistics
            inverse = inverse * real_rows
        if colsum is not None:  # the column sums of the normalized probabilities, without normalizing them first
            colsum[..., :slots] += torch.matmul(inverse.transpose(-1, -2), weights).squeeze(-2).div_(groups)
        if rows_out is not None:
            first = queries - rows_out.shape[2]
            if hi > first:
                take = max(lo, first)
                tail = weights.view(batch, kv_heads, groups, hi - lo, slots)[:, :, :, take - lo :]
                tail_scale = inverse.view(batch, kv_heads, groups, hi - lo, 1)[:, :, :, take - lo :]
                rows_out[:, :, take - first : hi - first, :slots] = (tail * tail_scale).mean(dim=2)
        if not needs & _ELEMENT_STATS:
            continue
        probs = weights.mul_(inverse).view(batch, kv_heads, groups, hi - lo, slots)
        if colsum_sq is not None:
            colsum_sq[..., :slots] += probs.square().sum(dim=3).mean(dim=2)
        if heads_sum is not None:
            heads_sum[..., :slots] += probs.sum(dim=3)
        if colmax is not None:  # pads' probabilities are 0 here: they raise no maximum
            torch.maximum(colmax[..., :slots], probs.amax(dim=(2, 3)), out=colmax[..., :slots])
        if near_sum is not None:
            near_sum[..., :slots] += (probs * near_for(lo, hi, slots)[:, :, None]).sum(dim=3)
        if below is not None:
            if mask is None:
                mask = _causal_mask(past_slots, lo, hi, slots, query.device)
            seen = mask.sum(dim=-1, keepdim=True).clamp(min=1)
            is_below = mask & (probs * seen < 1.0)
            if query_valid is not None:
                is_below = is_below & query_valid[:, None, None, lo:hi, None]
            below[..., :slots] += is_below.float().sum(dim=3).mean(dim=2)
    output = torch.cat(outputs, dim=2).to(query.dtype).transpose(1, 2)
    real = query_valid.sum(dim=1) if query_valid is not None else torch.full((batch,), queries, device=query.device)
    stats = AttentionStats(
        queries=real, colsum=colsum, colsum_sq=colsum_sq, below_uniform=below, last_rows=rows_out,
        colsum_heads=heads_sum, near_colsum_heads=near_sum, colmax=colmax,
    )
    return output, stats


class _ChunkOperands:
    """The keys and values as a chunk's matmuls read them fastest, made once per call: the keys transposed and
    contiguous, the values with a column of ones (the output's matmul then returns each row's sum of weights too,
    which saves a pass over the chunk's weights), and one buffer that every chunk's logits are written into (a fresh
    multi-MB tensor per chunk faults in new pages: one layer at 4K tokens spent ~40% longer in its Q K^T)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype, buffer_elements: int,
                 key_bias: torch.Tensor | None = None):
        # base 2, like the logits; [B, Hkv, 1, T] to broadcast over a chunk's rows
        self.bias = None if key_bias is None else (key_bias.to(dtype) * _LOG2_E)[:, :, None]
        self.keys_t = keys.to(dtype).transpose(-1, -2).contiguous()
        ones = values.new_ones((*values.shape[:-1], 1), dtype=dtype)
        self.values_and_ones = torch.cat([values.to(dtype), ones], dim=-1)
        self.buffer = keys.new_empty(buffer_elements, dtype=dtype)
        self._future: torch.Tensor | None = None  # [c, c] bool: a chunk's diagonal block, above the diagonal

    def logits(self, q_chunk: torch.Tensor, queries: int, slots: int, mask: torch.Tensor | None) -> torch.Tensor:
        """[B, Hkv, G * c, slots] base-2 logits of a chunk of ``queries`` (c) queries, -inf where ``mask``
        ([B, Hkv, 1, c, slots] bool) is False, or (``mask`` None) past each query's own slot."""
        batch, kv_heads, rows, _ = q_chunk.shape
        keys_t = self.keys_t[..., :slots]
        if torch.is_grad_enabled() and (q_chunk.requires_grad or keys_t.requires_grad):
            logits = torch.matmul(q_chunk, keys_t)  # out= takes no part in autograd
        else:
            into = self.buffer[: batch * kv_heads * rows * slots].view(batch, kv_heads, rows, slots)
            logits = torch.matmul(q_chunk, keys_t, out=into)
        if self.bias is not None:
            logits.add_(self.bias[..., :slots])
        per_query = logits.view(batch, kv_heads, rows // queries, queries, slots)
        if mask is not None:
            per_query.masked_fill_(~mask, -torch.inf)
        elif queries > 1:  # causality only bites inside the chunk's own diagonal block
            if self._future is None or self._future.shape[0] < queries:
                self._future = torch.ones(queries, queries, dtype=torch.bool, device=logits.device).triu_(1)
            per_query[..., slots - queries :].masked_fill_(self._future[:queries, :queries], -torch.inf)
        return logits


def _exp2_attend(logits: torch.Tensor, values_and_ones: torch.Tensor, real_rows: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(weights, each row's 1 / sum, output) of a chunk from ``exp2(logits)`` taken in place without subtracting
    each row's maximum (softmax does not change with the shift; skipping it saves two passes over the chunk), or
    None where a real row's sum leaves the range in which that is exact: the caller then takes the shifted path.
    Rows that are not ``real_rows`` (pads) may sum to 0: their output and weight are 0."""
    weights = logits.exp2_()
    out = torch.matmul(weights, values_and_ones)
    total = out[..., -1:]
    in_range = (total > _SUM_FLOOR) & (total < _SUM_CEILING)
    if real_rows is not None:
        in_range |= ~real_rows & (total == 0)
    if not bool(in_range.all()):
        return None
    inverse = torch.where(total > 0, total.reciprocal(), 0.0)
    return weights, inverse, out[..., :-1] * inverse


def _shifted_exp2_attend(logits: torch.Tensor, values_and_ones: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_exp2_attend` for any logits: ``exp2(logits - row max)`` (a row that sees no key gets weight and output 0)."""
    row_max = logits.amax(dim=-1, keepdim=True).nan_to_num_(0.0, posinf=0.0, neginf=0.0)
    weights = logits.sub_(row_max).exp2_()
    out = torch.matmul(weights, values_and_ones)
    total = out[..., -1:]
    inverse = torch.where(total > 0, total.reciprocal(), 0.0)
    return weights, inverse, out[..., :-1] * inverse


def _causal_mask(past_slots: int, lo: int, hi: int, slots: int, device: torch.device) -> torch.Tensor:
    """[1, 1, 1, hi-lo, slots]: query i (at slot past_slots + i) sees slots up to its own."""
    query_slots = past_slots + torch.arange(lo, hi, device=device)
    return (torch.arange(slots, device=device)[None, :] <= query_slots[:, None])[None, None, None]


def _decode_step(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, needs: frozenset[str],
    last_rows: int, valid: torch.Tensor | None = None, key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AttentionStats]:
    """One query per row over the cache (``valid`` [B, Hkv, T]: the slots holding a token; None: all): the few
    ops a decode step needs, the statistics of `DECODE_STATS` included."""
    batch, q_heads = query.shape[:2]
    probs = _decode_probs(query, keys, scaling, valid, key_bias)
    out = torch.matmul(probs, values.float()).reshape(batch, 1, q_heads, values.shape[-1]).to(query.dtype)
    return out, decode_stats(probs, valid, needs, last_rows)


def _decode_probs(query: torch.Tensor, keys: torch.Tensor, scaling: float, valid: torch.Tensor | None,
                  key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Hkv, G, T]: the attention of one query per row, the G query heads of each KV head apart."""
    batch, q_heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.reshape(batch, kv_heads, q_heads // kv_heads, dim).float() * scaling
    logits = torch.matmul(grouped, keys.float().transpose(-1, -2))  # [B, Hkv, G, T]
    if key_bias is not None:
        logits.add_(key_bias[:, :, None])
    if valid is not None:
        logits.masked_fill_(~valid[:, :, None], -torch.inf)
    return torch.softmax(logits, dim=-1)


def decode_stats(probs: torch.Tensor, valid: torch.Tensor | None, needs: frozenset[str], last_rows: int
                 ) -> AttentionStats:
    """The `DECODE_STATS` of one query per row from its probabilities ``probs`` [B, Hkv, G, T] (``valid``
    [B, Hkv, T]: the slots holding a token; None: all)."""
    batch, kv_heads, _, slots = probs.shape
    colsum = probs.mean(dim=2)
    queries = torch.ones(batch, dtype=torch.long, device=probs.device)
    below = None
    if "below_uniform" in needs:
        seen = (valid.sum(dim=-1, keepdim=True) if valid is not None
                else torch.full((batch, kv_heads, 1), slots, device=probs.device))
        is_below = (probs * seen[:, :, None] < 1.0)
        if valid is not None:
            is_below &= valid[:, :, None]
        below = is_below.float().mean(dim=2)
    return AttentionStats(
        queries=queries, colsum=colsum,
        colsum_sq=probs.square().mean(dim=2) if "colsum_sq" in needs else None,
        below_uniform=below,
        last_rows=colsum[:, :, None] if "last_rows" in needs and last_rows > 0 else None,
    )

"""The score passes of a paged cache: the attention statistics kvpolicy's policies read, from the keys where an
engine's blocks hold them, without the output (the engine's own kernel computes that).

Which pass runs (`scores`):

- a batch of decode steps (one query per request): `decode_scores`, one batched matmul over every (request, KV head,
  block); on CUDA, for the statistics the Triton kernels give, `scores_in_place` over the blocks where they lie;
- a few queries per request at its last slots, such as a request's stored decode queries (`deferred`):
  `few_query_scores`, each (request, KV head)'s keys gathered into one matrix, one matmul for all its queries;
- anything else (a prompt chunk): kvpolicy's chunked reference pass (`backend.torch_ref.score_pass`).

Torch only (no vLLM). The keys are a layer's ``[blocks, Hkv, bs, D]`` view of any strides.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ...backend import torch_ref
from ...backend.call import AttentionCall
from ...policies.base import AttentionStats

if TYPE_CHECKING:
    from .compact_rows import CompactRows

#: the statistics a pass over several stored queries of a request gives as the sum of theirs, one by one
ADDITIVE_STATS = frozenset({"colsum", "colsum_sq"})


#: at most this many queries per request take `few_query_scores` (stored decode queries); longer
#: prompt chunks take torch_ref's chunked pass
FEW_QUERIES = 64
#: at most about this many elements of keys or logits at once in those passes (16 MiB in fp32)
PART_ELEMENTS = 1 << 22

#: the statistics the Triton kernels compute from the blocks in place (`backend.triton_paged`), for a decode step
IN_PLACE_STATS = frozenset({"colsum", "last_rows"})


def _key_rows(keys: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A layer's keys ``[blocks, Hkv, bs, D]`` as one row per (block, KV head): ``[blocks * Hkv, bs * D]``, and
    whether each row holds them transposed (``[D, bs]``, vLLM's CPU cache) or not (``[bs, D]``). Rows of contiguous
    elements make the copy of a batch's blocks a plain one (an index_select over a strided 4-d view took torch's
    element-wise path: ~5x slower at 12 requests x 330 tokens)."""
    blocks, heads, block_size, dim = keys.shape
    for transposed, inner in ((True, keys.transpose(-1, -2)), (False, keys)):
        if inner.stride(3) == 1 and inner.stride(2) == inner.shape[3] and inner.stride(0) == heads * inner.stride(1):
            rows = inner.as_strided((blocks * heads, block_size * dim), (inner.stride(1), 1), inner.storage_offset())
            return rows, transposed
    return keys.reshape(blocks * heads, block_size * dim), False  # any other layout: one copy of the whole layer


_WORKSPACES: dict[tuple[str, torch.device, torch.dtype, bool], torch.Tensor] = {}


def _workspace(name: str, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A reused buffer (``name``: the keys' copy, the logits) for the score passes, the same for every layer: they
    run one after another. A fresh allocation of a few hundred KiB to megabytes each layer came from the OS page by
    page: on this project's CPU a softmax over 100K logits took 210 us in fresh memory, 80 us in reused memory. One
    per inference mode: a tensor made in one cannot be written in the other."""
    key = (name, like.device, like.dtype, torch.is_inference_mode_enabled())
    count = math.prod(shape)
    buffer = _WORKSPACES.get(key)
    if buffer is None or buffer.numel() < count:
        buffer = _WORKSPACES[key] = torch.empty(count, dtype=like.dtype, device=like.device)
    return buffer[:count].view(shape)


def rows_at_once(cache_keys: torch.Tensor, rows: CompactRows, query: torch.Tensor, query_index: torch.Tensor,
                 needs: frozenset[str], backend: str) -> int:
    """How many of ``rows`` `scores` may score at once: the torch passes below hold every row's keys and logits
    together, at most about `PART_ELEMENTS` of them."""
    if not _gathers_rows(query_index, needs, backend):
        return len(rows.lengths)
    per_row = rows.width * max(query.shape[1] * query_index.shape[1], cache_keys.shape[1] * query.shape[-1])
    return max(1, PART_ELEMENTS // per_row)


def _decoding(query_index: torch.Tensor) -> bool:
    return query_index.shape[1] == 1 and bool((query_index >= 0).all())


def _gathers_rows(query_index: torch.Tensor, needs: frozenset[str], backend: str) -> bool:
    decoding = _decoding(query_index)
    if decoding and backend == "triton" and needs <= IN_PLACE_STATS:
        return False
    return decoding and needs <= torch_ref.DECODE_STATS or query_index.shape[1] <= FEW_QUERIES and needs <= ADDITIVE_STATS


def scores(cache_keys: torch.Tensor, cache_values: torch.Tensor, positions: torch.Tensor, rows: CompactRows,
           query: torch.Tensor, query_index: torch.Tensor, query_positions: torch.Tensor, scaling: float,
           needs: frozenset[str], window: int, backend: str = "torch") -> AttentionStats:
    """The statistics ``needs`` of ``query`` [N, Hq, D] rows ``query_index`` [R, q] (-1: pad; a request's tokens
    right-aligned, its last ones at the end of its slots) at ``query_positions`` [R, q] over the requests' slots
    (``positions``: each slot's token, for the reference pass)."""
    decoding = _decoding(query_index)
    if decoding and backend == "triton" and needs <= IN_PLACE_STATS:
        return scores_in_place(cache_keys, cache_values, rows, query[query_index[:, 0]], scaling, needs, window)
    if decoding and needs <= torch_ref.DECODE_STATS:
        return decode_scores(cache_keys, rows, query[query_index[:, 0]], scaling, needs, window)
    if query_index.shape[1] <= FEW_QUERIES and needs <= ADDITIVE_STATS:
        return few_query_scores(cache_keys, rows, query, query_index, scaling, needs)
    heads = cache_keys.shape[1]
    valid = rows.valid().expand(-1, heads, -1)
    keys = rows.gather(cache_keys).float()
    query_valid = query_index >= 0
    width = query_index.shape[1]
    call = AttentionCall(
        keys=keys, values=keys[..., :0], valid=valid,
        key_positions=torch.where(valid, rows.gather(positions).long(), -1),
        query_positions=torch.where(query_valid, query_positions, -1),
        query_valid=None if bool(query_valid.all()) else query_valid, past_slots=keys.shape[2] - width,
        scaling=scaling, needs=needs, last_rows_window=window,
        # hole-free: one request's queries are its last slots, and causality is the whole mask
        causal_only=len(rows.lengths) == 1 and bool(query_valid.all()),
    )
    grouped_query = query[query_index.clamp(min=0)].permute(0, 2, 1, 3).float()  # [R, Hq, q, D]
    return torch_ref.score_pass(grouped_query, call)


def decode_scores(cache_keys: torch.Tensor, rows: CompactRows, query: torch.Tensor, scaling: float,
              needs: frozenset[str], window: int) -> AttentionStats:
    """One query per request (``query`` [R, Hq, D]): the logits block by block, one batched matmul over every
    (request, KV head, block), from a copy of the blocks' keys as the cache stores them (vLLM's CPU cache:
    transposed), then a softmax over each request's slots."""
    heads, block_size, dim = cache_keys.shape[1], rows.block_size, query.shape[-1]
    requests, count = rows.blocks.shape
    groups = query.shape[1] // heads
    grouped = (query.view(requests, heads, 1, groups, dim).float() * scaling).expand(
        requests, heads, count, groups, dim).reshape(-1, groups, dim)
    key_rows, transposed = _key_rows(cache_keys)
    index = rows.key_rows(heads).reshape(-1)  # one row per (request, KV head, block)
    picked = torch.index_select(key_rows, 0, index,
                                out=_workspace("keys", key_rows, (len(index), key_rows.shape[1])))
    picked = picked.float()
    keys = picked.view(-1, dim, block_size) if transposed else picked.view(-1, block_size, dim).transpose(1, 2)
    logits = torch.bmm(grouped, keys).view(requests, heads, count, groups, block_size)
    logits = logits.transpose(2, 3).reshape(requests, heads, groups, count * block_size)[..., : rows.width]
    valid = rows.valid()
    probs = torch.softmax(logits.masked_fill_(~valid[:, :, None], -torch.inf), dim=-1)
    return torch_ref.decode_stats(probs, valid.expand(-1, heads, -1), needs, window)


def few_query_scores(cache_keys: torch.Tensor, rows: CompactRows, query: torch.Tensor, query_index: torch.Tensor,
                 scaling: float, needs: frozenset[str]) -> AttentionStats:
    """The `ADDITIVE_STATS` of a few queries per request, each its request's token at the last slots (``query``
    [N, Hq, D] rows ``query_index`` [R, q], right-aligned, -1: pad), as stored decode queries are: the keys of
    each (request, KV head) copied once into one matrix, one matmul for all its queries, causal by slot."""
    heads, block_size, dim = cache_keys.shape[1], rows.block_size, query.shape[-1]
    (requests, count), width, queries = rows.blocks.shape, rows.width, query_index.shape[1]
    groups = query.shape[1] // heads
    real = query_index >= 0  # [R, q]
    grouped = query[query_index.clamp(min=0)].view(requests, queries, heads, groups, dim)
    grouped = grouped.permute(0, 2, 1, 3, 4).reshape(requests * heads, queries * groups, dim).float() * scaling
    key_rows, transposed = _key_rows(cache_keys)
    index = rows.key_rows(heads).reshape(-1)
    picked = torch.index_select(key_rows, 0, index,
                                out=_workspace("keys", key_rows, (len(index), key_rows.shape[1])))
    blocks = (picked.view(requests, heads, count, dim, block_size) if transposed
              else picked.view(requests, heads, count, block_size, dim).transpose(-1, -2))
    keys = _workspace("keys by head", grouped, (requests, heads, dim, count, block_size)).copy_(
        blocks.permute(0, 1, 3, 2, 4)).view(requests * heads, dim, count * block_size)[..., :width]
    logits = torch.bmm(grouped, keys,
                       out=_workspace("logits", grouped, (requests * heads, queries * groups, width)))
    logits = logits.view(requests, heads, queries, groups, width)
    # query j sees the slots up to its own token's, len - q + j; a pad sees the request's slots and counts for
    # nothing. Every hidden slot lies past the shortest request's len - q: only those columns are masked
    lengths = rows.lengths.to(real.device)
    own = torch.where(real, lengths[:, None] - queries + torch.arange(queries, device=real.device),
                      lengths[:, None] - 1)
    first = max(0, int(lengths.min()) - queries)
    hidden = torch.arange(first, width, device=real.device) > own[..., None]  # [R, q, width - first]
    logits[..., first:].masked_fill_(hidden[:, None, :, None], -torch.inf)
    probs = torch.softmax(logits, dim=-1)
    if not bool(real.all()):
        probs.mul_(real[:, None, :, None, None])
    colsum = probs.sum(dim=(2, 3)).div_(groups)
    colsum_sq = probs.square().sum(dim=(2, 3)).div_(groups) if "colsum_sq" in needs else None
    return AttentionStats(queries=real.sum(dim=1), colsum=colsum, colsum_sq=colsum_sq)


def scores_in_place(cache_keys: torch.Tensor, cache_values: torch.Tensor, rows: CompactRows, query: torch.Tensor,
                scaling: float, needs: frozenset[str], window: int) -> AttentionStats:
    """The Triton score pass over the blocks where they lie, from the log-sum-exp of kvpolicy's paged decode
    kernel (an engine whose kernel returns one can hand it over instead)."""
    from ...backend.triton_paged import paged_column_sums, paged_decode

    heads = cache_keys.shape[1]
    slots = rows.blocks.shape[1] * rows.block_size
    valid = torch.arange(slots, device=query.device) < rows.lengths.to(query.device)[:, None]
    valid = valid[:, None].expand(-1, heads, -1)
    table = rows.blocks.to(query.device)
    _, lse = paged_decode(query, cache_keys, cache_values, table, valid, scaling)
    colsum = paged_column_sums(query, cache_keys, table, valid, lse, scaling)[:, :, : rows.width]
    queries = torch.ones(query.shape[0], dtype=torch.long, device=query.device)
    needs, window = needs, window
    last_rows = colsum[:, :, None] if "last_rows" in needs and window > 0 else None
    return AttentionStats(queries=queries, colsum=colsum, last_rows=last_rows)

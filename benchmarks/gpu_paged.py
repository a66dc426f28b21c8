"""The vLLM integration's paged decode on a GPU: `backend/triton_paged.py` against the gather path, checked and timed.

    python benchmarks/gpu_paged.py --out OUT.json                       # CUDA, Llama-3-8B's heads (32 query, 8 KV, 128)
    TRITON_INTERPRET=1 python benchmarks/gpu_paged.py --device cpu --requests 2 --context 40 --heads 4 2 --dim 16

A batch of decode steps over paged blocks laid out as an evicted request's are (an arena with holes, then blocks
in place from an evicted head on), shuffled over the pool: per layer call, the in-place kernels (output + log-sum-exp,
then the score pass) against a gather path with torch's attention; and an eviction's compaction by `move_slots`
against torch's indexing (the CPU path), both over a copy of the cache (the copy's time is in both). Prints the
largest differences, whether the compactions agree, and the median milliseconds of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvpolicy.backend.torch_ref import _decode_step
from kvpolicy.backend.triton_paged import move_slots, paged_column_sums, paged_decode


def layout(requests: int, context: int, heads: int, block: int, device: torch.device, seed: int = 0):
    """(block table [R, nblk], valid [R, Hkv, nblk * block], number of pool blocks): each request's slots hold
    ``context`` tokens with ~5% holes in its first half (an arena) and an evicted head in its first block after."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-(context + block) // block)
    pool = 1 + requests * blocks
    table = (1 + torch.randperm(pool - 1, generator=generator)).view(requests, blocks)
    valid = torch.ones(requests, heads, blocks * block, dtype=torch.bool)
    valid[:, :, context:] = False
    half = blocks // 2 * block
    valid[:, :, :half] &= torch.rand(requests, heads, half, generator=generator) > 0.05
    valid[:, :, half: half + block // 2] = False
    return table.to(device), valid.to(device), pool


def gathered(query, keys, values, table, valid, scaling):
    """The gather path: the request's blocks copied out, then the torch path's decode step with H2O's statistic
    (what `PagedPolicies` runs without the Triton kernels)."""
    requests, _, dim = query.shape
    kv_heads = keys.shape[1]
    k = keys[table].permute(0, 2, 1, 3, 4).reshape(requests, kv_heads, -1, dim)
    v = values[table].permute(0, 2, 1, 3, 4).reshape(requests, kv_heads, -1, dim)
    out, stats = _decode_step(query[:, :, None], k, v, scaling, frozenset({"colsum"}), 0, valid)
    return out[:, 0], stats.colsum


def in_place(query, keys, values, table, valid, scaling):
    out, lse = paged_decode(query, keys, values, table, valid, scaling)
    return out, paged_column_sums(query, keys, table, valid, lse, scaling)


def compaction(keys, values, table, kv_heads: int, block: int, generator: torch.Generator):
    """An eviction's moves for every request and KV head (a fifth of its slots, from the back half into the front
    half), as `move_slots` and as torch's indexing (the CPU path) apply them to copies of the cache."""
    requests, blocks = table.shape
    per_cell = blocks * block // 5
    picks = torch.stack([torch.randperm(blocks * block // 2, generator=generator)[: 2 * per_cell]
                         for _ in range(requests * kv_heads)]).view(requests, kv_heads, 2, per_cell)
    half = blocks * block // 2
    row = torch.arange(requests)[:, None, None].expand(requests, kv_heads, per_cell).reshape(-1)
    head = torch.arange(kv_heads)[None, :, None].expand(requests, kv_heads, per_cell).reshape(-1)
    target, source = picks[:, :, 0].reshape(-1), half + picks[:, :, 1].reshape(-1)
    device = keys.device
    table_cpu = table.cpu()
    src = (table_cpu[row, source // block].to(device), (source % block).to(device))
    dst = (table_cpu[row, target // block].to(device), (target % block).to(device))
    head = head.to(device)

    def with_kernel():
        k, v = keys.clone(), values.clone()
        move_slots(k, v, src, dst, head)
        return k, v

    def with_torch():
        k, v = keys.clone(), values.clone()
        for tensor in (k, v):
            tensor[dst[0], head, dst[1]] = tensor[src[0], head, src[1]]
        return k, v

    return with_kernel, with_torch


def timed(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("QUERY", "KV"))
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    q_heads, kv_heads = args.heads
    rows = []
    for requests in args.requests:
        for context in args.context:
            table, valid, pool = layout(requests, context, kv_heads, args.block_size, device)
            cache = torch.randn(pool, kv_heads, args.block_size, 2 * args.dim, device=device, dtype=dtype)
            keys, values = cache[..., : args.dim], cache[..., args.dim:]  # the halves of one slot, as on CPU
            query = torch.randn(requests, q_heads, args.dim, device=device, dtype=dtype)
            inputs = (query, keys, values, table, valid, args.dim ** -0.5)
            ref_out, ref_colsum = gathered(*inputs)
            out, colsum = in_place(*inputs)
            row = {
                "requests": requests, "context": context, "heads": [q_heads, kv_heads], "dim": args.dim,
                "block_size": args.block_size, "dtype": args.dtype, "device": str(device),
                "max_output_diff": (out.float() - ref_out).abs().max().item(),
                "max_colsum_diff": (colsum - ref_colsum).abs().max().item(),
                "in_place_ms": timed(lambda inputs=inputs: in_place(*inputs), device, args.repeats),
                "decode_only_ms": timed(lambda inputs=inputs: paged_decode(*inputs), device, args.repeats),
                "gather_ms": timed(lambda inputs=inputs: gathered(*inputs), device, args.repeats),
            }
            move_kernel, move_torch = compaction(keys, values, table, kv_heads, args.block_size,
                                                 torch.Generator().manual_seed(1))
            (k1, v1), (k2, v2) = move_kernel(), move_torch()
            row["compaction_equal"] = bool(torch.equal(k1, k2) and torch.equal(v1, v2))
            row["compaction_kernel_ms"] = timed(move_kernel, device, args.repeats)
            row["compaction_torch_ms"] = timed(move_torch, device, args.repeats)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

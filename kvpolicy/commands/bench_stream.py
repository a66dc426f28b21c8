"""``kvpolicy bench --stream-tokens``: memory over a long stream through one bounded cache.

Text is fed through one bounded cache in chunks of ``--stream-chunk`` tokens; every ``--every`` tokens
the live and allocated KV bytes and the process's resident memory are recorded. After warm-up the
allocated bytes must stay flat.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from ..recipe import load_recipe, with_budget
from ..recipe.budget import Budget, parse_budget
from .bench_meter import resident_bytes


@torch.inference_mode()
def run_stream(model: Any, text_ids: torch.Tensor, args: argparse.Namespace, log) -> list[dict]:
    from ..hf.session import attach, cache_keyword

    name = args.recipe or (args.recipes[0] if args.recipes else "h2o")
    recipe = load_recipe(name)
    if args.budget:
        recipe = with_budget(recipe, parse_budget(args.budget))
    memory = recipe.budget.memory
    if recipe.budget.tokens is None and memory is None:
        # a ratio resolves from the first forward pass, which in a stream is one chunk
        recipe = with_budget(recipe, Budget(tokens=args.stream_budget))
    session = attach(model, recipe)
    # a budget in bytes is a share of what --stream-budget tokens would take at 16 bits
    cache = session.new_cache(prompt_tokens=args.stream_budget if memory is not None else None)
    device = next(model.parameters()).device
    total = args.stream_tokens
    ids = text_ids.repeat(math.ceil(total / text_ids.numel()))[:total].to(device)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and total > limit:
        log(f"note: positions past the model's {limit} are outside its training range; memory is what is measured")
    samples = []
    fed = 0
    while fed < total:
        chunk = ids[None, fed : fed + args.stream_chunk]
        model(input_ids=chunk, use_cache=True, **{cache_keyword(model): cache})
        fed += chunk.shape[1]
        if fed % args.every < chunk.shape[1] or fed == total:
            report = cache.memory_report()
            samples.append({
                "mode": "stream", "config": recipe.name, "budget": recipe.budget.describe(), "tokens": fed,
                "live_bytes": report.live_kv_bytes, "allocated_bytes": report.allocated_kv_bytes,
                "metadata_bytes": report.metadata_bytes, "rss_bytes": resident_bytes(),
                "gpu_bytes": torch.cuda.memory_allocated() if device.type == "cuda" else None,
            })
    session.detach()
    return _stream_summary(samples, cache, recipe, log, args.stream_budget)


def _stream_summary(samples: list[dict], cache: Any, recipe: Any, log, stream_budget: int) -> list[dict]:
    """Flatness after warm-up: the first sample with every layer at its budget, plus one more sample.

    A budget in bytes (``memory``) counts everything the cache holds (K/V, scales, per-slot metadata): its
    samples' ``live_bytes`` are those held bytes, which must stay at or under the budget."""
    layers = [layer for layer in cache.layers if layer.is_initialized]
    heads = sum(layer.valid.shape[1] for layer in layers)
    per_token = layers[0].bytes_per_token()
    memory = recipe.budget.memory
    if memory is not None:
        head_dim = layers[0].store.tiers[0].keys.shape[-1]
        budget_bytes = math.floor(memory * stream_budget * 4 * head_dim) * heads
        for sample in samples:
            sample["live_bytes"] = sample["allocated_bytes"] + sample["metadata_bytes"]
        warm = next((i for i, s in enumerate(samples) if s["live_bytes"] >= 0.95 * budget_bytes), None)
    else:
        budget_bytes = recipe.budget.tokens * heads * per_token if recipe.budget.tokens else None
        warm = next((i for i, s in enumerate(samples) if budget_bytes and s["live_bytes"] >= budget_bytes), None)
    after = samples[warm + 1 :] if warm is not None else []
    summary = {"mode": "stream-summary", "config": recipe.name, "budget": recipe.budget.describe(),
               "tokens": samples[-1]["tokens"], "budget_bytes": budget_bytes, "samples_after_warmup": len(after)}
    if after:
        allocated = [s["allocated_bytes"] for s in after]
        live = [s["live_bytes"] for s in after]
        summary.update(
            allocated_min=min(allocated), allocated_max=max(allocated),
            allocated_spread=(max(allocated) - min(allocated)) / max(allocated),
            allocated_over_budget=max(allocated) / budget_bytes - 1, live_over_budget=max(live) / budget_bytes - 1,
        )
        rss = [s["rss_bytes"] for s in after if s["rss_bytes"] is not None]
        if len(rss) >= 2:
            summary["rss_growth_bytes"] = rss[-1] - rss[0]
        summary["flat"] = summary["allocated_spread"] <= 0.01 and summary["live_over_budget"] <= (0 if memory else 0.01)
    return samples + [summary]


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

from ..plan import Budget
from ..recipe import load_recipe, with_budget
from .bench_meter import resident_bytes
from .common import parse_budget


@torch.inference_mode()
def run_stream(model: Any, text_ids: torch.Tensor, args: argparse.Namespace, log) -> list[dict]:
    from ..hf.session import attach, cache_keyword

    name = args.recipe or (args.recipes[0] if args.recipes else "h2o")
    recipe = load_recipe(name)
    if args.budget:
        recipe = with_budget(recipe, parse_budget(args.budget))
    if recipe.budget.tokens is None:
        # a ratio resolves from the first forward pass, which in a stream is one chunk
        recipe = with_budget(recipe, Budget(tokens=args.stream_budget))
    session = attach(model, recipe)
    cache = session.new_cache()
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
    return _stream_summary(samples, cache, recipe, log)


def _stream_summary(samples: list[dict], cache: Any, recipe: Any, log) -> list[dict]:
    """Flatness after warm-up: the first sample with every layer at its budget, plus one more sample."""
    layers = [layer for layer in cache.layers if layer.is_initialized]
    heads = sum(layer.valid.shape[1] for layer in layers)
    per_token = layers[0].bytes_per_token()
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
        summary["flat"] = summary["allocated_spread"] <= 0.01 and summary["live_over_budget"] <= 0.01
    return samples + [summary]


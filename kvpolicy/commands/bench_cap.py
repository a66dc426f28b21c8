"""``kvpolicy bench --kv-memory``: decode throughput of the largest batch that fits a KV memory cap.

A smaller cache lets a bigger batch fit in the same memory,
and a bigger batch reads the weights once for more tokens: that is where H2O's reported
throughput gains come from. For each recipe, and for plain transformers (SDPA +
DynamicCache) as the baseline:

1. one sequence at the longest prompt runs prefill + decoding with a meter on the cache,
   whose peak bytes (K/V storage plus per-slot metadata, read from the cache's own tensors
   after every layer's update, so the one layer that holds the whole prompt before it
   evicts is counted) give the bytes per sequence;
2. the largest batch under the cap is ``cap // bytes per sequence``; it runs with the meter
   on and, if its measured peak is over the cap, the batch shrinks until it fits;
3. batch sizes 1, B/4, B/2 and B run prefill once each, then decode in rounds that take
   turns across the configurations; decode tokens/s is the median over rounds.

Prompts in one batch have different lengths (``--spread``), left-padded; after decoding,
every (layer, row, KV head) of a bounded recipe is checked to hold its own row's budget.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import KVPolicyError
from ..recipe import load_recipe, with_budget
from ..recipe.budget import parse_budget
from .bench_meter import PeakMeter, cache_bytes

PLAIN = "plain"
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(text: str) -> int:
    """'512MiB' -> 536870912; units B, KB/KiB, MB/MiB, GB/GiB (case-insensitive)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise KVPolicyError(f"memory size {text!r}: write a number and a unit, e.g. 512MiB, 2GiB or 800MB")
    size = float(match.group(1)) * _UNITS[unit]
    if not 0 < size <= 1 << 50:  # a PiB: past any machine's memory (and inf, for a number of hundreds of digits)
        raise KVPolicyError(f"memory size {text[:40]!r} must be above zero and at most 1 PiB, e.g. 512MiB")
    return int(size)


# --- configurations ------------------------------------------------------------------------------------
@dataclass
class Config:
    label: str
    session: Any = None  # kvpolicy Session; None: plain transformers
    budget: str = "-"

    def use(self, model: Any) -> None:
        """Switch the model to this configuration's attention (configurations take turns on one model)."""
        from ..hf.attention import ATTENTION_NAME

        model.set_attn_implementation("sdpa" if self.session is None else ATTENTION_NAME)

    def new_cache(self, model: Any) -> Any:
        self.use(model)
        if self.session is None:
            from transformers import DynamicCache

            return DynamicCache(config=model.config)
        return self.session.new_cache()


def attach_configs(model: Any, names: list[str], budget: str | None, tokenizer: Any = None) -> list[Config]:
    from ..hf.session import attach

    configs = [Config(PLAIN)]
    previous = model.config._attn_implementation
    for name in dict.fromkeys(names):
        recipe = load_recipe(name)
        if budget:
            recipe = with_budget(recipe, parse_budget(budget))
        session = attach(model, recipe, tokenizer=tokenizer)
        model.set_attn_implementation(previous)
        label = recipe.name if all(c.label != recipe.name for c in configs) else name
        configs.append(Config(label, session, recipe.budget.describe()))
    return configs


def _prompts(text_ids: torch.Tensor, longest: int, spread: float, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` consecutive pieces of the text, lengths from (1 - spread) x longest to longest, left-padded."""
    shortest = max(1, round(longest * (1 - spread)))
    lengths = [longest - (longest - shortest) * i // max(1, batch - 1) for i in range(batch)]
    needed = sum(lengths)
    ids = text_ids.repeat(math.ceil(needed / text_ids.numel())) if needed > text_ids.numel() else text_ids
    out = torch.zeros(batch, longest, dtype=torch.long)
    mask = torch.zeros(batch, longest, dtype=torch.long)
    start = 0
    for row, length in enumerate(lengths):
        out[row, longest - length :] = ids[start : start + length]
        mask[row, longest - length :] = 1
        start += length
    return out, mask


# --- one run ---------------------------------------------------------------------------------------------
@dataclass
class Run:
    config: Config
    batch: int
    cache: Any = None
    mask: torch.Tensor | None = None
    next_token: torch.Tensor | None = None
    prompt_lengths: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    tokens: list[torch.Tensor] = field(default_factory=list)  # generated, one [batch, 1] per step
    round_rates: list[float] = field(default_factory=list)
    peak_bytes: int = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _forward(model: Any, run: Run, ids: torch.Tensor) -> torch.Tensor:
    """One forward over ``ids`` (the mask already covers them); positions skip the left pads, as ``generate`` does."""
    from ..hf.session import cache_keyword

    positions = (run.mask.cumsum(dim=1) - 1).clamp(min=0)[:, -ids.shape[1] :]
    out = model(
        input_ids=ids, attention_mask=run.mask, position_ids=positions, use_cache=True,
        **{cache_keyword(model): run.cache},
    )
    token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
    run.tokens.append(token)
    return token


@torch.inference_mode()
def _prefill(model: Any, run: Run, text_ids: torch.Tensor, args: argparse.Namespace, metered: bool) -> None:
    device = next(model.parameters()).device
    ids, mask = _prompts(text_ids, args.prompt_tokens, args.spread, run.batch)
    run.prompt_lengths = mask.sum(dim=1).tolist()
    run.mask = mask.to(device)
    run.cache = run.config.new_cache(model)
    meter = PeakMeter(run.cache) if metered else None
    _sync(device)
    started = time.perf_counter()
    run.next_token = _forward(model, run, ids.to(device))
    _sync(device)
    run.prefill_s = time.perf_counter() - started
    if meter is not None:
        run.peak_bytes = meter.stop()


@torch.inference_mode()
def _decode(model: Any, run: Run, steps: int, metered: bool = False) -> None:
    device = run.mask.device
    run.config.use(model)
    meter = PeakMeter(run.cache) if metered else None
    ones = torch.ones(run.batch, 1, dtype=run.mask.dtype, device=device)
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        run.mask = torch.cat([run.mask, ones], dim=1)
        run.next_token = _forward(model, run, run.next_token)
    _sync(device)
    elapsed = time.perf_counter() - started
    if meter is not None:
        run.peak_bytes = max(run.peak_bytes, meter.stop())
    run.decode_s += elapsed
    run.steps += steps
    run.round_rates.append(run.batch * steps / elapsed)


def rows_holding_budget(run: Run, new_tokens: int) -> tuple[int, int] | None:
    """(rows whose every layer and KV head holds that row's own budget, rows); None for unbounded caches."""
    cache = run.cache
    if run.config.session is None or not any(layer.budgets.any_limited for layer in cache.layers):
        return None
    seen = torch.tensor(run.prompt_lengths, device=run.mask.device) + new_tokens
    ok = torch.ones(run.batch, dtype=torch.bool, device=run.mask.device)
    for layer in cache.layers:
        kept = layer.valid.sum(dim=2)
        budget = torch.where(layer.budgets.limited_cells.to(kept.device), layer.budgets.limits, seen[:, None])
        expected = torch.minimum(budget, seen[:, None])
        good = kept <= expected if layer.drops_early else kept == expected
        ok &= good.all(dim=1)
    return int(ok.sum()), run.batch


# --- throughput under a cap --------------------------------------------------------------------------------
def _sizes(largest: int) -> list[int]:
    return sorted({size for size in (1, largest // 4, largest // 2, largest) if size >= 1})


def run_throughput(model: Any, configs: list[Config], text_ids: torch.Tensor, args: argparse.Namespace, log) -> list[dict]:
    cap = parse_bytes(args.kv_memory)
    per_sequence: dict[str, int] = {}
    largest: dict[str, int] = {}
    for config in configs:
        probe = Run(config, 1)
        args_one = argparse.Namespace(**{**vars(args), "spread": 0.0})
        _prefill(model, probe, text_ids, args_one, metered=True)
        _decode(model, probe, args.new_tokens, metered=True)
        per_sequence[config.label] = probe.peak_bytes
        largest[config.label] = min(args.max_batch, cap // max(1, probe.peak_bytes))
        log(f"{config.label:<12} {probe.peak_bytes / 2**20:8.1f} MiB per sequence -> batch {largest[config.label]} "
            f"under {args.kv_memory}")
        del probe

    # confirm the largest batch by running it with the meter on; shrink while it does not fit
    confirmed: dict[str, Run] = {}
    for config in configs:
        batch = largest[config.label]
        while batch >= 1:
            run = Run(config, batch)
            _prefill(model, run, text_ids, args, metered=True)
            _decode(model, run, 1, metered=True)
            if run.peak_bytes <= cap:
                confirmed[config.label] = run
                break
            log(f"{config.label}: batch {batch} peaked at {run.peak_bytes / 2**20:.1f} MiB, over the cap; trying {batch - 1}")
            batch -= 1
        largest[config.label] = batch

    results = []
    levels = max(len(_sizes(b)) for b in largest.values() if b >= 1) if any(largest.values()) else 0
    for level in range(levels):
        runs = []
        for config in configs:
            sizes = _sizes(largest[config.label]) if largest[config.label] >= 1 else []
            if level >= len(sizes):
                continue
            if sizes[level] == largest[config.label] and config.label in confirmed:
                run = confirmed.pop(config.label)  # prefilled and one step decoded already
                run.round_rates = []
            else:
                run = Run(config, sizes[level])
                _prefill(model, run, text_ids, args, metered=False)
                _decode(model, run, 1)
                run.round_rates = []
            runs.append(run)
        remaining = args.new_tokens - 1
        rounds = max(1, min(args.repeats, remaining))
        for index in range(rounds):
            steps = remaining // rounds + (1 if index < remaining % rounds else 0)
            for run in runs:
                if steps:
                    _decode(model, run, steps)
        for run in runs:
            results.append(_throughput_row(run, args, cap, per_sequence, largest))
            run.cache = None
    model.set_attn_implementation("sdpa")
    _add_ratios(results)
    return results


def _throughput_row(run: Run, args: argparse.Namespace, cap: int, per_sequence: dict, largest: dict) -> dict:
    label = run.config.label
    held = rows_holding_budget(run, args.new_tokens) if run.batch == largest[label] else None
    generated = run.batch * args.new_tokens
    return {
        "mode": "throughput", "config": label, "budget": run.config.budget, "batch": run.batch,
        "max_batch": largest[label], "at_cap": run.batch == largest[label],
        "bytes_per_sequence": per_sequence[label], "peak_bytes": run.peak_bytes or None, "cap_bytes": cap,
        "final_bytes": cache_bytes(run.cache), "prompt_tokens": args.prompt_tokens, "spread": args.spread,
        "new_tokens": args.new_tokens, "prefill_s": run.prefill_s,
        "prefill_tok_s": sum(run.prompt_lengths) / run.prefill_s,
        "decode_tok_s": statistics.median(run.round_rates), "decode_tok_s_rounds": run.round_rates,
        "end_to_end_tok_s": generated / (run.prefill_s + run.decode_s),
        "rows_holding_budget": None if held is None else f"{held[0]}/{held[1]}",
        "threads": torch.get_num_threads(),
    }


def _add_ratios(results: list[dict]) -> None:
    plain = next((r for r in results if r["config"] == PLAIN and r["at_cap"]), None)
    for row in results:
        if plain is not None and row["at_cap"]:
            row["decode_vs_plain"] = row["decode_tok_s"] / plain["decode_tok_s"]
            row["end_to_end_vs_plain"] = row["end_to_end_tok_s"] / plain["end_to_end_tok_s"]

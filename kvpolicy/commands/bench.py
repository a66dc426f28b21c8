"""``kvpolicy bench``: throughput under a KV memory cap, and memory over a long stream.

Throughput (``--kv-memory``). A smaller cache lets a bigger batch fit in the same memory,
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

Long stream (``--stream-tokens``). Text is fed through one bounded cache in chunks of
``--stream-chunk`` tokens; every ``--every`` tokens the live and allocated KV bytes and the
process's resident memory are recorded. After warm-up the allocated bytes must stay flat.

Output: a terminal table, ``bench.jsonl``, and PNG plots in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import KVPolicyError
from ..plan import Budget
from ..recipe import load_recipe, with_budget
from .common import parse_budget, pyplot, quiet_torch, read_text, require

PLAIN = "plain"
DEFAULT_RECIPES = ["full", "h2o", "streaming"]
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(text: str) -> int:
    """'512MiB' -> 536870912; units B, KB/KiB, MB/MiB, GB/GiB (case-insensitive)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise KVPolicyError(f"memory size {text!r}: write a number and a unit, e.g. 512MiB, 2GiB or 800MB")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise KVPolicyError(f"memory size {text!r} must be above zero")
    return size


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2", help="model alias or local Hugging Face folder (default: smollm2)")
    add("--recipes", nargs="+", default=None, metavar="RECIPE",
        help=f"recipes to measure under the cap; plain transformers is always the baseline "
             f"(default: {' '.join(DEFAULT_RECIPES)})")
    add("--recipe", help="the recipe of a --stream-tokens run (default: h2o)")
    add("--budget", help="override every recipe's budget: a ratio (0.2) or tokens (512)")
    add("--kv-memory", default="512MiB", help="KV cache memory cap, e.g. 512MiB or 2GiB (default: 512MiB)")
    add("--prompt-tokens", type=int, default=2048, help="longest prompt of a batch (default: 2048)")
    add("--spread", type=float, default=0.25,
        help="prompts of a batch run from (1 - spread) x --prompt-tokens up to it, left-padded (default: 0.25)")
    add("--new-tokens", type=int, default=128, help="tokens generated per sequence (default: 128)")
    add("--max-batch", type=int, default=64, help="never run batches larger than this (default: 64)")
    add("--repeats", type=int, default=4, help="decode rounds per configuration; medians reported (default: 4)")
    add("--stream-tokens", type=int, help="run the long-stream memory check over this many tokens instead")
    add("--stream-budget", type=int, default=1024,
        help="budget in tokens of a stream whose recipe has a ratio budget (default: 1024)")
    add("--stream-chunk", type=int, default=16, help="tokens per forward pass of the stream (default: 16)")
    add("--every", type=int, default=256, help="record memory every this many streamed tokens (default: 256)")
    add("--device", default="cpu", help="cpu or cuda (default: cpu)")
    add("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    add("--threads", type=int, default=None,
        help="torch threads, fixed for the run and printed (default: all cores on CPU)")
    add("--text-file", help="text to take prompts from (default: the pydoc topics that ship with CPython)")
    add("--out", help="output folder (default: runs/bench-<timestamp>)")


# --- measuring a cache -------------------------------------------------------------------------------
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


def _configs(model: Any, names: list[str], budget: str | None) -> list[Config]:
    from ..hf.session import attach

    configs = [Config(PLAIN)]
    previous = model.config._attn_implementation
    for name in dict.fromkeys(names):
        recipe = load_recipe(name)
        if budget:
            recipe = with_budget(recipe, parse_budget(budget))
        session = attach(model, recipe)
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


# --- long stream ------------------------------------------------------------------------------------------
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


# --- output ---------------------------------------------------------------------------------------------
def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def throughput_table(results: list[dict], title: str) -> Any:
    table = require("rich.table").Table(title=title)
    for name in ("config", "budget", "batch", "MiB/seq", "peak MiB", "decode tok/s", "x", "e2e tok/s", "x",
                 "prefill tok/s", "rows at budget"):
        table.add_column(name, justify="left" if name in ("config", "budget") else "right")
    for row in results:
        if not row["at_cap"]:
            continue
        table.add_row(
            row["config"], row["budget"], str(row["batch"]), _mib(row["bytes_per_sequence"]), _mib(row["peak_bytes"]),
            f"{row['decode_tok_s']:.1f}", f"{row.get('decode_vs_plain', float('nan')):.2f}",
            f"{row['end_to_end_tok_s']:.1f}", f"{row.get('end_to_end_vs_plain', float('nan')):.2f}",
            f"{row['prefill_tok_s']:.0f}", row["rows_holding_budget"] or "-",
        )
    return table


def stream_table(results: list[dict], title: str) -> Any:
    table = require("rich.table").Table(title=title)
    for name in ("tokens", "live KV MiB", "allocated KV MiB", "metadata MiB", "RSS MiB"):
        table.add_column(name, justify="right")
    for row in results:
        if row["mode"] == "stream":
            table.add_row(str(row["tokens"]), _mib(row["live_bytes"]), _mib(row["allocated_bytes"]),
                          _mib(row["metadata_bytes"]), _mib(row["rss_bytes"]))
    return table


def plot_throughput(results: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label in dict.fromkeys(r["config"] for r in results):
        rows = sorted((r for r in results if r["config"] == label), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in rows], [r["decode_tok_s"] for r in rows], marker="o", label=label)
        cap_row = rows[-1]
        ax.annotate(f"cap: {cap_row['batch']}", (cap_row["batch"], cap_row["decode_tok_s"]), fontsize=8,
                    textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("batch size (largest point: the most that fits the KV cap)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"decode throughput vs batch, KV cap {_mib(results[0]['cap_bytes'])} MiB")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_stream(results: list[dict], path: Path) -> Path:
    plt = pyplot()
    samples = [r for r in results if r["mode"] == "stream"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    tokens = [s["tokens"] for s in samples]
    ax.plot(tokens, [s["allocated_bytes"] / 2**20 for s in samples], label="allocated KV")
    ax.plot(tokens, [s["live_bytes"] / 2**20 for s in samples], linestyle="--", label="live KV")
    ax.set_xlabel("tokens streamed")
    ax.set_ylabel("KV MiB")
    if all(s["rss_bytes"] is not None for s in samples):
        rss_ax = ax.twinx()
        rss_ax.plot(tokens, [s["rss_bytes"] / 2**20 for s in samples], color="grey", alpha=0.6, label="process RSS")
        rss_ax.set_ylabel("process RSS MiB")
        rss_ax.legend(loc="lower right")
    ax.set_title(f"memory over a long stream: {samples[0]['config']} ({samples[0]['budget']})")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- entry point -----------------------------------------------------------------------------------------
def _check(args: argparse.Namespace) -> None:
    for flag, value in (("--prompt-tokens", args.prompt_tokens), ("--new-tokens", args.new_tokens),
                        ("--max-batch", args.max_batch), ("--repeats", args.repeats), ("--every", args.every),
                        ("--stream-chunk", args.stream_chunk), ("--stream-budget", args.stream_budget)):
        if value < 1:
            raise KVPolicyError(f"{flag} {value}: must be at least 1")
    if not 0 <= args.spread < 1:
        raise KVPolicyError(f"--spread {args.spread}: must be in [0, 1)")
    if args.stream_tokens is not None and args.stream_tokens < 1:
        raise KVPolicyError(f"--stream-tokens {args.stream_tokens}: must be at least 1")
    if args.stream_tokens is None and args.recipe:
        raise KVPolicyError("--recipe names the recipe of a --stream-tokens run; for throughput use --recipes")
    parse_bytes(args.kv_memory)
    if args.threads is not None and args.threads < 1:
        raise KVPolicyError(f"--threads {args.threads}: must be at least 1")


def run_bench(args: argparse.Namespace) -> list[dict]:
    from ..hf.models import load_model

    _check(args)
    Console = require("rich.console").Console
    require("matplotlib")  # for the plots: a missing one fails now, not after the run
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise KVPolicyError(f"--device {args.device}: no CUDA device is visible; use --device cpu")
    console = Console(width=max(132, Console().width))
    out = Path(args.out) if args.out else Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    threads = args.threads or torch.get_num_threads()
    with quiet_torch(threads):
        model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
        text, source = read_text(args.text_file)
        text_ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
        head = (f"kvpolicy bench: model {args.model} ({args.dtype}, {args.device}), torch threads {torch.get_num_threads()}, "
                f"text {source} ({text_ids.numel()} tokens)")
        console.print(head)
        if args.stream_tokens:
            results = run_stream(model, text_ids, args, console.print)
            title = f"long stream: {args.stream_tokens} tokens in chunks of {args.stream_chunk}"
            console.print(stream_table(results, title))
            summary = results[-1]
            if "flat" in summary:
                console.print(
                    f"after warm-up ({summary['samples_after_warmup']} samples): allocated KV "
                    f"{_mib(summary['allocated_min'])}-{_mib(summary['allocated_max'])} MiB "
                    f"(spread {100 * summary['allocated_spread']:.2f}%), allocated {100 * summary['allocated_over_budget']:+.2f}% "
                    f"and live {100 * summary['live_over_budget']:+.2f}% of the budget's bytes; "
                    f"RSS growth {_mib(summary.get('rss_growth_bytes'))} MiB; flat: {summary['flat']}"
                )
            else:
                console.print("the stream never reached its budget: feed more tokens (--stream-tokens)")
            plots = [plot_stream(results, out / "stream-memory.png")]
        else:
            configs = _configs(model, args.recipes or DEFAULT_RECIPES, args.budget)
            results = run_throughput(model, configs, text_ids, args, console.print)
            title = (f"throughput under a {args.kv_memory} KV cap: prompts {args.prompt_tokens} tokens "
                     f"(spread {args.spread:g}), {args.new_tokens} new tokens, {torch.get_num_threads()} threads")
            console.print(throughput_table(results, title))
            plots = [plot_throughput(results, out / "throughput-vs-batch.png")]
    meta = {"command": "kvpolicy bench", "args": {k: v for k, v in vars(args).items() if k != "func"},
            "torch": torch.__version__, "threads": threads}
    with open(out / "bench.jsonl", "w", encoding="utf-8") as handle:
        for row in results:
            handle.write(json.dumps({**row, "meta": meta}) + "\n")
    console.print(f"results: {out / 'bench.jsonl'}; plots: {', '.join(str(p) for p in plots)}")
    return results

"""``kvpolicy bench``: throughput under a KV memory cap (`bench_cap`), and memory over a long stream
(`bench_stream`), both measured with `bench_meter`.

This module is the command: its arguments, the run, and the output: a terminal table, ``bench.jsonl``,
and PNG plots in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import KVPolicyError
from .bench_cap import attach_configs, parse_bytes, run_throughput
from .bench_stream import run_stream
from .common import add_device_arguments, pyplot, quiet_torch, read_text, require, torch_dtype
from .output_files import OutputLock, write_atomically

DEFAULT_RECIPES = ["full", "h2o", "streaming"]


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2", help="model alias, local Hugging Face folder or Hub id (default: smollm2)")
    add("--recipes", nargs="+", default=None, metavar="RECIPE",
        help=f"recipes to measure under the cap; plain transformers is always the baseline "
             f"(default: {' '.join(DEFAULT_RECIPES)})")
    add("--recipe", help="the recipe of a --stream-tokens run (default: h2o)")
    add("--budget", help="override every recipe's budget: a ratio (0.2) or tokens (512)")
    add("--kv-memory", default=None,
        help="KV cache memory cap, e.g. 512MiB or 2GiB (default: 512MiB; with --engine vllm: 2.5 full-cache requests)")
    add("--prompt-tokens", type=int, default=2048, help="longest prompt of a batch (default: 2048)")
    add("--spread", type=float, default=0.25,
        help="prompts of a batch run from (1 - spread) x --prompt-tokens up to it, left-padded (default: 0.25)")
    add("--new-tokens", type=int, default=128, help="tokens generated per sequence (default: 128)")
    add("--max-batch", type=int, default=None,
        help="never run batches larger than this (default: 64); with --engine vllm, the requests arriving together "
             "(default: 8)")
    add("--repeats", type=int, default=4, help="decode rounds per configuration; medians reported (default: 4)")
    add("--stream-tokens", type=int, help="run the long-stream memory check over this many tokens instead")
    add("--stream-budget", type=int, default=1024,
        help="budget in tokens of a stream whose recipe has a ratio budget (default: 1024)")
    add("--stream-chunk", type=int, default=16, help="tokens per forward pass of the stream (default: 16)")
    add("--every", type=int, default=256, help="record memory every this many streamed tokens (default: 256)")
    add_device_arguments(parser)
    add("--threads", type=int, default=None,
        help="torch threads, fixed for the run and printed (default: all cores on CPU)")
    add("--text-file", help="text to take prompts from (default: the pydoc topics that ship with CPython)")
    add("--out", help="output folder (default: runs/bench-<timestamp>)")
    add("--engine", choices=["transformers", "vllm"], default="transformers",
        help="transformers (default), or vllm: requests served by vLLM under a fixed KV memory, full cache vs "
             "recipes (runs in the vLLM environment: docs/vllm.md)")
    add("--vllm-python", help="the vLLM environment's Python (default: $KVPOLICY_VLLM_PYTHON or .venv-vllm/bin/python)")
    add("--prefill-chunk", type=int, default=None,
        help="with --engine vllm: tokens per engine step (vLLM's max_num_batched_tokens), so long prompts come in chunks")
    add("--evict-during-prefill", action="store_true",
        help="with --engine vllm: recipes evict between a prompt's chunks (docs/vllm.md, evict_during_prefill)")
    add("--tensor-parallel-size", type=int, default=None,
        help="with --engine vllm: ranks that split the model's KV heads (vLLM's tensor_parallel_size)")
    add("--compiled", action="store_true",
        help="with --engine vllm: vLLM's compiled mode, as it serves by default (default here: eager; compiling "
             "takes ~100 s per engine on a 2-core CPU)")
    add("--shared-prefix-tokens", type=int, default=None,
        help="with --engine vllm: every prompt starts with the same this many tokens (a shared system prompt)")
    add("--prefix-caching", action="store_true",
        help="with --engine vllm: vLLM's prefix caching on for every configuration (docs/vllm.md, Prefix caching)")
    add("--preemption", nargs="+", choices=["never", "recompute"], default=None,
        help="with --engine vllm: the recipes' admission (docs/vllm.md): never (default: no request is ever "
             "preempted, so no answer depends on load), recompute (vLLM's own, as the full cache runs), or both")


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
    args.max_batch_given = args.max_batch is not None
    if args.max_batch is None:
        args.max_batch = 64
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
    if args.engine != "vllm" and (args.prefill_chunk is not None or args.evict_during_prefill
                                  or args.tensor_parallel_size is not None or args.compiled
                                  or args.preemption is not None or args.shared_prefix_tokens is not None
                                  or args.prefix_caching):
        raise KVPolicyError("--prefill-chunk, --evict-during-prefill, --tensor-parallel-size, --compiled, "
                            "--preemption, --shared-prefix-tokens and --prefix-caching are options of --engine vllm")
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        raise KVPolicyError(f"--tensor-parallel-size {args.tensor_parallel_size}: must be at least 1")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise KVPolicyError(f"--prefill-chunk {args.prefill_chunk}: must be at least 1")
    if args.engine == "transformers" and args.kv_memory is None:
        args.kv_memory = "512MiB"
    if args.kv_memory is not None:
        parse_bytes(args.kv_memory)
    if args.threads is not None and args.threads < 1:
        raise KVPolicyError(f"--threads {args.threads}: must be at least 1")


def run_bench(args: argparse.Namespace) -> list[dict]:
    from ..hf.models import load_model

    _check(args)
    if args.engine == "vllm":
        from .bench_vllm import run_vllm_bench

        code = run_vllm_bench(args)
        if code:
            raise KVPolicyError(f"the vLLM benchmark stopped with exit code {code} (its output is above)")
        return []
    Console = require("rich.console").Console
    require("matplotlib")  # for the plots: a missing one fails now, not after the run
    console = Console(width=max(132, Console().width))
    out = Path(args.out) if args.out else Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    threads = args.threads or torch.get_num_threads()
    with OutputLock(out, "kvpolicy bench"), quiet_torch(threads):
        model, tokenizer = load_model(args.model, dtype=torch_dtype(args.dtype), device=args.device)
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
            configs = attach_configs(model, args.recipes or DEFAULT_RECIPES, args.budget, tokenizer)
            results = run_throughput(model, configs, text_ids, args, console.print)
            title = (f"throughput under a {args.kv_memory} KV cap: prompts {args.prompt_tokens} tokens "
                     f"(spread {args.spread:g}), {args.new_tokens} new tokens, {torch.get_num_threads()} threads")
            console.print(throughput_table(results, title))
            plots = [plot_throughput(results, out / "throughput-vs-batch.png")]
        meta = {"command": "kvpolicy bench", "args": {k: v for k, v in vars(args).items() if k != "func"},
                "torch": torch.__version__, "threads": threads}
        write_atomically(out / "bench.jsonl", "".join(json.dumps({**row, "meta": meta}) + "\n" for row in results))
    console.print(f"results: {out / 'bench.jsonl'}; plots: {', '.join(str(p) for p in plots)}")
    return results

"""``kvpolicy compare``: sweep recipes x budgets x tasks; results file, CSV, plots and a terminal table.

The model loads once; the full-cache baseline is always part of the sweep (once, not
per budget); tasks that can run rows as the rows of one batch do (see `kvpolicy.tasks`),
the rows whose caches grow without bound (the baseline) in a batch apart from those that
stay within a budget (`_storage_groups`). Each finished task appends its rows to ``results.jsonl`` at once, so
an interrupted sweep resumes where it stopped: rows already there (same task, recipe,
budget, model, text and task settings) are skipped unless ``--force``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..errors import KVPolicyError, did_you_mean
from ..recipe import load_recipe, with_budget
from ..recipe.budget import Budget, parse_budget
from ..registry import describe_failure, get_registry
from .common import (
    THREADS,
    add_device_arguments,
    count,
    quiet_torch,
    read_text,
    require,
    torch_dtype,
)
from .compare_report import MEMORY_SUFFIX, plot_sweep, table
from .output_files import OutputLock, load_results, write_csv, write_jsonl

if TYPE_CHECKING:  # the tasks import transformers: loaded when a sweep runs, so that bad input fails fast
    from ..tasks import Context, Row, Task

DEFAULT_RECIPES = ["full", "window", "streaming", "h2o"]
DEFAULT_BUDGETS = ["0.1", "0.2", "0.5"]
DEFAULT_TASKS = ["ppl", "memory", "speed", "passkey", "fidelity"]
MIN_TOKENS = 16


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default="smollm2", help="model alias, local Hugging Face folder or Hub id (default: smollm2)")
    add("--recipes", nargs="+", default=DEFAULT_RECIPES, metavar="RECIPE",
        help="built-in recipe names or YAML files; the full cache is always added as the baseline; hf-hqq-4bit, "
             "hf-quanto-2bit, hf-fp8, ...: transformers' own QuantizedCache as a baseline row "
             f"(docs/compare.md) (default: {' '.join(DEFAULT_RECIPES)})")
    add("--budgets", nargs="+", default=DEFAULT_BUDGETS, metavar="BUDGET",
        help="ratios (0.2 = 20%% of the prompt, or of the evaluated tokens for ppl) or token counts (512) "
             f"(default: {' '.join(DEFAULT_BUDGETS)})")
    add("--budget-unit", choices=BUDGET_UNITS, default="tokens",
        help="tokens: --budgets count tokens kept (ratios or counts); memory: each budget is a share of the bytes a "
             "16-bit cache of the same tokens takes, so every recipe runs at equal bytes (eviction-only recipes keep "
             "what fits at 16 bits; recipes with precision tiers spend it over their tiers) (default: tokens)")
    add("--tasks", nargs="+", metavar="TASK",
        help=f"tasks to run, see kvpolicy/tasks (default: {' '.join(DEFAULT_TASKS)}; none with --suite)")
    add("--suite", choices=SUITE_NAMES, metavar="SUITE",
        help="a set of tasks: ruler-small (5 RULER-style needle and aggregation tasks: minutes at 1K tokens) or "
             "ruler (all 11); with --tasks, both")
    add("--text-file", help="evaluation text (default: the pydoc topics that ship with CPython)")
    add("--tokens", type=count(MIN_TOKENS), default=768,
        help="evaluation length: tokens scored by ppl; prompt length of memory and speed (default: 768)")
    add("--prompt-tokens", type=count(MIN_TOKENS), nargs="+", default=[400], metavar="TOKENS",
        help="prompt lengths of passkey, fidelity and the RULER tasks; each runs once per length (default: 400)")
    add("--question", nargs="+", choices=QUESTION_TRACKS, default=["in-prompt"], metavar="TRACK",
        help="where passkey's and the RULER tasks' question goes: in-prompt (inside the prompt that is compressed) "
             "and/or after (kvpress's protocol: the context is read and compressed first, then the question is asked "
             "and answered from the compressed cache, its tokens and the answer's kept whole); with both, each task "
             "runs once per track (default: in-prompt)")
    add("--new-tokens", type=count(1, 100_000), default=32, metavar="TOKENS",
        help="tokens fidelity generates and scores after each prompt, e.g. 1000 for a long generation (default: 32)")
    add("--trials", type=count(1, 10_000), default=1,
        help="passkey prompts per depth (5 depths); fidelity uses 2 prompts, a RULER task 5 samples per trial (default: 1)")
    add("--ppl-mode", choices=["token", "chunked"], default="token",
        help="token: one token per forward, as the StreamingLLM/H2O papers; chunked: 64 at a time, faster")
    add("--threads", type=THREADS, default=1,
        help="torch threads (default: 1, steady even when another process is busy; try 2 on an idle 2-core machine)")
    add("--seed", type=count(0, 2**63 - 1), default=0, help="seed for passkey keys and fidelity prompts (default: 0)")
    add("--out", help="output folder (default: runs/compare-<timestamp>)")
    add("--force", action="store_true", help="recompute rows already in the output folder's results.jsonl")
    add("--json", action="store_true", help="print the results as JSON to stdout (the table goes to stderr)")
    add_device_arguments(parser)


# --- inputs ------------------------------------------------------------------------------------------


SUITE_NAMES = ("ruler-small", "ruler")  # kvpolicy.tasks.ruler.SUITES (which imports transformers) holds their tasks
QUESTION_TRACKS = ("in-prompt", "after")  # kvpolicy.tasks.lengths.QUESTION_TRACKS, named here for the same reason


def _suites() -> dict[str, list[str]]:
    from ..tasks.ruler import SUITES

    return SUITES


def _task_names(args: argparse.Namespace) -> list[str]:
    """--tasks, the --suite's tasks, or both; the default tasks when neither is given."""
    if args.suite is None:
        return args.tasks or DEFAULT_TASKS
    return [*(args.tasks or []), *_suites()[args.suite]]


def _tasks(names: list[str], lengths: list[int], questions: list[str] | None = None) -> list[Task]:
    from ..tasks import available_tasks
    from ..tasks.lengths import at_lengths

    tasks = available_tasks()
    for name in names:
        if name not in tasks:
            broken = get_registry().broken
            failed = f". Plugins that failed to load: {broken}" if broken else ""
            raise KVPolicyError(
                f"unknown task {name!r}{did_you_mean(name, tasks)}. Available: {', '.join(tasks)}{failed}"
            )
    return at_lengths([tasks[name] for name in dict.fromkeys(names)], lengths, tuple(questions or ["in-prompt"]))


BUDGET_UNITS = ("tokens", "memory")


def _budgets(texts: list[str], unit: str = "tokens") -> list[tuple[str, Any]]:
    """(label, Budget) per --budgets value: "0.2" (a ratio), "512" (tokens), "0.2 mem" (a share of 16-bit bytes)."""
    budgets: dict[str, Any] = {}
    for text in texts:
        budget = parse_budget(text)
        if unit == "memory":
            if budget.ratio is None:
                raise KVPolicyError(f"--budget-unit memory takes shares of a 16-bit cache's bytes in (0, 1], e.g. "
                                    f"0.1 0.2 0.3; got {text!r}")
            budget = Budget(memory=budget.ratio)
        label = f"{budget.memory:g}{MEMORY_SUFFIX}" if budget.memory is not None else (
            f"{budget.ratio:g}" if budget.ratio is not None else str(budget.tokens))
        budgets.setdefault(label, budget)
    return list(budgets.items())


def _recipes(sources: list[str]) -> list[tuple[str, Any]]:
    recipes: dict[str, Any] = {}
    for source in ["full", *sources]:
        if source.startswith("hf-") and not Path(source).exists():  # transformers' QuantizedCache, not a recipe
            from ..tasks.quantized_baseline import parse_baseline

            recipes.setdefault(source, parse_baseline(source))
            continue
        recipe = load_recipe(source)
        label = recipe.name if recipe.name not in recipes else source  # two recipes with one name: use the path
        recipes.setdefault(label, recipe)
    return list(recipes.items())


def _out_dir(path: str | None) -> Path:
    """The output folder, created (it holds the lock of the run)."""
    out = Path(path) if path else Path("runs") / time.strftime("compare-%Y%m%d-%H%M%S")
    if out.exists() and not out.is_dir():
        raise KVPolicyError(f"--out {str(out)!r} is an existing file, not a folder: choose another path")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KVPolicyError(f"cannot create --out {str(out)!r}: {error.strerror or error}; choose another path") \
            from None
    return out


def _rows(model: Any, recipes: list[tuple[str, Any]], budgets: list[tuple[str, Any]]) -> list[Row]:
    """The full baseline once, then every recipe that takes a budget at every budget (the others once)."""
    from ..hf.session import model_shape
    from ..tasks import Row

    layers, heads = model_shape(model)
    rows = []
    for label, recipe in recipes:
        if hasattr(recipe, "open_session"):  # transformers' QuantizedCache: keeps every token, runs once
            rows.append(Row(label, None, recipe))
            continue
        plan = with_budget(recipe, budgets[0][1]).resolve(layers, heads)
        if not any(head.budget.is_limited for layer in plan.layers for head in layer.heads):
            # no budget to sweep: once; policies that size heads themselves (FastGen) still evict
            own = any(head.budget.by_policy for layer in plan.layers for head in layer.heads)
            tiered = any(head.budget.tiered for layer in plan.layers for head in layer.heads)
            rows.append(Row(label, None, recipe, evicts=own, quantized=tiered))
            continue
        rows.extend(Row(label, text, with_budget(recipe, budget), budget) for text, budget in budgets)
    return rows


# --- results file -------------------------------------------------------------------------------------


def _key(task: str, row: Row, fingerprint: str) -> str:
    return f"{task}|{row.recipe}|{row.budget or '-'}|{fingerprint}"


def _fingerprint(model: str, text_sha: str, task: Task, settings: dict[str, Any], row: Row, shape) -> str:
    plan = row.spec.resolve(*shape).describe() if hasattr(row.spec, "resolve") else str(row.spec)
    blob = json.dumps([model, text_sha, task.name, settings, plan], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _versions() -> dict[str, str]:
    import torch
    import transformers

    return {"kvpolicy": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def _model_label(args: argparse.Namespace) -> str:
    """The model as results name it: with its dtype and device when not the default fp32 CPU (so rows of another
    dtype are never taken for these when a sweep resumes)."""
    if args.device == "cpu" and args.dtype == "float32":
        return args.model
    return f"{args.model} ({args.dtype}, {args.device})"


def _command(args: argparse.Namespace, out: Path) -> str:
    parts = ["kvpolicy", "compare", "--model", args.model, "--recipes", *args.recipes, "--budgets", *args.budgets,
             *(["--budget-unit", args.budget_unit] if args.budget_unit != "tokens" else []),
             "--tasks", *_task_names(args), "--tokens", str(args.tokens), "--prompt-tokens", *map(str, args.prompt_tokens),
             *(["--new-tokens", str(args.new_tokens)] if args.new_tokens != 32 else []),
             *(["--question", *args.question] if args.question != ["in-prompt"] else []),
             "--trials", str(args.trials), "--ppl-mode", args.ppl_mode, "--threads", str(args.threads),
             "--seed", str(args.seed), "--out", str(out)]
    if args.text_file:
        parts += ["--text-file", args.text_file]
    if args.device != "cpu" or args.dtype != "float32":
        parts += ["--device", args.device, "--dtype", args.dtype]
    return shlex.join(parts)


# --- the sweep ----------------------------------------------------------------------------------------


def run_compare(args: argparse.Namespace) -> None:
    """The ``compare`` command: check the input, load the model once, run the missing rows, report."""
    for package in ("rich", "matplotlib"):  # the table and the plots: a missing one fails now, not after the sweep
        require(package)
    tasks = _tasks(_task_names(args), args.prompt_tokens, args.question)
    budgets = _budgets(args.budgets, args.budget_unit)
    recipes = _recipes(args.recipes)
    text, text_source = read_text(args.text_file)
    out = _out_dir(args.out)
    with OutputLock(out, "kvpolicy compare"):
        _compare(args, tasks, budgets, recipes, text, text_source, out)


def _compare(args, tasks: list[Task], budgets, recipes, text: str, text_source: str, out: Path) -> None:
    """The sweep proper, with the output folder locked."""
    load_results(out / "results.jsonl")  # a results file that cannot be used fails now, before the model loads
    console = require("rich.console").Console(stderr=args.json, width=None if sys.stdout.isatty() else 132)
    started = time.perf_counter()
    with quiet_torch(args.threads):
        ctx, rows = _load(args, tasks, recipes, budgets, text, text_source)
        console.print(f"[bold]kvpolicy compare[/]: model {args.model}, {len(rows)} rows x {len(tasks)} tasks, "
                      f"text {text_source} ({ctx.text_ids.numel()} tokens), torch threads {args.threads}, out {out}")
        meta = {"model": _model_label(args), "text": text_source, "text_sha": hashlib.sha256(text.encode()).hexdigest()[:16],
                "seed": args.seed, "command": _command(args, out), "versions": _versions(), "threads": args.threads}
        sweep = _sweep(ctx, tasks, rows, out, meta, args.force, console)
    write_csv(out / "results.csv", load_results(out / "results.jsonl"))
    plots = plot_sweep(sweep, tasks, out / "plots")
    console.print(table(sweep, rows, tasks, title=f"{args.model}: {text_source}, seed {args.seed}"))
    console.print(f"results: {out / 'results.jsonl'}, {out / 'results.csv'}; plots: "
                  f"{', '.join(str(p) for p in plots)}; {time.perf_counter() - started:.0f} s")
    if args.json:
        print(json.dumps(sweep, indent=1, default=str))


def _load(args, tasks: list[Task], recipes, budgets, text: str, text_source: str) -> tuple[Context, list[Row]]:
    """Model, tokenized text (checked long enough for the tasks) and the sweep's rows."""
    import torch

    from ..hf.models import load_model
    from ..tasks import Context

    model, tokenizer = load_model(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    text_ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    ctx = Context(model, tokenizer, text_ids, tokens=args.tokens, prompt_tokens=args.prompt_tokens[0], seed=args.seed,
                  new_tokens=args.new_tokens, trials=args.trials, ppl_mode=args.ppl_mode, options={"model_name": args.model}, text=text)
    needed = max(MIN_TOKENS, *(task.tokens_needed(ctx) for task in tasks))
    if text_ids.numel() < needed:
        raise KVPolicyError(
            f"the text ({text_source}) is too short: {text_ids.numel()} tokens, and the tasks need {needed} "
            "(--tokens / --prompt-tokens): give a longer --text-file or smaller sizes"
        )
    return ctx, _rows(model, recipes, budgets)


def _sweep(ctx: Context, tasks: list[Task], rows: list[Row], out: Path, meta: dict[str, Any], force: bool,
           console: Any) -> list[dict[str, Any]]:
    """Run each task on its rows missing from results.jsonl (all with ``force``); return the sweep's results."""
    from ..hf.session import model_shape
    from ..tasks.lengths import task_key
    from ..tasks.progress import Progress

    shape = model_shape(ctx.model)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    existing = load_results(path)
    keys = {task_key(task): [_key(task.name, row, _fingerprint(meta["model"], meta["text_sha"], task,
                                                               task.settings(ctx), row, shape)) for row in rows]
            for task in tasks}
    if force:
        drop = {key for task_keys in keys.values() for key in task_keys}
        existing = [row for row in existing if row["key"] not in drop]
        write_jsonl(path, existing)
    kept = list({row["key"]: row for row in existing}.values())  # one row per key (the last), whatever the file held
    if len(kept) != len(existing):
        write_jsonl(path, kept)
    done = {row["key"]: row for row in kept}
    ctx.progress = Progress(console.file)
    try:
        for task in sorted(tasks, key=lambda t: not getattr(t, "run_first", False)):  # stable: else as given
            name = task_key(task)
            todo = [i for i, key in enumerate(keys[name]) if key not in done]
            if not todo:
                console.print(f"{name}: all {len(rows)} rows already in {path}, skipped")
                continue
            task_started = time.perf_counter()
            for group in _storage_groups(ctx.model, [rows[i] for i in todo]):  # each group's rows saved when done
                batch = [todo[i] for i in group]
                metrics = _run_task(task, ctx, [rows[i] for i in batch])
                fresh = [_result(task, rows[i], keys[name][i], m, ctx, meta) for i, m in zip(batch, metrics, strict=True)]
                done.update((row["key"], row) for row in fresh)
                kept += fresh
                write_jsonl(path, kept)
            console.print(f"{name}: {len(todo)} rows in {time.perf_counter() - task_started:.0f} s "
                          f"({len(rows) - len(todo)} already done)")
    finally:
        ctx.progress = None
    return [done[key] for task in tasks for key in keys[task_key(task)]]


def _storage_groups(model: Any, rows: list[Row]) -> list[list[int]]:
    """Rows whose layers store their tokens alike (the same precision tiers, or none), that probe their prompt alike
    (or not) and whose caches are all bounded (or not), which tasks may batch; a row with a cache of its own
    (transformers' QuantizedCache) alone.

    A batch's storage is as wide as its longest row, and every row's attention, statistics and merges run over that
    width: beside the full cache, rows that keep 400 tokens of 4,000 worked over 4,000 slots at each step late in the
    text (a 4,000-token perplexity sweep of six D2O and H2O rows: 6,352 s with the full cache in the batch, 1,800 s
    with it apart). Rows with a cell whose budget does not bound it (the full baseline, a policy's own budgets)
    therefore run in a batch of their own."""
    from ..hf.session import model_shape

    layers, heads = model_shape(model)
    registry = get_registry()
    groups: dict[tuple, list[int]] = {}
    for index, row in enumerate(rows):
        if hasattr(row.spec, "open_session"):
            groups[("alone", index)] = [index]
            continue
        plan = row.spec.resolve(layers, heads) if hasattr(row.spec, "resolve") else row.spec
        tiers = tuple(h.budget.precision_tiers for layer in plan.layers for h in layer.heads)
        # rows whose policies probe the prompt (KVzip) apart: the others would run the probe's passes for nothing
        probes = any(registry.get(h.policy).probe_needs for layer in plan.layers for h in layer.heads)
        grows = any(not h.budget.is_limited for layer in plan.layers for h in layer.heads)
        groups.setdefault((tiers, probes, grows), []).append(index)
    return list(groups.values())


def _run_task(task: Task, ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
    """``task.run``; a plugin's task that fails (or returns the wrong number of rows) is named in a KVPolicyError."""
    skip = rows[0].spec.skip_reason(task) if hasattr(rows[0].spec, "skip_reason") else None
    if skip is not None:  # a task that needs kvpolicy's cache, on a row of transformers' QuantizedCache
        length = {"length": task.length} if hasattr(task, "length") else {}
        return [{"skipped": skip, **length} for _ in rows]
    module = getattr(type(getattr(task, "task", task)), "__module__", "") or ""  # AtLength: the task it runs
    if module.startswith("kvpolicy."):
        return task.run(ctx, rows)
    try:
        metrics = list(task.run(ctx, rows))
    except (KVPolicyError, MemoryError, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise KVPolicyError(f"task {task.name!r} (from {module}) failed: {describe_failure(exc)}; "
                            "this is a bug in the plugin: fix it, or leave the task out of --tasks") from exc
    if len(metrics) != len(rows) or not all(isinstance(m, dict) for m in metrics):
        raise KVPolicyError(f"task {task.name!r} (from {module}) returned {len(metrics)} results for {len(rows)} rows; "
                            "it must return one dict of metrics per row")
    return metrics


def _result(task: Task, row: Row, key: str, metrics: dict[str, Any], ctx: Context, meta: dict[str, Any]) -> dict:
    value = row.value
    return {
        "task": task.name, "recipe": row.recipe, "budget": row.budget, "evicts": row.evicts or row.budget is not None,
        "budget_ratio": getattr(value, "ratio", None), "budget_tokens": getattr(value, "tokens", None),
        "budget_memory": getattr(value, "memory", None),
        **metrics, "settings": task.settings(ctx), **meta, "key": key,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# --- table and plots ----------------------------------------------------------------------------------

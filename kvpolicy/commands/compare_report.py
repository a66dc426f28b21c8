"""What ``kvpolicy compare`` shows: the terminal table and the plots of a sweep."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import KVPolicyError
from .common import pyplot, require

if TYPE_CHECKING:
    from ..tasks import Row, Task


def _budget_text(row: Row | dict) -> str:
    budget = row["budget"] if isinstance(row, dict) else row.budget
    if budget is None:
        evicts = row.get("evicts", False) if isinstance(row, dict) else row.evicts
        return "per head" if evicts else "all"  # per head: the policy sizes each head itself (FastGen)
    if budget.endswith(MEMORY_SUFFIX):
        return f"{budget_number(budget):.0%} bytes"
    return f"{float(budget):.0%}" if "." in budget else f"{budget} tok"


#: The label of a budget in bytes (``--budget-unit memory``): "0.2 mem", a share of a 16-bit cache's bytes.
MEMORY_SUFFIX = " mem"


def budget_number(label: str) -> float:
    """The number in a budget label: 0.2 for "0.2" and "0.2 mem", 512 for "512"."""
    return float(label.removesuffix(MEMORY_SUFFIX))


def table(sweep: list[dict[str, Any]], rows: list[Row], tasks: list[Task], title: str = ""):
    """A rich Table: one line per recipe x budget, the tasks' columns side by side."""
    Table = require("rich.table").Table

    found = {(r["task"], r.get("length"), r["recipe"], r["budget"]): r for r in sweep}
    out = Table(title=title)
    out.add_column("recipe")
    out.add_column("budget", justify="right")
    for task in tasks:
        for _, header, _ in task.columns:
            out.add_column(header, justify="right")
    for row in rows:
        cells = [row.recipe, _budget_text(row)]
        for task in tasks:
            result = found.get((task.name, getattr(task, "length", None), row.recipe, row.budget), {})
            cells += [fmt.format(result[m]) if result.get(m) is not None else "-" for m, _, fmt in task.columns]
        out.add_row(*cells, end_section=row.is_full)
    return out


def plot_sweep(sweep: list[dict[str, Any]], tasks: list[Task], folder: Path) -> list[Path]:
    """One PNG per figure named in the tasks' ``plots``: each metric vs budget, a line per recipe, full as a line."""
    plt = pyplot()
    figures: dict[str, list[tuple[tuple[str, Any], str, str]]] = {}
    for task in tasks:
        for figure, metric, label in task.plots:
            figures.setdefault(figure, []).append(((task.name, getattr(task, "length", None)), metric, label))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise KVPolicyError(f"cannot create the plots folder {str(folder)!r}: {error.strerror or error}; "
                            "remove what is in the way or choose another --out") from None
    budgets = sorted({r["budget"] for r in sweep if r["budget"] is not None}, key=budget_number)
    memory = all(b.endswith(MEMORY_SUFFIX) for b in budgets)
    ratios = memory or all("." in b for b in budgets)
    tokens = all("." not in b for b in budgets)
    x_of = {b: (budget_number(b) * 100 if ratios else float(b)) if ratios or tokens else i for i, b in enumerate(budgets)}
    own_bytes = own_bytes_of(sweep) if memory else {}
    paths = []
    for figure, panels in figures.items():
        cols = 2 if len(panels) == 4 else min(4 if len(panels) > 9 else 3, len(panels))
        grid = -(-len(panels) // cols)
        fig, axes = plt.subplots(grid, cols, figsize=(4.4 * cols, 3.4 * grid + 0.5), squeeze=False)
        for ax in axes.flat[len(panels):]:
            ax.set_visible(False)
        for ax, (task, metric, label) in zip(axes.flat, panels, strict=False):
            _panel(ax, [r for r in sweep if (r["task"], r.get("length")) == task and r.get(metric) is not None],
                   metric, x_of, own_bytes)
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("budget, % of a 16-bit cache's bytes" if memory else "budget, % of the prompt (ppl: of the text)"
                          if ratios else "budget, tokens" if tokens else "budget")
            if not (ratios or tokens):
                ax.set_xticks(list(x_of.values()), budgets)
        handles, labels = axes[0][0].get_legend_handles_labels()
        # more recipes (baselines, tiers): the legend wraps, the figure grows; one panel is too narrow for 4 columns,
        # and for 2 of long labels ("hf-hqq-4bit (no eviction, 38% bytes)" was cut at both edges)
        widest = max((len(label) for label in labels), default=0)
        ncol = max(1, min(len(labels), 4 if cols > 1 else 2 if widest <= 24 else 1))
        lines = -(-len(labels) // ncol) if labels else 1
        height = 3.4 * grid + 0.25 + 0.25 * lines
        fig.set_size_inches(fig.get_size_inches()[0], height)
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9, frameon=False)
        fig.tight_layout(rect=(0, 0.25 * lines / height, 1, 1))
        path = folder / f"{figure}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


_MARKERS = "os^DvP*X"


def own_bytes_of(sweep: list[dict[str, Any]]) -> dict[str, float]:
    """% of a 16-bit cache's bytes that the memory task measured for each recipe that keeps every token (kivi,
    transformers' QuantizedCache; not full): at equal bytes such a recipe is a point on the budget axis, not a line."""
    return {r["recipe"]: 100 * r["bytes_vs_16bit"] for r in sweep if r["task"] == "memory" and r["budget"] is None
            and r["recipe"] != "full" and r.get("bytes_vs_16bit") is not None}


def _panel(ax: Any, results: list[dict[str, Any]], metric: str, x_of: dict[str, float],
           own_bytes: dict[str, float] | None = None) -> None:
    """One metric vs budget: a line per recipe (markers shrink so that equal lines stay visible), full dashed; a
    recipe in ``own_bytes`` (% of a 16-bit cache's bytes it measured) as one point there."""
    recipes = list(dict.fromkeys(r["recipe"] for r in results))
    values = [r[metric] for r in results]
    drawn = 0
    for recipe in recipes:
        mine = [r for r in results if r["recipe"] == recipe]
        if all(r["budget"] is None for r in mine) and recipe in (own_bytes or {}):
            ax.plot([own_bytes[recipe]], [mine[0][metric]], marker=_MARKERS[drawn % len(_MARKERS)], linestyle="none",
                    markersize=8, color=f"C{drawn}", label=f"{recipe} (no eviction, {own_bytes[recipe]:.0f}% bytes)")
            drawn += 1
            continue
        if all(r["budget"] is None for r in mine):
            own = bool(mine[0].get("evicts"))  # FastGen: evicts by budgets of its own, one figure at every budget
            full = recipe == "full"  # the others that keep every token (kivi, transformers' QuantizedCache): -.
            ax.axhline(mine[0][metric], color="black" if full else f"C{drawn}", linestyle=":" if own else "--" if full
                       else "-.", linewidth=1 if full else 1.5,
                       label=f"{recipe} ({'own budgets' if own else 'no eviction'})")
            drawn += not full
            continue
        points = sorted((x_of[r["budget"]], r[metric]) for r in mine if r["budget"] is not None)
        ax.plot(*zip(*points, strict=True), marker=_MARKERS[drawn % len(_MARKERS)], markersize=max(3, 8 - 1.5 * drawn),
                linewidth=max(1.0, 2.2 - 0.4 * drawn), label=recipe, color=f"C{drawn}")
        drawn += 1
    if metric.endswith("_ratio"):
        ax.axhline(1.0, color="gray", linestyle=":", linewidth=1, label="plain transformers")
    positive = [v for v in values if isinstance(v, (int, float)) and v > 0]
    if metric == "ppl" and positive and max(positive) / min(positive) > 5:
        ax.set_yscale("log")
    elif metric.endswith(("_mib", "_bytes")) or metric in ("accuracy", "greedy_match", "top1", "kl", "score"):
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)

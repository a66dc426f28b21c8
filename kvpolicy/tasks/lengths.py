"""Prompt-length tasks at several lengths: ``--prompt-tokens 1000 2000 4000`` runs each once per length.

A task that reads ``Context.prompt_tokens`` says so with ``uses_prompt_tokens = True``
(passkey, fidelity, the RULER-style tasks); `at_lengths` wraps it once per length in
`AtLength`, which runs it with that length and adds ``length`` to each result. Its
``key`` (``name@length``) tells the lengths apart in the sweep, the table and the plots.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import Context, Row


def length_label(tokens: int) -> str:
    """``1K`` for 1000 or 1024, ``2K``, ``1.5K``, ``400``: short enough for a table header."""
    for unit in (1024, 1000):
        if tokens >= 1000 and tokens % unit == 0:
            return f"{tokens // unit}K"
    return f"{tokens / 1000:g}K" if tokens >= 1000 and tokens % 100 == 0 else str(tokens)


class AtLength:
    """``task`` at one prompt length (``several``: the sweep has more than one, so headers name it)."""

    def __init__(self, task: Any, length: int, several: bool = False):
        self.task, self.length = task, length
        self.name, self.description = task.name, task.description
        self.run_first = getattr(task, "run_first", False)
        suffix = f" {length_label(length)}" if several else ""
        self.columns = [(metric, header + suffix, fmt) for metric, header, fmt in task.columns]
        self.plots = [(figure, metric, label + (f", {length} tokens" if several else ""))
                      for figure, metric, label in task.plots]

    @property
    def key(self) -> str:
        return f"{self.name}@{self.length}"

    def _at(self, ctx: Context) -> Context:
        return dataclasses.replace(ctx, prompt_tokens=self.length)

    def settings(self, ctx: Context) -> dict[str, Any]:
        return self.task.settings(self._at(ctx))

    def tokens_needed(self, ctx: Context) -> int:
        return self.task.tokens_needed(self._at(ctx))

    def run(self, ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
        return [{**metrics, "length": self.length} for metrics in self.task.run(self._at(ctx), rows)]


def at_lengths(tasks: list[Any], lengths: list[int]) -> list[Any]:
    """Every task that uses the prompt length once per length (in the order given); the others once."""
    lengths = list(dict.fromkeys(lengths))
    out: list[Any] = []
    for task in tasks:
        if getattr(task, "uses_prompt_tokens", False):
            out.extend(AtLength(task, length, several=len(lengths) > 1) for length in lengths)
        else:
            out.append(task)
    return out


def task_key(task: Any) -> str:
    """What tells a task apart in a sweep: its name, and its length when it runs at one."""
    return getattr(task, "key", task.name)

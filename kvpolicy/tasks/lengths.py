"""Prompt-length tasks at several lengths: ``--prompt-tokens 1000 2000 4000`` runs each once per length.

A task that reads ``Context.prompt_tokens`` says so with ``uses_prompt_tokens = True``
(passkey, fidelity, the RULER-style tasks); `at_lengths` wraps it once per length in
`AtLength`, which runs it with that length and adds ``length`` to each result. Its
``key`` (``name@length``) tells the lengths apart in the sweep, the table and the plots.

A task that asks a question about its prompt (``asks_question = True``: passkey, the RULER-style
tasks) runs once per question track (``--question in-prompt after``): in the prompt that is
compressed, or after it (`Context.question`). The second track's name ends in ``/after`` and its
headers and plots say "q after", so both stand side by side in one results file.
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


QUESTION_TRACKS = ("in-prompt", "after")


class AtLength:
    """``task`` at one prompt length (``several``: the sweep has more than one, so headers name it), its question
    in the compressed prompt or after it (``question``)."""

    def __init__(self, task: Any, length: int, several: bool = False, question: str = "in-prompt"):
        self.task, self.length, self.question = task, length, question
        after = question == "after"
        self.name, self.description = task.name + ("/after" if after else ""), task.description
        self.run_first = getattr(task, "run_first", False)
        suffix = (f" {length_label(length)}" if several else "") + (" q after" if after else "")
        self.columns = [(metric, header + suffix, fmt) for metric, header, fmt in task.columns]
        self.plots = [(figure, metric, label + (f", {length} tokens" if several else "")
                       + (", question after compression" if after else ""))
                      for figure, metric, label in task.plots]

    @property
    def key(self) -> str:
        return f"{self.name}@{self.length}"

    def _at(self, ctx: Context) -> Context:
        return dataclasses.replace(ctx, prompt_tokens=self.length, question=self.question)

    def settings(self, ctx: Context) -> dict[str, Any]:
        track = {"question": self.question} if self.question != "in-prompt" else {}
        return {**self.task.settings(self._at(ctx)), **track}

    def tokens_needed(self, ctx: Context) -> int:
        return self.task.tokens_needed(self._at(ctx))

    def run(self, ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
        track = {"question": self.question} if getattr(self.task, "asks_question", False) else {}
        return [{**metrics, "length": self.length, **track} for metrics in self.task.run(self._at(ctx), rows)]


def at_lengths(tasks: list[Any], lengths: list[int], questions: tuple[str, ...] = ("in-prompt",)) -> list[Any]:
    """Every task that uses the prompt length once per length (in the order given), and per question track when it
    asks one (``questions``; the others in the prompt only); the other tasks once."""
    lengths, questions = list(dict.fromkeys(lengths)), tuple(dict.fromkeys(questions))
    out: list[Any] = []
    for task in tasks:
        if getattr(task, "uses_prompt_tokens", False):
            tracks = questions if getattr(task, "asks_question", False) else ("in-prompt",)
            out.extend(AtLength(task, length, several=len(lengths) > 1, question=question)
                       for question in tracks for length in lengths)
        else:
            out.append(task)
    return out


def task_key(task: Any) -> str:
    """What tells a task apart in a sweep: its name, and its length when it runs at one."""
    return getattr(task, "key", task.name)

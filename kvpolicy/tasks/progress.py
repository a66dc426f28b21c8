"""Progress of a long task: steps done, rows, tokens/s, time elapsed and left.

On a terminal it is one live line, redrawn at most every ``redraw`` seconds and cleared
when the task ends; when the output is a file or a pipe (a log, ``| tee``), it is one
plain line every ``every`` seconds (a minute by default), so that a long run is never
silent and a log does not fill with redraws. The clock is injectable, so the tests
drive it without sleeping.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Reports every task of a run to ``stream`` (default: stderr); ``live`` defaults to ``stream.isatty()``."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None,
                 clock: Callable[[], float] = time.monotonic, every: float = 60.0, redraw: float = 0.2):
        self.stream = stream if stream is not None else sys.stderr
        self.live = live if live is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.clock, self.every, self.redraw = clock, every, redraw

    def task(self, description: str, total: int, rows: int = 1, unit: str = "steps") -> TaskProgress:
        return TaskProgress(self, description, total, rows, unit)


class TaskProgress:
    """One task's progress: `advance` after each step; `close` (or leaving the ``with`` block) when done."""

    def __init__(self, owner: Progress, description: str, total: int, rows: int, unit: str):
        self.owner, self.description, self.total, self.rows, self.unit = owner, description, max(0, total), rows, unit
        self.done = 0
        self.tokens = 0
        self.started = owner.clock()
        self.last_shown = self.started
        self.width = 0  # characters of the live line now on screen

    def __enter__(self) -> TaskProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advance(self, steps: int = 1, tokens: int = 0) -> None:
        """``steps`` more done, having processed ``tokens`` tokens (all rows of a batch together)."""
        self.done += steps
        self.tokens += tokens
        now = self.owner.clock()
        wait = self.owner.redraw if self.owner.live else self.owner.every
        if now - self.last_shown >= wait or (self.owner.live and self.done >= self.total):
            self.last_shown = now
            self._show(self.line(now))

    def line(self, now: float | None = None) -> str:
        """What the progress says now: ``ppl (17 rows): 512/1500 tokens (34%), 41 tokens/s, 3m12s elapsed, ~6m10s left``."""
        now = self.owner.clock() if now is None else now
        elapsed = max(now - self.started, 1e-9)
        share = self.done / self.total if self.total else 1.0
        parts = [f"{self.done}/{self.total} {self.unit} ({share:.0%})"]
        if self.tokens:
            parts.append(f"{self.tokens / elapsed:,.0f} tokens/s")
        parts.append(f"{duration(elapsed)} elapsed")
        if 0 < self.done < self.total:
            parts.append(f"~{duration(elapsed / self.done * (self.total - self.done))} left")
        rows = f" ({self.rows} rows)" if self.rows > 1 else ""
        return f"{self.description}{rows}: " + ", ".join(parts)

    def _show(self, text: str) -> None:
        stream = self.owner.stream
        if self.owner.live:
            filled = round(BAR_WIDTH * self.done / self.total) if self.total else BAR_WIDTH
            text = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {text}"
            stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
        else:
            stream.write(text + "\n")
        stream.flush()

    def close(self) -> None:
        """Clear the live line (the caller prints its own summary); nothing to do for a file."""
        if self.owner.live and self.width:
            self.owner.stream.write("\r" + " " * self.width + "\r")
            self.owner.stream.flush()
            self.width = 0

"""Layer and KV head selectors of recipe rules: "3", "-1", "0-1", "2-", "0,2,5-7", [0, 2], "all"."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .checks import quote, recipe_error
from .schema import SELECTOR


@dataclass(frozen=True)
class Selector:
    text: str
    spans: tuple[tuple[int, int], ...]  # (first, last); negative counts from the end

    def indices(self, count: int, noun: str, file: str, line: int | None, path: str) -> list[int]:
        out: list[int] = []
        for lo, hi in self.spans:
            a, b = (lo + count if lo < 0 else lo), (hi + count if hi < 0 else hi)
            if not (0 <= a < count and 0 <= b < count):
                raise recipe_error(file, line, path, f"selector {self.text} is out of range: the model has {count} {noun}s "
                                   f"({noun}s 0-{count - 1})", 'Use indices in that range ("-1" is the last one)')
            out.extend(range(a, b + 1))
        return out


def read_selector(value: Any, path: str, file: str, line: int | None) -> Selector:
    items = value if isinstance(value, list) else [value]
    spans: list[tuple[int, int]] = []
    for item in items:
        parts = item.split(",") if isinstance(item, str) else [item]
        for part in parts:
            if isinstance(part, int) and not isinstance(part, bool):
                spans.append((part, part))
                continue
            text = part.strip() if isinstance(part, str) else None
            m = re.fullmatch(r"(\d+)\s*-\s*(\d*)", text or "")
            if text in ("all", "*"):
                spans.append((0, -1))
            elif text and re.fullmatch(r"-?\d+", text):
                spans.append((int(text), int(text)))
            elif m and (not m[2] or int(m[1]) <= int(m[2])):
                spans.append((int(m[1]), int(m[2]) if m[2] else -1))
            else:
                raise recipe_error(file, line, path, f"cannot read selector {quote(part)}", f"Use {SELECTOR}")
    if not spans:
        raise recipe_error(file, line, path, "empty selector", 'Use an index, a range, a list or "all"')
    return Selector(repr(value), tuple(spans))


def spans_text(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    spans: list[list[int]] = []
    for index in indices:
        if spans and index == spans[-1][1] + 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)

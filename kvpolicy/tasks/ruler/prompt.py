"""A RULER-style sample: the prompt the model reads, the items it must answer, and where its needles sit.

A generator drafts a sample for a given haystack size (`Draft`); `fit` finds the largest
haystack whose whole prompt (chat template and answer prefix included) stays within the
target length in tokens, and `finish` tokenizes it and finds every needle's token.

As in RULER, the question comes after the context (inside the user turn), the model's
chat template wraps the task when the tokenizer has one, and the answer prefix ("The
special magic number for ... is") follows the template, so the model's first tokens are
the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Draft:
    """A sample before tokenization. ``task_text`` holds ``context`` verbatim; ``needles``: (sentence, depth)."""

    task_text: str
    context: str
    answer_prefix: str
    answers: list[str]
    needles: list[tuple[str, float]] = field(default_factory=list)
    depth: float | None = None


@dataclass(frozen=True)
class Needle:
    """An inserted sentence: the depth it was asked for (share of the context) and where it landed."""

    text: str
    depth: float
    char_index: int  # in Sample.text
    token_index: int  # in Sample.input_ids: the first token holding text[char_index]


@dataclass(frozen=True)
class Sample:
    task: str
    length: int  # the target length in tokens; len(input_ids) <= length
    index: int
    text: str  # the whole prompt, chat template and answer prefix included
    input_ids: list[int]
    answers: list[str]  # every item the answer must contain
    depth: float | None  # the sample's stated depth (its queried needle); None for the word-counting tasks
    needles: tuple[Needle, ...]
    context_tokens: tuple[int, int]  # [start, end) of the context in input_ids
    max_new_tokens: int

    def token_depth(self, needle: Needle) -> float:
        """Where ``needle`` really sits: its token's share of the way through the context."""
        start, end = self.context_tokens
        return (needle.token_index - start) / max(1, end - start)


def wrap(tokenizer: Any, task_text: str, answer_prefix: str) -> str:
    """The prompt as the model reads it: the chat template around the task (when there is one), then the answer prefix."""
    if getattr(tokenizer, "chat_template", None):
        chat = [{"role": "user", "content": task_text}]
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + answer_prefix
    return task_text + answer_prefix


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def fit(tokenizer: Any, length: int, draft: Callable[[int], Draft], least: int = 1) -> Draft:
    """The draft with the largest haystack size (>= ``least``) whose prompt has at most ``length`` tokens.

    ``draft(size)`` must grow with ``size``. When even ``least`` is too long, that draft is returned
    (the caller checks the length and says what to change).
    """

    def tokens(size: int) -> int:
        made = draft(size)
        return count_tokens(tokenizer, wrap(tokenizer, made.task_text, made.answer_prefix))

    low, high = least, least
    while tokens(high) <= length:  # double until too long
        low, high = high, high * 2
    if low == high:  # `least` itself is too long
        return draft(least)
    while high - low > 1:  # tokens(low) <= length < tokens(high)
        middle = (low + high) // 2
        low, high = (middle, high) if tokens(middle) <= length else (low, middle)
    return draft(low)


def finish(tokenizer: Any, made: Draft, *, task: str, length: int, index: int, max_new_tokens: int) -> Sample:
    """Tokenize a draft and find its context and needles in the tokens."""
    text = wrap(tokenizer, made.task_text, made.answer_prefix)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ends = [end for _, end in encoded["offset_mapping"]]

    def token_at(char: int) -> int:
        return next((i for i, end in enumerate(ends) if end > char), len(ends))

    context_start = text.index(made.context)
    context = (token_at(context_start), token_at(context_start + len(made.context)))
    needles, cursor = [], context_start
    for sentence, depth in sorted(made.needles, key=lambda needle: needle[1]):
        char = text.index(sentence, cursor)
        needles.append(Needle(sentence, depth, char, token_at(char)))
        cursor = char + len(sentence)
    return Sample(task, length, index, text, list(encoded["input_ids"]), list(made.answers), made.depth,
                  tuple(needles), context, max_new_tokens)


def insert_at_depths(units: list[str], needles: list[tuple[str, float]], separator: str) -> str:
    """``units`` (sentences or lines) joined by ``separator``, each needle at the boundary between units where
    the share ``depth`` of the units' characters lies behind it (RULER counts units instead: with sentences of
    very different lengths, as in code documentation, that puts a needle far from its depth)."""
    total = sum(len(unit) for unit in units)
    behind, boundaries = 0, []  # characters before each boundary 0..len(units)
    for unit in units:
        boundaries.append(behind)
        behind += len(unit)
    boundaries.append(behind)
    slots: dict[int, list[str]] = {}
    for sentence, depth in sorted(needles, key=lambda needle: needle[1]):
        target = depth * total
        position = min(range(len(boundaries)), key=lambda i: abs(boundaries[i] - target))
        slots.setdefault(position, []).append(sentence)
    parts: list[str] = []
    for position in range(len(units) + 1):
        parts.extend(slots.get(position, ()))
        if position < len(units):
            parts.append(units[position])
    return separator.join(parts)


def join_items(items: list[str]) -> str:
    """'a', 'a and b', 'a, b, and c': how a question names several keys."""
    if len(items) <= 1:
        return "".join(items)
    if len(items) == 2:
        return f"{items[0]} and {items[1]}"
    return ", ".join(items[:-1]) + ", and " + items[-1]

"""Needle in a haystack, RULER's eight variants: one or several keys, values and queries; words, numbers or UUIDs.

Each needle is a sentence "One special magic number for <key> is: <value>." hidden in a
haystack (noise sentences, the text, or other needles with other keys). The question after
the context asks for the values of one key (or several: multi-query); the answer must
contain every value of every queried key (RULER's string_match_all).

Depths: the sample's first queried needle sits at the stated depth (samples spread evenly
over the context: 10%, 30%, ... for 5 samples); the other needles at depths drawn from
RULER's 40-point grid. RULER draws every needle's depth from that grid.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from .haystack import HAYSTACK_KINDS, TextHaystack, noise_lines
from .prompt import Draft, Sample, finish, fit, insert_at_depths, join_items
from .words import NEEDLE_KINDS, distinct, needle_value

#: RULER's needle depths: 40 points from 0% to 100% of the context
DEPTH_GRID = tuple(round(i * 100 / 39) / 100 for i in range(40))
KIND_NAMES = {"numbers": ("number", "numbers"), "words": ("word", "words"), "uuids": ("UUID", "UUIDs")}
NEEDLE = "One special magic {kind} for {key} is: {value}."


def sample_depth(index: int, count: int) -> float:
    """The stated depth of sample ``index`` of ``count``: evenly spread, 0.1 0.3 0.5 0.7 0.9 for 5."""
    return (index + 0.5) / count


@dataclass(frozen=True)
class NeedleInAHaystack:
    haystack: str = "essay"  # noise, essay (the text) or needle (distractor needles)
    key_kind: str = "words"
    value_kind: str = "numbers"
    keys: int = 1  # needles with different keys (the others are distractors)
    values: int = 1  # values per key, all to be found
    queries: int = 1  # keys asked for at once
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        assert self.haystack in HAYSTACK_KINDS and {self.key_kind, self.value_kind} <= set(NEEDLE_KINDS)

    @property
    def description(self) -> str:
        haystacks = {"noise": "noise haystack", "essay": "text haystack", "needle": "haystack of other needles"}
        parts = [f"{self.key_kind} -> {self.value_kind}", haystacks[self.haystack]]
        if self.keys > 1:
            parts.append(f"{self.keys} keys")
        if self.values > 1:
            parts.append(f"{self.values} values per key")
        if self.queries > 1:
            parts.append(f"{self.queries} keys asked")
        return "needle in a haystack: " + ", ".join(parts)

    def sample(self, name: str, tokenizer: Any, text: TextHaystack, length: int, index: int, count: int,
               seed: Any) -> Sample:
        rng = random.Random(f"{name}-{seed}-{length}-{index}")
        depth = sample_depth(index, count)
        keys = distinct(self.key_kind, max(self.keys, self.queries), rng)
        all_values = distinct(self.value_kind, len(keys) * self.values, rng, avoid=set(keys))
        values = [all_values[i * self.values : (i + 1) * self.values] for i in range(len(keys))]
        one, many = KIND_NAMES[self.value_kind]
        needles = []
        for k, key in enumerate(keys):
            for v, value in enumerate(values[k]):
                at = depth if (k, v) == (0, 0) else rng.choice(DEPTH_GRID)
                needles.append((NEEDLE.format(kind=one, key=key, value=value), at))
        queried = keys[: self.queries]
        answers = [value for k in range(self.queries) for value in values[k]]
        distractors = _Distractors(random.Random(f"{name}-{seed}-{length}-{index}-distractors"), self, set(keys))

        def draft(size: int) -> Draft:
            if self.haystack == "essay":
                context = insert_at_depths(text.sentences(size), needles, " ")
            else:
                lines = noise_lines(size) if self.haystack == "noise" else distractors.lines(size)
                context = insert_at_depths(lines, needles, "\n")
            query = join_items(queried)
            if len(answers) == 1:
                task_text = (f"A special magic {one} is hidden in the text below. Memorize it: I will ask you "
                             f"about the {one} afterwards.\n{context}\nWhat is the special magic {one} for "
                             f"{query} mentioned in the text above?")
                prefix = f" The special magic {one} for {query} mentioned in the text above is"
            else:
                task_text = (f"Special magic {many} are hidden in the text below. Memorize them: I will ask you "
                             f"about the {many} afterwards.\n{context}\nWhat are all the special magic {many} "
                             f"for {query} mentioned in the text above?")
                prefix = f" The special magic {many} for {query} mentioned in the text above are"
            return Draft(task_text, context, prefix, answers, needles, depth)

        made = fit(tokenizer, length, draft, least=1)
        return finish(tokenizer, made, task=name, length=length, index=index, max_new_tokens=self.max_new_tokens)


class _Distractors:
    """Needles with other keys, drawn once in order, so that a haystack of N lines is the first N of them."""

    def __init__(self, rng: random.Random, task: NeedleInAHaystack, avoid: set[str]):
        self.rng, self.task, self.avoid, self.drawn = rng, task, avoid, []

    def lines(self, count: int) -> list[str]:
        one = KIND_NAMES[self.task.value_kind][0]
        while len(self.drawn) < count:
            key = needle_value(self.task.key_kind, self.rng)
            if key in self.avoid:
                continue
            value = needle_value(self.task.value_kind, self.rng)
            self.drawn.append(NEEDLE.format(kind=one, key=key, value=value))
        return self.drawn[:count]

"""The haystacks needles hide in: text (RULER's "essay"), repeated noise sentences, or other needles.

RULER's essay haystack is Paul Graham's essays; here it is the sweep's evaluation text (the
CPython documentation topics by default, or ``--text-file``): its first N words, white space
collapsed, repeated when the text is shorter, cut into sentences between which needles go.
"""

from __future__ import annotations

import re

#: the repeated filler of the passkey test (Mohtashami & Jaggi), RULER's "noise" haystack
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HAYSTACK_KINDS = ("noise", "essay", "needle")

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_WORD = re.compile(r"\b[a-z]{4,12}\b")


class TextHaystack:
    """The words of a text, for haystacks of any number of words."""

    def __init__(self, text: str):
        self.words = re.sub(r"\s+", " ", text).strip().split(" ")
        if not self.words or self.words == [""]:
            raise ValueError("the haystack text has no words")

    def sentences(self, words: int) -> list[str]:
        """The first ``words`` words (the text repeated as needed), cut into sentences after . ! or ?"""
        repeats = -(-words // len(self.words))
        text = " ".join((self.words * repeats)[:words])
        return [part for part in _SENTENCE_END.split(text) if part]

    def vocabulary(self) -> list[str]:
        """The text's distinct lower-case words of 4-12 letters, in order of first use (extra words for cwe)."""
        return list(dict.fromkeys(word for word in _WORD.findall(" ".join(self.words).lower())))


def noise_lines(count: int) -> list[str]:
    return [NOISE] * count

"""RULER's scoring: a prediction earns the share of the expected items it contains (``string_match_all``).

An item counts when it appears anywhere in the prediction, ignoring case; a sample scores
1 only when every item is there. The task's score is the mean over its samples (RULER
reports it x 100). The prediction is first cleaned as RULER does: control characters
become line breaks and the ends are stripped.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean(prediction: str) -> str:
    return _CONTROL.sub("\n", prediction.strip()).strip()


def match_share(prediction: str, answers: list[str]) -> float:
    """The share of ``answers`` found in ``prediction`` (case-insensitive substrings); 0 for no answers."""
    if not answers:
        return 0.0
    found = clean(prediction).lower()
    return sum(answer.lower() in found for answer in answers) / len(answers)


def all_found(prediction: str, answers: list[str]) -> bool:
    """Every expected item is in the prediction."""
    return bool(answers) and match_share(prediction, answers) == 1.0

"""Errors that reach users: each names the problem and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class KVPolicyError(Exception):
    """Bad input from a user (recipe, CLI argument, model); the CLI prints it and exits with status 2."""


class RecipeError(KVPolicyError):
    """A recipe that cannot be used; the message names the file, line and key."""


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """' (did you mean "x"?)' for the closest option, or '' when none is close."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message ("" when it has none), cut to ``limit`` characters."""
    text = str(error).strip()
    text = text.splitlines()[0] if text else ""
    return text if len(text) <= limit else text[:limit] + "..."

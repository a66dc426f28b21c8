"""What the commands share: budgets and text from the command line, torch's settings for a run, and a clear
message when an optional package is missing.

Every command module imports from here (and from the layers below), never from another command, so the
commands import one way only.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..errors import KVPolicyError
from ..plan import Budget

# where each optional package comes from: its pip name and the extra that installs it
OPTIONAL = {
    "rich": ("rich", "cli"),
    "matplotlib": ("matplotlib", "cli"),
    "transformers": ("transformers", "transformers"),
    "triton": ("triton", "triton"),
}


def require(module: str) -> ModuleType:
    """Import ``module`` (e.g. "rich.table") and return it. If its package is not installed, raise a KVPolicyError
    whose one line names the package and the command that installs it (the ``kvpolicy`` command prints it and
    exits with status 2)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        top = module.split(".")[0]
        if error.name is None or error.name.split(".")[0] != top:
            raise  # the package is there but something it imports is not: not ours to explain
        package, extra = OPTIONAL.get(top, (top, "cli"))
        raise KVPolicyError(f'this command needs {package}, which is not installed: pip install "kvpolicy[{extra}]"') \
            from None


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display); see `require` for a missing matplotlib."""
    require("matplotlib").use("Agg")
    return require("matplotlib.pyplot")


def parse_budget(text: str) -> Budget:
    """'0.2' -> 20% of the prompt; '512' -> 512 tokens."""
    try:
        value = float(text)
    except ValueError:
        raise KVPolicyError(f"budget {text!r} is not a number: give a ratio in (0, 1] or a token count >= 1") from None
    if 0 < value <= 1 and not text.isdigit():
        return Budget(ratio=value)
    if value >= 1 and value == int(value):
        return Budget(tokens=int(value))
    raise KVPolicyError(f"budget {text!r}: give a ratio in (0, 1] (e.g. 0.2) or a whole number of tokens (e.g. 512)")


DEFAULT_TEXT = "pydoc_data.topics"


def read_text(path: str | None = None, *, prompt: str | None = None, what: str = "text file") -> tuple[str, str]:
    """A command's input text and where it came from, as (text, source).

    The file at ``path`` if given (``what`` names it in errors: "text file", "prompt file"), else the inline
    ``prompt``, else the CPython documentation topics (``pydoc_data.topics``, which ship with every Python).
    A missing file, or text with nothing but white space, raises KVPolicyError.
    """
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise KVPolicyError(f"{what} {path!r} does not exist (or is not a file)")
        text = file.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise KVPolicyError(f"{what} {path!r} is empty: give a file with text in it")
        return text, str(file)
    if prompt is not None:
        if not prompt.strip():
            raise KVPolicyError("the prompt is empty: give --prompt TEXT or --prompt-file FILE")
        return prompt, "the --prompt text"
    from pydoc_data.topics import topics

    return "\n\n".join(topics.values()), DEFAULT_TEXT


class quiet_torch:
    """Fix torch's thread count and silence transformers' loading bars for a run; restore both after."""

    def __init__(self, threads: int):
        self.threads = threads

    def __enter__(self) -> None:
        from transformers.utils import logging

        self.saved = (torch.get_num_threads(), logging.get_verbosity(), logging.is_progress_bar_enabled())
        torch.set_num_threads(self.threads)
        logging.set_verbosity_error()
        logging.disable_progress_bar()

    def __exit__(self, *exc: Any) -> None:
        from transformers.utils import logging

        threads, verbosity, bars = self.saved
        torch.set_num_threads(threads)
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()

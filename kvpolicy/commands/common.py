"""What the commands share: budgets, devices, dtypes and text from the command line, torch's settings for a run,
and a clear message when an optional package is missing.

Every command module imports from here (and from the layers below), never from another command, so the
commands import one way only.
"""

from __future__ import annotations

import argparse
import importlib
import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import torch

from ..errors import KVPolicyError
from ..recipe.schema import MAX_TOKENS

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


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad argument raises `UsageError` (one line, exit status 2) instead of printing the usage."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}; see `{self.prog} --help`")


class UsageError(KVPolicyError):
    """A command-line argument argparse refused (a missing value, an unknown flag, a number out of range)."""


def count(least: int = 1, most: int = MAX_TOKENS) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``least`` to ``most``, else a one-line error that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (give one from {least} to {most})") \
                from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"{value} is out of range: give a whole number from {least} to {most}")
        return value

    parse.__name__ = "count"  # what argparse calls the type in its messages
    return parse


#: torch threads: at least one, and never more than a machine could have
THREADS = count(1, 4096)


def bound_numbers(parser: argparse.ArgumentParser) -> None:
    """Every plain ``int`` or ``float`` argument of every command, bounded: whole numbers within +-MAX_TOKENS,
    finite numbers (no inf, nan). A command's own checks (least values) still run after."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                bound_numbers(sub)
        elif action.type is int:
            action.type = count(-MAX_TOKENS, MAX_TOKENS)
        elif action.type is float:
            action.type = finite


def finite(text: str) -> float:
    """An argparse ``type``: a finite number (no inf, nan) within +-MAX_TOKENS."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or abs(value) > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"{text}: give a finite number (not inf or nan) of at most {MAX_TOKENS}")
    return value


#: --dtype spellings -> the torch dtype's name (the first of each is the canonical one, shown in errors and results)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}


def parse_dtype(text: str) -> str:
    """An argparse ``type``: a floating dtype's canonical name (``bf16`` -> ``bfloat16``), else a one-line error."""
    name = DTYPES.get(text.strip().lower())
    if name is None:
        valid = ", ".join(dict.fromkeys(DTYPES.values()))
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: choose one of {valid} (or bf16, fp16, fp32)")
    return name


parse_dtype.__name__ = "dtype"


def parse_device(text: str) -> str:
    """An argparse ``type``: a device this machine has (cpu, cuda, cuda:N, mps), else a one-line error saying what
    to use instead. Checked when the command line is read, so a wrong device fails before a model loads."""
    try:
        device = torch.device(text.strip().lower())
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: give cpu, cuda, cuda:N or mps") from None
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch was built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has no CUDA device ({why}, torch "
                                             f"{torch.__version__}); use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA device(s), cuda:0 to "
                                             f"cuda:{count - 1}")
        return str(device)
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: Apple's Metal (MPS) is not available on this machine; "
                                             "use --device cpu")
        return "mps"
    raise argparse.ArgumentTypeError(f"device {text!r} is not supported: give cpu, cuda, cuda:N or mps")


parse_device.__name__ = "device"


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype``, the same on every command that runs a model."""
    parser.add_argument("--device", type=parse_device, default="cpu",
                        help="where the model runs: cpu, cuda, cuda:N or mps (default: cpu)")
    parser.add_argument("--dtype", type=parse_dtype, default="float32",
                        help="weights and KV cache dtype: float32, bfloat16 or float16 (default: float32)")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `parse_dtype` name."""
    return getattr(torch, DTYPES[name])


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
    """Fix torch's thread count (unless ``threads`` is None) and silence transformers' loading bars and notices for a
    run, so that a command's stderr holds only its own lines; restore both after."""

    def __init__(self, threads: int | None = None):
        self.threads = threads

    def __enter__(self) -> None:
        from transformers.utils import logging

        self.saved = (torch.get_num_threads(), logging.get_verbosity(), logging.is_progress_bar_enabled())
        if self.threads is not None:
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

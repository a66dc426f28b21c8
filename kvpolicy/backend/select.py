"""Which attention backend a session runs: the torch reference or the Triton kernels."""

from __future__ import annotations

import os

import torch

from ..errors import KVPolicyError, did_you_mean
from ..recipe.schema import BACKEND_NAMES

ENV_VAR = "KVPOLICY_BACKEND"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _triton_import_error() -> str | None:
    """None when triton imports, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as error:  # ImportError, or a broken install failing at import time
        return f"{type(error).__name__}: {error}"
    return None


def select_backend(name: str | None, device: torch.device | str | None = None, *, use_env: bool = True) -> str:
    """Resolve a backend name to the one that runs: ``"torch"`` or ``"triton"``.

    Precedence (first set wins):

    1. the environment variable ``KVPOLICY_BACKEND`` (when ``use_env``; an empty value is unset);
    2. ``name``: the recipe's ``backend:`` (or the caller's choice);
    3. ``"auto"``.

    Pass ``use_env=False`` for a choice the user made explicitly in code (e.g. the
    ``backend=`` argument of `attach`) that the environment should not override.

    ``auto`` (or None): ``"triton"`` when ``device`` is a CUDA device and triton imports,
    else ``"torch"``. ``torch``: always ``"torch"``. ``triton``: ``"triton"`` when the
    kernels can run, i.e. on a CUDA device (``device`` None: when CUDA is available) or on
    CPU under Triton's interpreter (``TRITON_INTERPRET=1``, about 1000x slower: tests only);
    otherwise a `KVPolicyError` that says why and what to do.
    """
    source = "the backend argument"
    env = os.environ.get(ENV_VAR, "").strip() if use_env else ""
    if env:
        name, source = env, f"the environment variable {ENV_VAR}"
    name = (name or "auto").strip().lower()
    if name not in BACKEND_NAMES:
        raise KVPolicyError(
            f"unknown backend {name!r} (from {source}){did_you_mean(name, BACKEND_NAMES)}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    if name == "torch":
        return "torch"
    dev = torch.device(device) if device is not None else None
    on_cuda = dev.type == "cuda" if dev is not None else torch.cuda.is_available()
    if name == "auto":
        return "triton" if on_cuda and _triton_import_error() is None else "torch"
    # explicitly "triton"
    problem = _triton_import_error()
    if problem is not None:
        raise KVPolicyError(
            f"backend 'triton' was asked for (by {source}) but triton does not import ({problem}); "
            f"install it (pip install triton), or use backend: torch / auto"
            + (f", or unset {ENV_VAR}" if env else "")
        )
    if on_cuda or interpreting():
        return "triton"
    where = f"the model is on {dev}" if dev is not None else "no CUDA device is available"
    hint = " (move the model to a CUDA device)" if dev is not None and torch.cuda.is_available() else ""
    raise KVPolicyError(
        f"backend 'triton' was asked for (by {source}) but its kernels need a CUDA GPU and {where}{hint}; "
        f"use backend: torch or auto (auto picks Triton on CUDA and torch elsewhere)"
        + (f", or unset {ENV_VAR}" if env else "")
        + "; to run the kernels on CPU for testing only, set TRITON_INTERPRET=1 before importing triton"
    )


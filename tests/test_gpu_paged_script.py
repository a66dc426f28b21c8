"""benchmarks/gpu_paged.py, the GPU step of the vLLM integration's paged decode, run on CPU under Triton's interpreter
with tiny shapes: the script runs, and its in-place kernels agree with its gather path (holes included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_paged_script_checks_the_kernels_against_the_gather_path(tmp_path):
    out = tmp_path / "paged.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_paged.py"), "--device", "cpu", "--dtype", "float32",
               "--requests", "1", "3", "--context", "37", "--heads", "6", "2", "--dim", "16", "--block-size", "8",
               "--repeats", "1", "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(row["requests"], row["context"]) for row in rows] == [(1, 37), (3, 37)]
    for row in rows:
        assert row["max_output_diff"] < 1e-5 and row["max_colsum_diff"] < 1e-6
        assert row["in_place_ms"] > 0 and row["gather_ms"] > 0
        assert row["compaction_equal"] and row["compaction_kernel_ms"] > 0

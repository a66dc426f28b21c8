"""benchmarks/needle_kept.py runs end to end (tiny model, short prompt): one line per recipe, the full cache keeps
every needle token."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "needle_kept.py"


def test_needle_kept_prints_a_line_per_recipe(tiny):
    folder, text = tiny
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", folder, "--text-file", text, "--prompt-tokens", "400",
                           "--samples", "1", "--recipes", "full", "h2o", "--threads", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.startswith(("full", "h2o"))}
    assert set(lines) == {"full", "h2o"}
    assert lines["full"][2] == "100%" and lines["full"][2] != lines["h2o"][2]

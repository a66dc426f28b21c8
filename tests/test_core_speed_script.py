"""benchmarks/core_speed.py runs end to end (on the tiny model, one short context): the script the README's
speed table comes from must keep working as the package changes (its figures are for a quiet machine, not here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_core_speed_runs_every_configuration(tiny, tmp_path):
    out = tmp_path / "speed.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "core_speed.py"), "--model", tiny[0], "--text-file", tiny[1],
         "--contexts", "48", "--new-tokens", "2", "--repeats", "1", "--threads", "1", "--out", str(out),
         "--compile", "--compile-backend", "eager",  # the compiled configurations without inductor's compile time
         "--recipes", "kivi"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(r["context"], r["config"]) for r in rows] == [
        (48, "plain"), (48, "plain-compiled"), (48, "full"), (48, "h2o"), (48, "h2o-compiled"), (48, "kivi")]
    assert all(r["prefill_s"] > 0 and r["decode_ms"] > 0 for r in rows)


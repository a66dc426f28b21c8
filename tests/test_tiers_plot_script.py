"""benchmarks/tiers_plot.py redraws docs/img/tiers-ppl-4000.png from the kept 4,000-token rows: the merge keeps one
row per (task, recipe, budget), relabels the rows h2o-mixed ran without decay, and leaves HQQ 2-bit off the axis."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("tiers_plot", ROOT / "benchmarks" / "tiers_plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plot_merges_the_kept_rows_and_draws_them(tmp_path):
    script = load_script()
    rows = script.sweep()
    keys = [(r["task"], r["recipe"], r["budget"]) for r in rows]
    assert len(keys) == len(set(keys))
    ppl = {(r["recipe"], r["budget"]): r["ppl"] for r in rows if r["task"] == "ppl"}
    assert ppl[("h2o-mixed, no decay", "0.2 mem")] > ppl[("h2o-mixed", "0.2 mem")]  # the decay A/B of docs/tiers.md
    assert {("h2o-mixed", b) for b in ("0.1 mem", "0.2 mem", "0.3 mem")} <= ppl.keys()
    assert not any("hqq-2bit" in recipe or recipe.endswith("-s0") for recipe, _ in ppl)
    assert {r["recipe"] for r in rows if r["task"] == "memory"} == {"kivi", "hf-hqq-4bit"}
    out = tmp_path / "plot.png"
    script.main(["--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""docs/img/tiers-ppl-4000.png from the kept results: perplexity against bytes at 4,000 tokens (docs/tiers.md).

    python benchmarks/tiers_plot.py            # writes docs/img/tiers-ppl-4000.png

The rows ran as several `kvpolicy compare` processes side by side (benchmarks/results/cpu-2026-12-02/eq4000*.jsonl);
this merges them and draws them with compare's own plot. `h2o-mixed` ran without decay before 2026-12-02 (those rows
are relabelled "h2o-mixed, no decay"); `hf-hqq-2bit` (15.9) is left out so that the axis shows the differences that
matter (docs/tiers.md gives it in the table).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from kvpolicy.commands.compare_report import plot_sweep
from kvpolicy.tasks import available_tasks
from kvpolicy.tasks.lengths import at_lengths

RESULTS = Path(__file__).parent / "results" / "cpu-2026-12-02"
RENAME = {"eq4000-tiers": {"h2o-mixed": "h2o-mixed, no decay"}, "eq4000-more": {"h2o-mixed": "h2o-mixed, no decay"},
          "eq4000-ab": {"h2o-mixed-decay": "h2o-mixed", "h2o-mixed-s0": None}}
LEFT_OUT = {"hf-hqq-2bit"}
NO_EVICTION = {"kivi", "hf-hqq-4bit"}  # drawn at the bytes their memory rows measured


def sweep(folder: Path = RESULTS) -> list[dict]:
    rows, seen = [], set()
    for path in sorted(folder.glob("eq4000*.jsonl")):
        names = RENAME.get(path.stem, {})
        for line in path.read_text().splitlines():
            row = json.loads(line)
            name = names.get(row["recipe"], row["recipe"])
            key = (row["task"], name, row["budget"])
            if name is None or name in LEFT_OUT or key in seen:
                continue
            if row["task"] == "ppl" or (row["task"] == "memory" and name in NO_EVICTION):
                seen.add(key)
                rows.append({**row, "recipe": name})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "docs" / "img" / "tiers-ppl-4000.png")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        [path] = plot_sweep(sweep(), at_lengths([available_tasks()["ppl"]], [4000]), Path(folder))
        shutil.copyfile(path, args.out)
    print(args.out)


if __name__ == "__main__":
    main()

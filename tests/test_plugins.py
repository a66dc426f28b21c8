"""The example plugins in plugins/: installed into this environment, found through their entry points,
used by a `kvpolicy compare` sweep (policy and task), and their own tests pass.

Everything that must see the installed plugins runs in a subprocess, so it builds a fresh registry.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parent.parent / "plugins"
#: folder -> (distribution name, policy, example recipe)
EXAMPLES = {
    "kvpolicy-strided": ("kvpolicy-strided", "strided", "examples/strided.yaml"),
    "kvpolicy-recency-h2o": ("kvpolicy-recency-h2o", "recency_h2o", "examples/recency_h2o.yaml"),
    # written by a newcomer from docs/ alone, to check that the docs suffice
    "kvpolicy-random": ("kvpolicy-random", "random", "examples/random.yaml"),
}
TOKENS, PROMPT = 64, 48


def run(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Copies of plugins/<name> (so builds leave nothing in the checkout), pip-installed here; uninstalled after."""
    root = tmp_path_factory.mktemp("plugins")
    copies = {}
    for folder in EXAMPLES:
        copies[folder] = root / folder
        shutil.copytree(PLUGINS / folder, copies[folder],
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache"))
    done = run("-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", *map(str, copies.values()),
               timeout=300)
    assert done.returncode == 0, done.stderr
    try:
        yield copies
    finally:
        dists = [dist for dist, _, _ in EXAMPLES.values()]
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *dists], capture_output=True)


def test_policies_lists_the_plugins_with_their_source(installed):
    done = run("-m", "kvpolicy.commands.cli", "policies")
    assert done.returncode == 0, done.stderr
    for dist, policy, _ in EXAMPLES.values():
        assert re.search(rf"^{policy}\s+\[plugin {dist} 0\.1\.0\]", done.stdout, re.MULTILINE), done.stdout
    assert "broken plugin" not in done.stdout
    assert re.search(r"^h2o\s+\[built-in\]", done.stdout, re.MULTILINE)


def test_compare_sweep_runs_the_plugin_policies_and_task(installed, tiny, tmp_path):
    folder, text = tiny
    out = tmp_path / "run"
    recipes = [str(installed[name] / recipe) for name, (_, _, recipe) in EXAMPLES.items()]
    done = run("-m", "kvpolicy.commands.cli", "compare", "--model", folder, "--text-file", text, "--tokens", str(TOKENS),
               "--prompt-tokens", str(PROMPT), "--recipes", *recipes, "h2o", "--budgets", "0.25",
               "--tasks", "ppl", "kvtokens", "--out", str(out))
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by = {(r["task"], r["recipe"]): r for r in results}
    recipes = ["full", "strided", "recency_h2o", "random", "h2o"]
    assert set(by) == {(task, recipe) for task in ("ppl", "kvtokens") for recipe in recipes}
    for recipe in recipes:
        assert math.isfinite(by["ppl", recipe]["ppl"]) and by["ppl", recipe]["ppl"] > 1
    for recipe in recipes[1:]:
        assert by["ppl", recipe]["budget"] == by["kvtokens", recipe]["budget"] == "0.25"
        assert by["ppl", recipe]["kv_tokens"] == math.ceil(0.25 * TOKENS)
        assert by["kvtokens", recipe]["kv_tokens_mean"] == math.ceil(0.25 * PROMPT)
        assert by["kvtokens", recipe]["kv_tokens_per_layer"] == [math.ceil(0.25 * PROMPT)] * 3
    assert by["kvtokens", "full"]["kv_tokens_mean"] == PROMPT and by["kvtokens", "full"]["kv_kept_ratio"] == 1.0
    assert by["kvtokens", "full"]["settings"] == {"prompt_tokens": PROMPT}
    assert (out / "plots" / "memory.png").is_file()  # kvtokens plots on the memory figure


@pytest.mark.parametrize("folder", list(EXAMPLES))
def test_the_plugins_own_tests_pass(installed, folder):
    done = run("-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=installed[folder])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"\d+ passed", done.stdout) and "failed" not in done.stdout

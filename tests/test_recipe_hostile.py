"""Recipes written carelessly or to hurt: each is refused in seconds and bounded memory, with one line that
names the file, the line, the problem and the fix, through the installed CLI and the Python API."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpolicy.errors import RecipeError
from kvpolicy.recipe import load_recipe
from kvpolicy.recipe.checks import MAX_RECIPE_BYTES

HEAD = "kvpolicy: 1\npolicy: h2o\nbudget: {ratio: 0.2}\n"


def alias_bomb() -> str:
    """Nine levels of nine aliases (9**9 values once expanded) as the value of a valid key: 500 bytes."""
    text = HEAD + "params:\n  recent_ratio: [&l0 [1,1,1,1,1,1,1,1,1]"
    for level in range(1, 9):
        text += f", &l{level} [" + ", ".join([f"*l{level - 1}"] * 9) + "]"
    return text + ", *l8]\n"


CASES: dict[str, tuple[str | bytes, str]] = {
    "alias-bomb": (alias_bomb(), "expands to more than"),
    "nested-3000": (HEAD + "params: " + "[" * 3000 + "]" * 3000 + "\n", ":4: YAML: nested more than 32 deep"),
    "utf-16": ("kvpolicy: 1\npolicy: h2o\n".encode("utf-16"), "not UTF-8 text (byte 0xff at offset 0): it looks like UTF-16"),
    "latin-1": ("kvpolicy: 1\nname: caf\xe9\npolicy: h2o\n".encode("latin-1"), "not UTF-8 text (byte 0xe9"),
    "huge-tokens": ("kvpolicy: 1\npolicy: h2o\nbudget: {tokens: 100000000000000000000000000000}\n",
                    ":3: budget.tokens: must be an integer from 1 to 2,147,483,647, got 1000000"),
    "tokens-past-int32": ("kvpolicy: 1\npolicy: h2o\nbudget: {tokens: 4294967296}\n",
                          ":3: budget.tokens: must be an integer from 1 to 2,147,483,647, got 4294967296"),
    "huge-sinks": ("kvpolicy: 1\npolicy: streaming\nbudget: {tokens: 8}\nparams: {sinks: 100000000000000000000}\n",
                   ":4: params.sinks: expected int"),
    "duplicate-key": ("kvpolicy: 1\npolicy: h2o\nbudget: {tokens: 8}\npolicy: streaming\n",
                      ":4: YAML: duplicate key 'policy' (first on line 2)"),
    "version-true": ("kvpolicy: true\npolicy: h2o\nbudget: {tokens: 8}\n", ":1: kvpolicy: unsupported schema version True"),
    "beta-inf": ("kvpolicy: 1\npolicy: h2o\nbudget: {ratio: 0.2, schedule: pyramid, beta: .inf}\n",
                 "budget.beta: must be a number >= 1, got inf. Give a finite number"),
    "ratio-no-dot": ("kvpolicy: 1\npolicy: h2o\nbudget: {ratio: 1e-9}\n", "Write it as a number with a dot"),
    "multiplier-nan": ("kvpolicy: 1\npolicy: h2o\nbudget: {ratio: 0.2, per_layer: [.nan, 1.0]}\n",
                       "budget.per_layer: expected a list of positive multipliers"),
}


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize("name", sorted(CASES))
def test_python_api_refuses_with_the_line_and_the_fix(tmp_path, name):
    content, expected = CASES[name]
    path = write(tmp_path, name, content)
    started = time.perf_counter()
    with pytest.raises(RecipeError) as caught:
        load_recipe(path)
    message = str(caught.value)
    assert expected in message and message.startswith(str(path)) and "\n" not in message
    assert len(message) < 500 and time.perf_counter() - started < 5


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # far below the GBs the alias bomb took


@pytest.mark.parametrize("name", ["alias-bomb", "nested-3000", "utf-16", "huge-sinks", "duplicate-key"])
def test_installed_cli_exits_2_with_one_line(tmp_path, name):
    content, expected = CASES[name]
    path = write(tmp_path, name, content)
    kvpolicy = Path(sys.executable).with_name("kvpolicy")
    done = subprocess.run([str(kvpolicy), "validate", str(path)], capture_output=True, text=True, timeout=60,
                          preexec_fn=_limit_memory)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_a_recipe_over_the_size_limit_is_refused_before_it_is_parsed(tmp_path):
    rule = "  - {layers: [0], budget: {tokens: 8}}\n"
    path = write(tmp_path, "huge", HEAD + "layers:\n" + rule * (MAX_RECIPE_BYTES // len(rule) + 1))
    started = time.perf_counter()
    with pytest.raises(RecipeError, match=r"more than the 4,194,304 a recipe may be"):
        load_recipe(path)
    assert time.perf_counter() - started < 2


def test_aliases_and_merge_keys_within_the_bounds_still_work(tmp_path):
    path = write(tmp_path, "ok", "kvpolicy: 1\npolicy: h2o\nbudget: &b {ratio: 0.2, slack: 2}\n"
                 "layers:\n  - {layers: [0], budget: {<<: *b, ratio: 0.5}}\n")
    plan = load_recipe(path).resolve(2, 1)
    assert plan.layers[0].heads[0].budget.ratio == 0.5 and plan.layers[0].heads[0].budget.slack == 2
    assert plan.layers[1].heads[0].budget.ratio == 0.2

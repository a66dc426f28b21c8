"""The installed CLI: listings, validate, and bad input -> a clear message and exit status 2, no traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from kvpolicy.commands.cli import main

BAD_RECIPES = {
    "malformed.yaml": ("kvpolicy: 1\npolicy: h2o\nbudget: {ratio: 0.2\n", "malformed.yaml:"),
    "unknown_key.yaml": ("kvpolicy: 1\npolicy: h2o\nbudgte: {ratio: 0.2}\n", 'did you mean "budget"'),
    "unknown_policy.yaml": ("kvpolicy: 1\npolicy: h3o\nbudget: {ratio: 0.2}\n", '(did you mean "h2o"?). Available: '),
    "ratio_high.yaml": ("kvpolicy: 1\npolicy: h2o\nbudget: {ratio: 1.5}\n", "ratio"),
    "ratio_zero.yaml": ("kvpolicy: 1\npolicy: h2o\nbudget: {ratio: 0}\n", "ratio"),
    "tokens_zero.yaml": ("kvpolicy: 1\npolicy: h2o\nbudget: {tokens: 0}\n", "tokens"),
    "layer_range.yaml": (
        "kvpolicy: 1\npolicy: h2o\nbudget: {ratio: 0.2}\nlayers:\n  - {layers: 30-31, policy: full}\n",
        "layer_range.yaml:5",
    ),
    "head_range.yaml": (
        "kvpolicy: 1\npolicy: h2o\nbudget: {ratio: 0.2}\nheads:\n  - {layers: 2, heads: [3], policy: full}\n",
        "head_range.yaml:5",
    ),
}


def cli_path() -> str:
    return shutil.which("kvpolicy") or os.path.join(os.path.dirname(sys.executable), "kvpolicy")


@pytest.mark.parametrize("name", sorted(BAD_RECIPES))
def test_bad_recipe_exits_2_with_message(tmp_path, capsys, name):
    text, expected = BAD_RECIPES[name]
    path = tmp_path / name
    path.write_text(text)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpolicy: error: ") and expected in err and "Traceback" not in err


def test_missing_recipe_file(capsys):
    assert main(["validate", "no/such/recipe.yaml"]) == 2
    err = capsys.readouterr().err
    assert "no/such/recipe.yaml" in err and "h2o" in err


def test_installed_cli_error_has_no_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("kvpolicy: 1\npolicy: h2o\nparams: {recent_ratoi: 0.5}\nbudget: {ratio: 0.2}\n")
    result = subprocess.run([cli_path(), "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "bad.yaml:3" in result.stderr and 'did you mean "recent_ratio"' in result.stderr
    assert "Traceback" not in result.stderr


def test_validate_prints_plan_per_layer_and_head(capsys):
    assert main(["validate", "recipes/mixed.yaml"]) == 0
    out = capsys.readouterr().out
    assert "layers 0-1: heads 0-2: full" in out
    assert "layers 10: heads 0: h2o" in out and "heads 1: streaming(sinks=4, positions='original')" in out
    assert "layers 11-29: heads 0-2: h2o" in out


def test_validate_against_a_model_alias_or_folder(capsys, tiny):
    assert main(["validate", "recipes/h2o.yaml", "--model", "smollm2"]) == 0
    assert "valid for 30 layers x 3 KV heads" in capsys.readouterr().out
    assert main(["validate", "recipes/h2o.yaml", "--model", tiny[0]]) == 0
    assert "valid for 3 layers x 2 KV heads" in capsys.readouterr().out
    assert main(["validate", "recipes/h2o.yaml", "--model", "no-such-model"]) == 2
    assert "neither a model alias (smollm2" in capsys.readouterr().err


def test_policies_and_recipes_listings(capsys):
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    for name in ("full", "window", "streaming", "h2o"):
        assert name in out
    assert "built-in" in out and "colsum" in out
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "mixed" in out and "h2o" in out


@pytest.mark.parametrize("budget,ok", [("0.2", True), ("512", True), ("0", False), ("1.5", False), ("x", False)])
def test_budget_argument(budget, ok):
    from kvpolicy.errors import KVPolicyError
    from kvpolicy.recipe.budget import parse_budget

    if ok:
        parse_budget(budget)
    else:
        with pytest.raises(KVPolicyError):
            parse_budget(budget)


@pytest.mark.parametrize("command,package,extra", [
    (["compare", "--tasks", "ppl"], "rich", "cli"),
    (["compare", "--tasks", "ppl"], "matplotlib", "cli"),
    (["bench", "--kv-memory", "1MiB"], "rich", "cli"),
    (["bench", "--kv-memory", "1MiB"], "matplotlib", "cli"),
])
def test_missing_optional_package_is_named_with_its_install_command(command, package, extra, monkeypatch, capsys):
    """A command whose optional package is missing says which, and how to install it, before any model loads."""
    for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)  # what a missing package looks like to import
    assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f'kvpolicy: error: this command needs {package}, which is not installed: '
                   f'pip install "kvpolicy[{extra}]"'], err


def test_require_names_only_the_missing_package(monkeypatch):
    from kvpolicy.commands.common import require
    from kvpolicy.errors import KVPolicyError

    assert require("json").dumps(1) == "1"
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(KVPolicyError, match=r'needs triton, .*pip install "kvpolicy\[triton\]"'):
        require("triton")

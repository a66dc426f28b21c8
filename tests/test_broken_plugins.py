"""Broken plugins through the real entry-point path: reported by name with the reason, never fatal.

(Bad registrations and bad scores of an importable plugin: tests/test_registry.py.)
"""

from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest

from kvpolicy import hookimpl
from kvpolicy import registry as registry_module
from kvpolicy.commands.cli import main
from kvpolicy.errors import KVPolicyError
from kvpolicy.registry import Registry
from kvpolicy.tasks import TASKS, available_tasks


def entry_points_with(*points: importlib.metadata.EntryPoint):
    real = importlib.metadata.entry_points

    def fake(**kwargs):
        found = list(real(**kwargs))
        if kwargs.get("group") == "kvpolicy":
            found += list(points)
        return found

    return fake


@pytest.fixture
def broken_import(monkeypatch):
    """An installed entry point whose module does not import."""
    point = importlib.metadata.EntryPoint(name="ghost", value="kvpolicy_ghost_plugin_missing", group="kvpolicy")
    monkeypatch.setattr(registry_module.importlib.metadata, "entry_points", entry_points_with(point))
    registry = Registry()
    monkeypatch.setattr(registry_module, "_default", registry)  # what get_registry() hands out
    return registry


def test_import_error_is_reported_and_the_rest_works(broken_import, capsys):
    assert "import failed: ModuleNotFoundError" in broken_import.broken["ghost"]
    assert broken_import.get("h2o").name == "h2o"
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "broken plugin ghost: import failed: ModuleNotFoundError" in out and "h2o" in out


def test_a_recipe_naming_a_policy_of_the_broken_plugin_fails_clearly(broken_import, tmp_path, capsys):
    recipe = tmp_path / "ghostly.yaml"
    recipe.write_text("kvpolicy: 1\nbudget: {ratio: 0.2}\npolicy: ghost_policy\n")
    assert main(["validate", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "ghostly.yaml:3" in err and "unknown policy 'ghost_policy'" in err
    assert "Plugins that failed to load" in err and "ghost" in err and "Traceback" not in err


def test_a_task_hook_that_raises_is_reported_and_other_tasks_stay(monkeypatch):
    module = types.ModuleType("kvpolicy_bad_tasks")

    @hookimpl
    def kvpolicy_register_tasks():
        raise RuntimeError("tasks exploded")

    module.kvpolicy_register_tasks = kvpolicy_register_tasks
    bad_task = types.ModuleType("kvpolicy_not_a_task")

    @hookimpl
    def kvpolicy_register_tasks_2():
        return [object()]

    bad_task.kvpolicy_register_tasks = kvpolicy_register_tasks_2
    monkeypatch.setitem(sys.modules, "kvpolicy_bad_tasks", module)
    registry = Registry(load_entry_points=False)
    registry.add_plugin(module, "bad-tasks")
    registry.add_plugin(bad_task, "not-a-task")
    before = dict(TASKS)
    tasks = available_tasks(registry)
    assert "task registration failed: RuntimeError: tasks exploded" in registry.broken["bad-tasks"]
    assert "is not a compare task" in registry.broken["not-a-task"]
    assert {"ppl", "passkey", "memory"} <= set(tasks) and TASKS == before
    with pytest.raises(KVPolicyError, match="unknown policy"):
        registry.get("whatever")

"""Evaluation tasks for ``kvpolicy compare``: one small module each, found by name in `available_tasks`.

A task is any object with the `Task` interface (``name``, ``run(context, rows)``, ...).
Plugins add tasks with `register_task`, or through a ``kvpolicy_register_tasks`` hook
returning task objects when the hook specification provides one.
"""

from __future__ import annotations

from typing import Any

from .base import Context, Row, Task
from .fidelity import Fidelity
from .memory import Memory
from .passkey import Passkey
from .ppl import Perplexity
from .ruler import RULER_TASKS, SUITES
from .speed import Speed

TASKS: dict[str, Task] = {task.name: task for task in (Perplexity(), Memory(), Speed(), Passkey(), Fidelity(),
                                                      *RULER_TASKS.values())}


def register_task(task: Task) -> None:
    """Add a task (e.g. from a plugin); its name must be new."""
    if task.name in TASKS and TASKS[task.name] is not task:
        raise ValueError(f"a task named {task.name!r} is already registered")
    TASKS[task.name] = task


def available_tasks(registry: Any = None) -> dict[str, Task]:
    """Built-in and registered tasks, plus those plugins return from a ``kvpolicy_register_tasks`` hook.

    A plugin whose hook raises or returns something that is not a task is reported in the
    registry's ``broken`` (by plugin name, with the reason); the other tasks stay available.
    """
    from ..registry import PLUGIN_FAILURES, describe_failure, get_registry

    registry = registry or get_registry()
    hook = getattr(registry.manager.hook, "kvpolicy_register_tasks", None)
    for impl in hook.get_hookimpls() if hook is not None else []:
        try:
            found = list(impl.function() or [])
            for task in found:
                if not isinstance(getattr(task, "name", None), str) or not callable(getattr(task, "run", None)):
                    raise TypeError(f"{task!r} is not a compare task (it needs a `name` and a `run(context, rows)`)")
        except PLUGIN_FAILURES as exc:  # a broken plugin must never take kvpolicy down, not even by sys.exit()
            registry.broken.setdefault(impl.plugin_name, f"task registration failed: {describe_failure(exc)}")
            continue
        for task in found:
            TASKS.setdefault(task.name, task)
    return dict(TASKS)


__all__ = ["SUITES", "TASKS", "Context", "Row", "Task", "available_tasks", "register_task"]

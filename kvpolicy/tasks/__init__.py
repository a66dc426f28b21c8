"""Evaluation tasks for ``kvpolicy compare``: one small module each, found by name in `available_tasks`.

A task is any object with the `Task` interface (``name``, ``run(context, rows)``, ...).
Plugins add tasks with `register_task`, or through a ``kvpolicy_register_tasks`` hook
returning task objects when the hook specification provides one.
"""

from __future__ import annotations

from .base import Context, Row, Task
from .fidelity import Fidelity
from .memory import Memory
from .passkey import Passkey
from .ppl import Perplexity
from .speed import Speed

TASKS: dict[str, Task] = {task.name: task for task in (Perplexity(), Memory(), Speed(), Passkey(), Fidelity())}


def register_task(task: Task) -> None:
    """Add a task (e.g. from a plugin); its name must be new."""
    if task.name in TASKS and TASKS[task.name] is not task:
        raise ValueError(f"a task named {task.name!r} is already registered")
    TASKS[task.name] = task


def available_tasks() -> dict[str, Task]:
    """Built-in and registered tasks, plus those plugins return from a ``kvpolicy_register_tasks`` hook."""
    from ..registry import get_registry

    hook = getattr(get_registry().manager.hook, "kvpolicy_register_tasks", None)
    for tasks in (hook() if hook is not None else []):
        for task in tasks or []:
            TASKS.setdefault(task.name, task)
    return dict(TASKS)


__all__ = ["TASKS", "Context", "Row", "Task", "available_tasks", "register_task"]

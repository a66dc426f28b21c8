"""Plugin hook specifications (pluggy project ``kvpolicy``, entry-point group ``kvpolicy``).

Hook API version 1 (`HOOK_API_VERSION`). A plugin module implements any of these with
``@kvpolicy.hookimpl`` and is found through the ``kvpolicy`` entry-point group of its
package. Within one version, hooks are only added, never changed or removed; a change
that could break an existing plugin raises the version.
"""

from __future__ import annotations

import pluggy

PROJECT = "kvpolicy"
HOOK_API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kvpolicy_register_policies() -> list[type]:
    """Return the `kvpolicy.Policy` subclasses this plugin provides.

    Each needs a unique ``name`` (the recipe's ``policy:`` value) and may only ask for
    statistics the backend computes (``needs`` and ``profile_needs`` within
    `kvpolicy.policies.base.STAT_NAMES`). A policy that breaks these rules, or a hook that
    raises, marks the plugin as broken; the other plugins and the built-ins still work.
    """


@hookspec
def kvpolicy_register_tasks() -> list:
    """Return evaluation task objects for ``kvpolicy compare`` (see `kvpolicy.tasks.Task`).

    A task's ``name`` is what ``--tasks`` accepts; a name already taken keeps its first task.
    """


@hookspec
def kvpolicy_register_model_aliases() -> dict[str, str]:
    """Return model aliases: short name -> a local Hugging Face model folder, or another alias.

    `kvpolicy.load_model` (and ``--model`` of generate and compare) resolves them, case
    insensitively. Built-in aliases (``smollm2``) cannot be redirected; an alias that
    another plugin already defines keeps the first definition.
    """

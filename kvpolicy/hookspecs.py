"""Plugin hook specifications (pluggy project ``kvpolicy``, entry-point group ``kvpolicy``).

Hook API version 1. A plugin module implements any of these with ``@kvpolicy.hookimpl``
and is found through the ``kvpolicy`` entry-point group of its package.
"""

from __future__ import annotations

import pluggy

PROJECT = "kvpolicy"
HOOK_API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kvpolicy_register_policies() -> list[type]:
    """Return the `kvpolicy.Policy` subclasses this plugin provides."""


@hookspec
def kvpolicy_register_tasks() -> list:
    """Return evaluation task objects for ``kvpolicy compare`` (see `kvpolicy.tasks.Task`)."""


@hookspec
def kvpolicy_register_model_aliases() -> dict[str, str]:
    """Return model aliases: short name -> local folder or loader spec."""

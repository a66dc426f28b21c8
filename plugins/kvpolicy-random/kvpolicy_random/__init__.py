"""kvpolicy plugin: the `random` eviction policy (the H2O paper's random baseline)."""

from __future__ import annotations

import kvpolicy

from .policy import RandomEviction, RandomParams

__all__ = ["RandomEviction", "RandomParams", "kvpolicy_register_policies"]


@kvpolicy.hookimpl
def kvpolicy_register_policies() -> list[type]:
    return [RandomEviction]

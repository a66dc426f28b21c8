"""Policy registry: built-in policies and third-party plugins through one pluggy hook."""

from __future__ import annotations

import importlib.metadata
import os
import sys
import time
from dataclasses import dataclass

import pluggy

from . import hookspecs
from .errors import KVPolicyError, did_you_mean, first_line
from .policies.base import STAT_NAMES, Policy


@dataclass(frozen=True)
class PolicyEntry:
    policy: type[Policy]
    source: str  # "built-in" or "plugin <dist> <version>"


class Registry:
    """Every policy kvpolicy can use, and every plugin that failed to load (with the reason)."""

    def __init__(self, load_entry_points: bool = True) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self.policies: dict[str, PolicyEntry] = {}
        self.broken: dict[str, str] = {}  # plugin name -> reason
        from .policies import builtin

        self._add_plugin(builtin, "built-in", "built-in")
        if load_entry_points:
            self._load_entry_points()

    def _load_entry_points(self) -> None:
        for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT):
            dist = ep.dist
            source = f"plugin {dist.name} {dist.version}" if dist else f"plugin {ep.name}"
            started = time.perf_counter()
            try:
                module = ep.load()
            except PLUGIN_FAILURES as exc:  # a broken plugin must never take kvpolicy down
                self.broken[ep.name] = f"import failed: {describe_failure(exc)}"
                continue
            finally:
                _note_if_slow(ep.name, ep.value, time.perf_counter() - started)
            self._add_plugin(module, ep.name, source)

    def add_plugin(self, module: object, name: str, source: str | None = None) -> None:
        """Register a plugin module by hand, as its entry point would (e.g. to try it before packaging it).

        Its policies are added with ``source`` (default ``plugin <name>``); a failure lands in ``broken``.
        """
        self._add_plugin(module, name, source or f"plugin {name}")

    def _add_plugin(self, module: object, name: str, source: str) -> None:
        """Register ``module``'s hooks and policies, all or nothing: a plugin that fails midway leaves none behind."""
        try:
            self.manager.register(module, name=name)
            impls = [i for i in self.manager.hook.kvpolicy_register_policies.get_hookimpls() if i.plugin is module]
            staged: dict[str, PolicyEntry] = {}
            for impl in impls:
                for policy in impl.function() or []:
                    self._check_policy(policy, staged)
                    staged[policy.name] = PolicyEntry(policy, source)
        except PLUGIN_FAILURES as exc:
            self.broken[name] = f"registration failed: {describe_failure(exc)}"
            if self.manager.is_registered(module):
                self.manager.unregister(module)
            return
        self.policies.update(staged)

    def _check_policy(self, policy: type[Policy], staged: dict[str, PolicyEntry]) -> None:
        if not (isinstance(policy, type) and issubclass(policy, Policy)):
            raise TypeError(f"{policy!r} is not a kvpolicy.Policy subclass")
        if not policy.name:
            raise TypeError(f"{policy.__name__} has no `name`")
        unknown = (set(policy.needs) | set(policy.profile_needs) | set(policy.probe_needs)) - STAT_NAMES
        if unknown:
            raise TypeError(f"{policy.name} needs unknown statistics {sorted(unknown)}; known: {sorted(STAT_NAMES)}")
        for known in (self.policies, staged):
            if policy.name in known:
                raise TypeError(f"policy {policy.name!r} is already registered by {known[policy.name].source}")

    def get(self, name: str) -> type[Policy]:
        if name in self.policies:
            return self.policies[name].policy
        hint = did_you_mean(name, self.policies)
        broken = f" Plugins that failed to load: {self.broken}." if self.broken else ""
        raise KVPolicyError(
            f"unknown policy {name!r}{hint}. Available: {', '.join(sorted(self.policies))}.{broken}"
        )

    def names(self) -> list[str]:
        return sorted(self.policies)

    def model_aliases(self) -> dict[str, tuple[str, str]]:
        """Model aliases from plugins' ``kvpolicy_register_model_aliases``: alias -> (target, plugin name).

        Asked afresh on each call. A hook that fails, or returns something other than a mapping of
        names to strings or paths, is reported in ``broken`` and skipped; an alias that an earlier
        plugin already defines keeps the earlier plugin's target (the later one is reported).
        """
        aliases: dict[str, tuple[str, str]] = {}
        for impl in self.manager.hook.kvpolicy_register_model_aliases.get_hookimpls():
            plugin = impl.plugin_name
            try:
                found = impl.function() or {}
                if not isinstance(found, dict) or not all(
                    isinstance(k, str) and isinstance(v, (str, os.PathLike)) for k, v in found.items()
                ):
                    raise TypeError(f"expected a dict of alias -> folder or alias, got {found!r}")
            except PLUGIN_FAILURES as exc:  # a broken plugin must never take kvpolicy down
                self.broken[plugin] = f"model aliases failed: {describe_failure(exc)}"
                continue
            for alias, target in found.items():
                key = alias.lower()
                if key in aliases and aliases[key][1] != plugin:
                    self.broken[plugin] = f"model alias {alias!r} is already defined by {aliases[key][1]}"
                    continue
                aliases[key] = (os.fspath(target), plugin)
        return aliases


#: what a plugin's code may raise without taking kvpolicy down: any exception, and `sys.exit()` (SystemExit);
#: Ctrl-C (KeyboardInterrupt) still stops the command
PLUGIN_FAILURES = (Exception, SystemExit)
#: a plugin whose import takes longer than this many seconds is named on stderr (it delays every command)
SLOW_IMPORT_S = 2.0


def describe_failure(exc: BaseException) -> str:
    """One line for what a plugin raised (a SystemExit says so)."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {first_line(exc)}"


def _note_if_slow(name: str, target: str, seconds: float) -> None:
    if seconds > SLOW_IMPORT_S:
        print(f"kvpolicy: note: plugin {name!r} ({target}) took {seconds:.1f} s to import, which delays every "
              "kvpolicy command; uninstall it if it is not needed", file=sys.stderr)


_default: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry (built lazily, once)."""
    global _default
    if _default is None:
        _default = Registry()
    return _default

"""Reading a recipe's YAML with its line numbers, and the checks that report against them.

Every error names the file, line and key path, the problem and the fix (`recipe_error`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import yaml

from .errors import RecipeError, did_you_mean


class _Map(dict):
    """A YAML mapping that remembers its own line and the line of each key (1-based)."""

    line: int | None = None
    lines: dict[Any, int]


class LineLoader(yaml.SafeLoader):
    """A safe YAML loader whose mappings remember their lines (`line_of`)."""


def _construct_map(loader: LineLoader, node: yaml.MappingNode) -> _Map:
    data = _Map(loader.construct_mapping(node, deep=True))  # also flattens merge keys ("<<")
    data.line = node.start_mark.line + 1
    data.lines = {loader.construct_object(k): k.start_mark.line + 1 for k, _ in node.value}
    return data


LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)


def line_of(mapping: Any, key: Any = None) -> int | None:
    lines = getattr(mapping, "lines", {})
    return lines[key] if key in lines else getattr(mapping, "line", None)


def recipe_error(file: str, line: int | None, path: str, problem: str, fix: str = "") -> RecipeError:
    where = f"{file}:{line}" if line else file
    return RecipeError(f"{where}: {path}: {problem}." + (f" {fix}" if fix else ""))


def check_keys(mapping: Any, known: tuple[str, ...], path: str, file: str, line: int | None = None) -> None:
    if not isinstance(mapping, dict):
        raise recipe_error(file, line, path.rstrip(".") or "recipe", f"expected a mapping, got {mapping!r}")
    for key in mapping:
        if key not in known:
            raise recipe_error(file, line_of(mapping, key), f"{path}{key}", f"unknown key{did_you_mean(str(key), known)}",
                               f"Known keys: {', '.join(sorted(known))}")


def type_ok(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(type_ok(value, arg) for arg in typing.get_args(tp))
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is type(None):
        return value is None
    origin = typing.get_origin(tp) or tp
    if origin is tuple:
        return isinstance(value, (list, tuple))
    return isinstance(value, origin) if isinstance(origin, type) else True


def build_params(cls: Any, raw: Any, base: Any, path: str, file: str, line: int | None) -> Any:
    """A ``cls.Params`` instance: ``raw`` (a YAML mapping) over ``base`` (or the defaults), validated."""
    known = tuple(cls.param_fields())
    if not isinstance(raw, dict):
        raise recipe_error(file, line, path, f"expected a mapping of parameters, got {raw!r}")
    what = f'parameter of policy "{cls.name}"'
    for key in raw:
        if key not in known:
            fix = f"Known parameters: {', '.join(sorted(known))}" if known else f'Policy "{cls.name}" takes no parameters'
            raise recipe_error(file, line_of(raw, key), f"{path}.{key}", f"unknown {what}{did_you_mean(str(key), known)}", fix)
    try:
        hints = typing.get_type_hints(cls.Params)
    except Exception:  # unresolvable annotations in a plugin: skip type checks
        hints = {}
    values = {}
    for key, value in raw.items():
        tp = hints.get(key, Any)
        if not type_ok(value, tp):
            fix = "Write it as a number with a dot, e.g. 1.0e-3" if tp is float and isinstance(value, str) else ""
            raise recipe_error(file, line_of(raw, key), f"{path}.{key}",
                               f"expected {getattr(tp, '__name__', str(tp))}, got {type(value).__name__} {value!r}", fix)
        values[key] = float(value) if tp is float else tuple(value) if isinstance(value, list) else value
    try:
        params = dataclasses.replace(base, **values) if base is not None else cls.Params(**values)
        validate = getattr(params, "validate", None)
        if callable(validate):
            validate()
    except (ValueError, TypeError) as exc:
        raise recipe_error(file, line, path, f'invalid parameters for policy "{cls.name}": {exc}') from None
    return params

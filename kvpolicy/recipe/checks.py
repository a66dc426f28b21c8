"""Reading a recipe's YAML with its line numbers, and the checks that report against them.

Every error names the file, line and key path, the problem and the fix (`recipe_error`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from ..errors import RecipeError, did_you_mean


class _Map(dict):
    """A YAML mapping that remembers its own line and the line of each key (1-based)."""

    line: int | None = None
    lines: dict[Any, int]


#: What reading one recipe may cost: a recipe is a few KB (a per-head profile of a large model, a few hundred
#: KB); past these bounds a file is a mistake or an attack (nested aliases that expand a 360-byte file to GBs).
MAX_RECIPE_BYTES = 4 << 20
MAX_RECIPE_DEPTH = 32  # nested mappings and lists
MAX_RECIPE_NODES = 200_000  # YAML values, counted with every alias expanded
#: Integers and floats a recipe may give: far past any model's context, and well inside int64 arithmetic.
MAX_NUMBER = 2**53
#: How much of a value an error message quotes.
MAX_QUOTE = 80


class LineLoader(yaml.SafeLoader):
    """A safe YAML loader whose mappings remember their lines (`line_of`) and refuse duplicate keys."""


def _construct_map(loader: LineLoader, node: yaml.MappingNode) -> _Map:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # "<<: *base" merges keys that the mapping's own keys may override
        key = loader.construct_object(key_node)
        if isinstance(key, (str, int, float, bool)) and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {quote(key)} (first on line {seen[key]}): give each key once",
                key_node.start_mark)
        if isinstance(key, (str, int, float, bool)):
            seen[key] = key_node.start_mark.line + 1
    data = _Map(loader.construct_mapping(node, deep=True))  # also flattens merge keys ("<<")
    data.line = node.start_mark.line + 1
    data.lines = {loader.construct_object(k): k.start_mark.line + 1 for k, _ in node.value}
    return data


LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)


def read_yaml(path: Path) -> Any:
    """A recipe file's YAML, within `MAX_RECIPE_BYTES`, depth and expanded size; errors name the file and line."""
    file = str(path)
    try:
        size = path.stat().st_size
        if size > MAX_RECIPE_BYTES:
            raise RecipeError(f"{file}: the recipe is {size:,} bytes, more than the {MAX_RECIPE_BYTES:,} a recipe may be. "
                              "Check that this is the recipe you meant; split per-head rules by layer ranges")
        raw = path.read_bytes()
    except OSError as exc:
        raise RecipeError(f"{file}: cannot read recipe: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff")
        raise RecipeError(f"{file}: the recipe is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
                          f"{': it looks like UTF-16' if utf16 else ''}. Save it as UTF-8") from None
    try:
        _check_shape(text, file)
        loader = LineLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None and _expanded_size(node) > MAX_RECIPE_NODES:
                raise RecipeError(f"{file}: the recipe expands to more than {MAX_RECIPE_NODES:,} values (aliases "
                                  "counted each time they are used). Write the values out, or use fewer nested aliases")
            return loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = " ".join(str(p) for p in (getattr(exc, "context", None), getattr(exc, "problem", None)) if p)
        duplicate = isinstance(exc, yaml.constructor.ConstructorError) and "duplicate key" in problem
        raise recipe_error(file, mark.line + 1 if mark else None, "YAML",
                           problem if duplicate else f"invalid YAML: {problem or exc}",
                           "" if duplicate else "Check the indentation, colons and quotes around this line") from None


def _check_shape(text: str, file: str) -> None:
    """Refuse nesting deeper than `MAX_RECIPE_DEPTH` from the event stream, before anything recurses over it."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_RECIPE_DEPTH:
                raise recipe_error(file, event.start_mark.line + 1, "YAML", f"nested more than {MAX_RECIPE_DEPTH} deep",
                                   "A recipe nests a few levels (rules, budgets, params)")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _expanded_size(root: yaml.Node) -> int:
    """Values under ``root`` with every alias expanded, computed once per node (shared nodes are aliases)."""
    sizes: dict[int, int] = {}
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        children = [] if isinstance(node, yaml.ScalarNode) else [
            c for pair in node.value for c in (pair if isinstance(pair, tuple) else (pair,))]
        if done or not children:
            sizes[id(node)] = min(1 + sum(sizes[id(c)] for c in children), MAX_RECIPE_NODES + 1)
        else:
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


def quote(value: Any) -> str:
    """``repr(value)``, cut to `MAX_QUOTE` characters (error messages never quote a whole large value)."""
    if isinstance(value, (dict, list, tuple)) and len(value) > MAX_QUOTE:
        return f"<{type(value).__name__} of {len(value)} items>"
    text = repr(value)
    return text if len(text) <= MAX_QUOTE else text[: MAX_QUOTE - 3] + "..."


def number_hint(value: Any) -> str:
    """Why a number a recipe gave is refused, as the fix to write; "" when it is not about the number."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return ""
        return "Write it as a number with a dot, e.g. 1.0e-3 (YAML reads 1e-3 without a dot as text)"
    if isinstance(value, bool):
        return "Give a number, not true/false"
    if isinstance(value, float) and not math.isfinite(value):
        return "Give a finite number (not .inf or .nan)"
    if isinstance(value, (int, float)) and abs(value) > MAX_NUMBER:
        return f"Numbers in a recipe are at most 2**53 = {MAX_NUMBER:,}"
    return ""


def line_of(mapping: Any, key: Any = None) -> int | None:
    lines = getattr(mapping, "lines", {})
    return lines[key] if key in lines else getattr(mapping, "line", None)


def recipe_error(file: str, line: int | None, path: str, problem: str, fix: str = "") -> RecipeError:
    where = f"{file}:{line}" if line else file
    if len(problem) > 4 * MAX_QUOTE:
        problem = problem[: 4 * MAX_QUOTE - 3] + "..."
    return RecipeError(f"{where}: {path}: {problem}." + (f" {fix}" if fix else ""))


def check_keys(mapping: Any, known: tuple[str, ...], path: str, file: str, line: int | None = None) -> None:
    if not isinstance(mapping, dict):
        raise recipe_error(file, line, path.rstrip(".") or "recipe", f"expected a mapping, got {quote(mapping)}")
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
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
            abs(value) <= MAX_NUMBER)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_NUMBER
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
        raise recipe_error(file, line, path, f"expected a mapping of parameters, got {quote(raw)}")
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
            raise recipe_error(file, line_of(raw, key), f"{path}.{key}",
                               f"expected {getattr(tp, '__name__', str(tp))}, got {type(value).__name__} {quote(value)}",
                               number_hint(value) if tp in (int, float) else "")
        values[key] = float(value) if tp is float else tuple(value) if isinstance(value, list) else value
    try:
        params = dataclasses.replace(base, **values) if base is not None else cls.Params(**values)
        validate = getattr(params, "validate", None)
        if callable(validate):
            validate()
    except (ValueError, TypeError) as exc:
        raise recipe_error(file, line, path, f'invalid parameters for policy "{cls.name}": {exc}') from None
    except Exception as exc:  # a plugin's validate may raise anything: name the policy, never a traceback
        raise recipe_error(file, line, path, f'policy "{cls.name}" failed to check its parameters '
                           f"({type(exc).__name__}: {exc})", "This is a bug in the policy's Params.validate: "
                           "it should raise ValueError with the reason") from None
    return params

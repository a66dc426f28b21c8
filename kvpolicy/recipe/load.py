"""Loading a recipe: a YAML file, a built-in recipe's name or a mapping, checked into a `Recipe`.

Every error names the file, line and key path, the problem and the fix (docs/recipe-reference.md lists
every key). The parts: the schema's keys and defaults (`schema`), reading YAML with its lines and
checking keys, types and params (`checks`), budgets (`budget_yaml`), layer/head selectors (`selectors`);
`Recipe.resolve` (`resolve`) makes the `Plan` for a model's shape.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import KVPolicyError, RecipeError, did_you_mean
from ..registry import Registry, get_registry
from .budget import UNBOUNDED, Budget
from .budget_yaml import read_budget
from .checks import build_params, check_keys, line_of, quote, read_yaml, recipe_error
from .plan import Plan
from .resolve import Cell, Rule, resolve_layers
from .schema import BACKEND_NAMES, DEFAULTS, RULE_KEYS, RULES, SCHEMA_VERSION, TOP_KEYS
from .selectors import read_selector

_DIRS = (Path(__file__).parent.parent / "recipes_builtin", Path(__file__).parent.parent.parent / "recipes")


@dataclass(frozen=True)
class Recipe:
    """A validated recipe; `resolve` turns it into a `Plan` for a model's shape."""

    name: str
    description: str
    source: str
    budget: Budget
    backend: str = "auto"
    _file: str = field(default="<dict>", repr=False)
    _default: Cell = field(default=None, repr=False)  # the recipe's policy and params, before any rule
    _rules: tuple[Rule, ...] = field(default=(), repr=False)

    @property
    def policy(self) -> type:
        """The recipe's top-level policy class (what its rules start from)."""
        return self._default.policy

    def resolve(self, num_layers: int, num_kv_heads: int) -> Plan:
        """The `Plan` for a model of ``num_layers`` decoder layers and ``num_kv_heads`` KV heads."""
        start = dataclasses.replace(self._default, budget=self.budget)
        layers, notes = resolve_layers(start, self._rules, num_layers, num_kv_heads, self._file)
        return Plan(name=self.name, layers=layers, backend=self.backend, source=self.source,
                    description=self.description, extra={"notes": notes})


def builtin_recipe_names() -> list[str]:
    return sorted({p.stem for d in _DIRS if d.is_dir() for p in (*d.glob("*.yaml"), *d.glob("*.yml"))})


def _find(source: str | os.PathLike) -> tuple[Path, str]:
    """(file, source label) for a path or a built-in recipe name."""
    text = os.fspath(source)
    path = Path(text)
    looks_like_path = path.suffix in (".yaml", ".yml") or os.sep in text or "/" in text
    if not looks_like_path:
        for folder in _DIRS:
            for suffix in (".yaml", ".yml"):
                if (folder / f"{text}{suffix}").is_file():
                    return folder / f"{text}{suffix}", f"<builtin:{text}>"
    if path.is_file():
        return path, text
    names = builtin_recipe_names()
    hint = "" if looks_like_path else did_you_mean(text, names)
    raise RecipeError(f"{text}: no such recipe file, and not a built-in recipe{hint}. "
                      f"Built-in recipes: {', '.join(names)}")


def load_recipe(source: str | os.PathLike | dict, registry: Registry | None = None) -> Recipe:
    """Load and validate a recipe from a YAML file, a built-in recipe name or an already-parsed dict."""
    registry = registry or get_registry()
    if isinstance(source, dict):
        data, file, label, stem = source, "<dict>", "<dict>", "recipe"
    else:
        path, label = _find(source)
        file, stem = str(path), path.stem
        data = read_yaml(path)
    if not isinstance(data, dict):
        raise recipe_error(file, line_of(data), "recipe", f"the top level must be a mapping, got {type(data).__name__}",
                           f"Start the file with `kvpolicy: {SCHEMA_VERSION}` and the recipe's keys")
    check_keys(data, TOP_KEYS, "", file)
    version = data.get("kvpolicy")
    if type(version) is not int or version != SCHEMA_VERSION:  # `true` is no version, though True == 1
        problem = "missing schema version" if "kvpolicy" not in data else f"unsupported schema version {quote(version)}"
        raise recipe_error(file, line_of(data, "kvpolicy"), "kvpolicy", problem,
                           f"This kvpolicy reads schema version {SCHEMA_VERSION}: write `kvpolicy: {SCHEMA_VERSION}`")
    for key in ("name", "description"):
        if key in data and not isinstance(data[key], str):
            raise recipe_error(file, line_of(data, key), key, f"expected a string, got {quote(data[key])}")
    backend = data.get("backend", DEFAULTS["top", "backend"])
    if backend not in BACKEND_NAMES:
        raise recipe_error(file, line_of(data, "backend"), "backend", f"unknown backend {quote(backend)}"
                           f"{did_you_mean(str(backend), BACKEND_NAMES)}", f"Use one of: {', '.join(BACKEND_NAMES)}")

    def policy(raw: Any, path: str, line: int | None) -> Any:
        if not isinstance(raw, str):
            raise recipe_error(file, line, path, f"expected a policy name, got {quote(raw)}", f"Available: {', '.join(registry.names())}")
        try:
            return registry.get(raw)
        except KVPolicyError as exc:
            raise RecipeError(f"{file}:{line}: {path}: {exc}" if line else f"{file}: {path}: {exc}") from None

    cls = policy(data.get("policy", DEFAULTS["top", "policy"]), "policy", line_of(data, "policy"))
    params = build_params(cls, data.get("params") or {}, None, "params", file, line_of(data, "params"))
    budget = read_budget(data["budget"], "budget", file, line_of(data, "budget")) if "budget" in data else UNBOUNDED
    rules = []
    for kind in ("layers", "heads"):
        raw_rules = data.get(kind) or []
        if not isinstance(raw_rules, list):
            raise recipe_error(file, line_of(data, kind), kind, f"expected a list of rules, got {quote(raw_rules)}",
                               f'E.g. {kind}: [{{layers: "0-1", policy: full}}]')
        for index, raw in enumerate(raw_rules):
            path = f"{kind}[{index}]"
            check_keys(raw, RULE_KEYS[kind], f"{path}.", file, line_of(data, kind))
            line = line_of(raw)
            need = "heads" if kind == "heads" else "layers"
            if need not in raw:
                raise recipe_error(file, line, path, f"a {kind[:-1]} rule needs `{need}`", f'E.g. {need}: "0-1"')
            rule_cls = policy(raw["policy"], f"{path}.policy", line_of(raw, "policy")) if "policy" in raw else None
            fresh = rule_cls and build_params(rule_cls, raw.get("params") or {}, None, f"{path}.params", file,
                                              line_of(raw, "params"))
            rules.append(Rule(
                path, line,
                read_selector(raw.get("layers", RULES["heads"][0].default), f"{path}.layers", file, line_of(raw, "layers")),
                read_selector(raw["heads"], f"{path}.heads", file, line_of(raw, "heads")) if kind == "heads" else None,
                rule_cls, raw.get("params"), fresh,
                read_budget(raw["budget"], f"{path}.budget", file, line_of(raw, "budget"), rule=True) if "budget" in raw else None))
    return Recipe(name=data.get("name", stem), description=data.get("description", DEFAULTS["top", "description"]),
                  source=label,
                  budget=budget, backend=backend, _file=file, _default=Cell(cls, params, budget, line_of(data, "policy")),
                  _rules=tuple(rules))


def with_budget(recipe: Recipe, budget: Budget) -> Recipe:
    """A copy of ``recipe`` with its top-level budget replaced (rules with their own budget keep theirs).

    The recipe's precision tiers, slack, alignment, threshold and layer schedule stay unless ``budget`` gives its own
    (a slack or an alignment above 0): a sweep over amounts keeps each recipe's way of spending them (Scissorhands drops 16 tokens at once,
    h2o-mixed moves 16 down a tier at once, a threshold recipe keeps what clears its threshold, at every amount)."""
    if not isinstance(budget, Budget):
        raise TypeError(f"expected a kvpolicy.Budget, got {budget!r}")
    if not budget.tiers and recipe.budget is not None and recipe.budget.tiers:
        budget = dataclasses.replace(budget, tiers=recipe.budget.tiers)
    if not budget.slack and recipe.budget is not None and recipe.budget.slack:
        budget = dataclasses.replace(budget, slack=recipe.budget.slack)
    if not budget.align and recipe.budget is not None and recipe.budget.align:
        budget = dataclasses.replace(budget, align=recipe.budget.align)
    if budget.threshold is None and recipe.budget is not None and recipe.budget.threshold is not None:
        if budget.memory is not None:
            raise KVPolicyError(f"recipe {recipe.name!r} keeps tokens above a threshold, which a budget in bytes "
                                "cannot size: give it a budget in tokens or as a ratio of the prompt")
        budget = dataclasses.replace(budget, threshold=recipe.budget.threshold)
    if budget.schedule is None and recipe.budget is not None and recipe.budget.schedule is not None:
        budget = dataclasses.replace(budget, schedule=recipe.budget.schedule)
    return dataclasses.replace(recipe, budget=budget)

"""Recipes: YAML -> validated `Recipe` -> `Plan` for a given model shape (DESIGN.md, "Recipes (YAML)").

Every error names the file, line and key path, the problem and the fix. The parts: the schema's keys and
defaults (`recipe_schema`), reading YAML with its lines and checking keys, types and params
(`recipe_checks`), budgets and their schedules (`recipe_budgets`), layer/head selectors (`recipe_selectors`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import KVPolicyError, RecipeError, did_you_mean
from .plan import BACKEND_NAMES, BY_POLICY, UNBOUNDED, Budget, HeadPlan, LayerPlan, Plan
from .recipe_budgets import Schedule, budget_amount, read_budget, scale_budget
from .recipe_checks import build_params, check_keys, line_of, quote, read_yaml, recipe_error
from .recipe_schema import DEFAULTS, RULE_KEYS, RULES, SCHEMA_VERSION, TOP_KEYS
from .recipe_selectors import Selector, read_selector, spans_text
from .registry import Registry, get_registry

_DIRS = (Path(__file__).parent / "recipes_builtin", Path(__file__).parent.parent / "recipes")


def _takes_budget(cls: type) -> bool:
    """True if a recipe's budget applies to heads of policy ``cls``: it evicts and does not size its heads
    itself (FastGen's ``dynamic_budget``)."""
    return cls.evicts and not cls.dynamic_budget


@dataclass(frozen=True)
class _Rule:
    path: str
    line: int | None
    layers: Selector
    heads: Selector | None
    policy: Any  # policy class, or None to keep the current one
    params: Any  # raw params mapping or None
    fresh: Any  # params for a cell switching to `policy`
    budget: tuple[Budget, bool, Schedule | None] | None


@dataclass(frozen=True)
class Recipe:
    """A validated recipe; `resolve` turns it into a `Plan` for a model's shape."""

    name: str
    description: str
    source: str
    budget: Budget
    backend: str = "auto"
    schedule: Schedule | None = None  # how the top-level budget is spread over layers
    _file: str = field(default="<dict>", repr=False)
    _default: tuple[Any, Any, int | None] = field(default=None, repr=False)  # (policy class, params, line)
    _rules: tuple[_Rule, ...] = field(default=(), repr=False)

    def resolve(self, num_layers: int, num_kv_heads: int) -> Plan:
        cls, params, line = self._default
        # a cell: (policy class, params, (amount or None for the top-level budget, schedule, owner), line)
        grid = [[(cls, params, (None, self.schedule, "budget"), line)] * num_kv_heads for _ in range(num_layers)]
        for rule in self._rules:  # layer rules come first, so head rules win over them
            for layer in rule.layers.indices(num_layers, "layer", self._file, rule.line, f"{rule.path}.layers"):
                heads = range(num_kv_heads) if rule.heads is None else rule.heads.indices(
                    num_kv_heads, "KV head", self._file, rule.line, f"{rule.path}.heads")
                for head in heads:
                    grid[layer][head] = self._apply(rule, grid[layer][head])
        notes = self._schedule_budgets(grid)
        return Plan(name=self.name, layers=[LayerPlan([self._head(c) for c in row]) for row in grid],
                    backend=self.backend, source=self.source, description=self.description, extra={"notes": notes})

    def _schedule_budgets(self, grid: list[list[tuple]]) -> list[str]:
        """Replace each scheduled budget by its per-layer share, over the layers whose heads take that budget."""
        owners: dict[str, tuple[Schedule, list[int]]] = {}
        for index, row in enumerate(grid):
            for cls, _, (_, schedule, owner), _ in row:
                if schedule is not None and _takes_budget(cls):
                    layers = owners.setdefault(owner, (schedule, []))[1]
                    if not layers or layers[-1] != index:
                        layers.append(index)
        notes = []
        for owner, (schedule, layers) in owners.items():
            amount = next(b for cls, _, (b, _, o), _ in grid[layers[0]] if o == owner and _takes_budget(cls)) or self.budget
            if not amount.is_limited:
                continue  # no amount to spread: `_head` reports the missing budget
            shares = dict(zip(layers, scale_budget(amount, schedule.multipliers(len(layers), self._file)), strict=True))
            for index in layers:
                grid[index] = [(c, p, (shares[index], None, o), ln) if o == owner else (c, p, (b, s, o), ln)
                               for c, p, (b, s, o), ln in grid[index]]
            low, high = min(shares.values(), key=budget_amount), max(shares.values(), key=budget_amount)
            notes.append(f"{owner}: {schedule.describe()} over layers {spans_text(layers)}: "
                         f"{low.describe()} to {high.describe()}, mean {amount.describe()}")
        return notes

    def _apply(self, rule: _Rule, cell: tuple) -> tuple:
        cls, params, budget, _ = cell
        if rule.policy is not None and rule.policy is not cls:
            cls, params = rule.policy, rule.fresh
        elif rule.params is not None:
            params = build_params(cls, rule.params, params, f"{rule.path}.params", self._file, line_of(rule.params))
        if rule.budget is not None:
            amount, slack_given, schedule = rule.budget
            if not amount.is_limited:  # only a schedule (and tiers): the top-level amount
                amount = dataclasses.replace(self.budget, slack=amount.slack if slack_given else self.budget.slack,
                                             tiers=amount.tiers or self.budget.tiers)
            elif not slack_given:
                amount = dataclasses.replace(amount, slack=self.budget.slack)
            budget = (amount, schedule, f"{rule.path}.budget" if schedule is not None else None)
        return cls, params, budget, rule.line

    def _head(self, cell: tuple) -> HeadPlan:
        cls, params, (budget, _, _), line = cell
        budget = budget or self.budget
        if cls.dynamic_budget:
            budget = BY_POLICY  # the policy sizes its cells itself (FastGen); a recipe budget does not apply
        elif not cls.evicts:
            # kept whole, at its precisions; with tiers the slack still amortizes moving tokens down a tier,
            # without them there is nothing to amortize
            budget = (dataclasses.replace(UNBOUNDED, tiers=budget.tiers, slack=budget.slack)
                      if budget and budget.tiers else UNBOUNDED)
        elif not budget.is_limited:
            raise recipe_error(self._file, line, "budget", f'policy "{cls.name}" evicts tokens but has no budget',
                               "Add e.g. budget: {ratio: 0.2} at the top level or to this rule")
        return HeadPlan(cls.name, params, budget)


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
    budget, _, schedule = read_budget(data["budget"], "budget", file, line_of(data, "budget")) if "budget" in data else (
        UNBOUNDED, False, None)
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
            rules.append(_Rule(
                path, line,
                read_selector(raw.get("layers", RULES["heads"][0].default), f"{path}.layers", file, line_of(raw, "layers")),
                read_selector(raw["heads"], f"{path}.heads", file, line_of(raw, "heads")) if kind == "heads" else None,
                rule_cls, raw.get("params"), fresh,
                read_budget(raw["budget"], f"{path}.budget", file, line_of(raw, "budget"), rule=True) if "budget" in raw else None))
    return Recipe(name=data.get("name", stem), description=data.get("description", DEFAULTS["top", "description"]),
                  source=label,
                  budget=budget, backend=backend, schedule=schedule, _file=file, _default=(cls, params, line_of(data, "policy")),
                  _rules=tuple(rules))


def with_budget(recipe: Recipe, budget: Budget) -> Recipe:
    """A copy of ``recipe`` with its top-level budget replaced (rules with their own budget keep theirs).

    The recipe's precision tiers and slack stay unless ``budget`` gives its own (a slack above 0): a
    sweep over amounts keeps each recipe's way of spending them (Scissorhands drops 16 tokens at once,
    h2o-mixed moves 16 down a tier at once, at every amount)."""
    if not isinstance(budget, Budget):
        raise TypeError(f"expected a kvpolicy.plan.Budget, got {budget!r}")
    if not budget.tiers and recipe.budget is not None and recipe.budget.tiers:
        budget = dataclasses.replace(budget, tiers=recipe.budget.tiers)
    if not budget.slack and recipe.budget is not None and recipe.budget.slack:
        budget = dataclasses.replace(budget, slack=recipe.budget.slack)
    return dataclasses.replace(recipe, budget=budget)

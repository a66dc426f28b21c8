"""Recipes: YAML -> validated `Recipe` -> `Plan` for a given model shape (DESIGN.md, "Recipes (YAML)").

Every error names the file, line and key path, the problem and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import KVPolicyError, RecipeError, did_you_mean
from .plan import BACKEND_NAMES, BY_POLICY, UNBOUNDED, Budget, HeadPlan, LayerPlan, Plan
from .registry import Registry, get_registry

SCHEMA_VERSION = 1
REQUIRED = "(required)"  # the default of a key that has none


@dataclass(frozen=True)
class Key:
    """One recipe key: the validator reads its name and default from here, the docs all of it."""

    name: str
    kind: str  # what the value is, in words
    default: Any  # what the validator uses when the key is absent (or REQUIRED)
    doc: str
    default_doc: str = ""  # the default in words, when it is not a plain value


SELECTOR = 'an index (3, "-1"), a range ("0-1", "2-"), a list ("0,2,5-7" or [0, 2]) or "all"'
#: Layer budget schedules (the ``schedule`` budget key) and what each does with a mean budget b.
SCHEDULE_DOCS = {
    "uniform": "every layer gets b",
    "pyramid": "falls linearly with depth, from 2b - b/beta at the lowest layer to b/beta at the top (PyramidKV)",
    "funnel": "the mirror of pyramid: rises with depth (Scissorhands: later layers need more)",
}
SCHEDULES = tuple(SCHEDULE_DOCS)

#: The recipe schema (version SCHEMA_VERSION): top-level keys, layer/head rule keys, budget keys.
TOP_LEVEL = (
    Key("kvpolicy", "integer", REQUIRED, f"schema version; this kvpolicy reads {SCHEMA_VERSION}"),
    Key("name", "string", None, "the recipe's name in plans, tables and plots", "the file name without .yaml"),
    Key("description", "string", "", "one line shown by `kvpolicy recipes` and `kvpolicy validate`"),
    Key("budget", "budget mapping", None, "tokens each (layer, KV head) keeps; see the budget keys",
        "none: unbounded (only `full` may run without a budget)"),
    Key("policy", "policy name", "full", "the policy of every layer and KV head that no rule changes"),
    Key("params", "mapping", {}, "parameters of `policy` (see the policy's parameters); omitted ones take "
        "their defaults"),
    Key("backend", f"one of {', '.join(BACKEND_NAMES)}", "auto", "attention backend for statistics: `auto` picks "
        "triton on CUDA and torch elsewhere; $KVPOLICY_BACKEND overrides it"),
    Key("layers", "list of layer rules", [], "per-layer changes, applied in order (later rules win)"),
    Key("heads", "list of head rules", [], "per-KV-head changes, applied after every layer rule"),
)
_RULE_POLICY = Key("policy", "policy name", None, "switch these cells to another policy (its params start from "
                   "its defaults)", "keep the current policy")
_RULE_PARAMS = Key("params", "mapping", None, "parameters, over the current ones when the policy is unchanged, "
                   "over the new policy's defaults when `policy` switches it", "keep the current params")
_RULE_BUDGET = Key("budget", "budget mapping", None, "a budget of their own for these cells; may give only a "
                   "schedule, which then spreads the top-level amount over the rule's layers",
                   "keep the current budget")
RULES = {
    "layers": (
        Key("layers", "layer selector", REQUIRED, f"the layers the rule applies to: {SELECTOR}"),
        _RULE_POLICY, _RULE_PARAMS, _RULE_BUDGET,
    ),
    "heads": (
        Key("layers", "layer selector", "all", f"the layers: {SELECTOR}"),
        Key("heads", "KV head selector", REQUIRED, f"the KV heads of those layers: {SELECTOR}"),
        _RULE_POLICY, _RULE_PARAMS, _RULE_BUDGET,
    ),
}
BUDGET = (
    Key("ratio", "number in (0, 1]", None, "share of each row's prompt (its real tokens) to keep; give exactly "
        "one of ratio and tokens", "required: one of ratio, tokens"),
    Key("tokens", "integer >= 1", None, "tokens to keep; give exactly one of ratio and tokens",
        "required: one of ratio, tokens"),
    Key("slack", "integer >= 0", 0, "tokens a head may go over budget before one compaction drops them all "
        "(amortized eviction: fewer compactions, up to `slack` tokens more memory)"),
    Key("schedule", f"one of {', '.join(SCHEDULES)}", "uniform", "how the budget is spread over the layers "
        "that use it; the mean layer budget stays the budget"),
    Key("beta", "number >= 1", 20.0, "steepness of pyramid and funnel: the smallest layer budget is "
        "budget/beta"),
    Key("per_layer", "list of positive numbers", None, "one multiplier per layer that uses this budget, in "
        "depth order, averaging 1; excludes `schedule`"),
)
TOP_KEYS = tuple(key.name for key in TOP_LEVEL)
RULE_KEYS = {kind: tuple(key.name for key in keys) for kind, keys in RULES.items()}
BUDGET_KEYS = tuple(key.name for key in BUDGET)
_DEFAULT = {("top", k.name): k.default for k in TOP_LEVEL} | {("budget", k.name): k.default for k in BUDGET}
_DIRS = (Path(__file__).parent / "recipes_builtin", Path(__file__).parent.parent / "recipes")


class _Map(dict):
    """A YAML mapping that remembers its own line and the line of each key (1-based)."""

    line: int | None = None
    lines: dict[Any, int]


class _Loader(yaml.SafeLoader):
    pass


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> _Map:
    data = _Map(loader.construct_mapping(node, deep=True))  # also flattens merge keys ("<<")
    data.line = node.start_mark.line + 1
    data.lines = {loader.construct_object(k): k.start_mark.line + 1 for k, _ in node.value}
    return data


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)


def _takes_budget(cls: type) -> bool:
    """True if a recipe's budget applies to heads of policy ``cls``: it evicts and does not size its heads
    itself (FastGen's ``dynamic_budget``)."""
    return cls.evicts and not cls.dynamic_budget


def _line(mapping: Any, key: Any = None) -> int | None:
    lines = getattr(mapping, "lines", {})
    return lines[key] if key in lines else getattr(mapping, "line", None)


def _error(file: str, line: int | None, path: str, problem: str, fix: str = "") -> RecipeError:
    where = f"{file}:{line}" if line else file
    return RecipeError(f"{where}: {path}: {problem}." + (f" {fix}" if fix else ""))


def _check_keys(mapping: Any, known: tuple[str, ...], path: str, file: str, line: int | None = None) -> None:
    if not isinstance(mapping, dict):
        raise _error(file, line, path.rstrip(".") or "recipe", f"expected a mapping, got {mapping!r}")
    for key in mapping:
        if key not in known:
            raise _error(file, _line(mapping, key), f"{path}{key}", f"unknown key{did_you_mean(str(key), known)}",
                         f"Known keys: {', '.join(sorted(known))}")


def _type_ok(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(tp))
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


def _build_params(cls: Any, raw: Any, base: Any, path: str, file: str, line: int | None) -> Any:
    """A ``cls.Params`` instance: ``raw`` (a YAML mapping) over ``base`` (or the defaults), validated."""
    known = tuple(cls.param_fields())
    if not isinstance(raw, dict):
        raise _error(file, line, path, f"expected a mapping of parameters, got {raw!r}")
    what = f'parameter of policy "{cls.name}"'
    for key in raw:
        if key not in known:
            fix = f"Known parameters: {', '.join(sorted(known))}" if known else f'Policy "{cls.name}" takes no parameters'
            raise _error(file, _line(raw, key), f"{path}.{key}", f"unknown {what}{did_you_mean(str(key), known)}", fix)
    try:
        hints = typing.get_type_hints(cls.Params)
    except Exception:  # unresolvable annotations in a plugin: skip type checks
        hints = {}
    values = {}
    for key, value in raw.items():
        tp = hints.get(key, Any)
        if not _type_ok(value, tp):
            fix = "Write it as a number with a dot, e.g. 1.0e-3" if tp is float and isinstance(value, str) else ""
            raise _error(file, _line(raw, key), f"{path}.{key}",
                         f"expected {getattr(tp, '__name__', str(tp))}, got {type(value).__name__} {value!r}", fix)
        values[key] = float(value) if tp is float else tuple(value) if isinstance(value, list) else value
    try:
        params = dataclasses.replace(base, **values) if base is not None else cls.Params(**values)
        validate = getattr(params, "validate", None)
        if callable(validate):
            validate()
    except (ValueError, TypeError) as exc:
        raise _error(file, line, path, f'invalid parameters for policy "{cls.name}": {exc}') from None
    return params


@dataclass(frozen=True)
class Schedule:
    """How a budget is spread over the layers that use it; the mean over those layers is the budget.

    ``pyramid`` (PyramidKV, Cai et al. 2024): falls linearly with depth, from 2b - b/beta at
    the lowest layer to b/beta at the top. ``funnel``: the mirror, rising with depth (as
    Scissorhands suggests: later layers need more). ``per_layer``: one multiplier per layer,
    averaging to 1. Token budgets are rounded so that their sum is exact; ratio budgets are
    scaled (each layer then rounds its own count up, so the mean may exceed b by < 1 token).
    """

    kind: str = _DEFAULT["budget", "schedule"]
    beta: float = _DEFAULT["budget", "beta"]
    per_layer: tuple[float, ...] | None = None
    path: str = "budget"
    line: int | None = None

    def multipliers(self, count: int, file: str) -> list[float]:
        if self.per_layer is not None:
            if len(self.per_layer) != count:
                raise _error(file, self.line, f"{self.path}.per_layer",
                             f"{len(self.per_layer)} multipliers for {count} layers that use this budget",
                             "Give one multiplier per such layer, in depth order")
            return list(self.per_layer)
        if self.kind == "uniform" or count == 1:
            return [1.0] * count
        top, bottom = 1.0 / self.beta, 2.0 - 1.0 / self.beta
        falling = [bottom - (bottom - top) * index / (count - 1) for index in range(count)]
        return falling if self.kind == "pyramid" else falling[::-1]

    def describe(self) -> str:
        if self.per_layer is not None:
            return "per_layer multipliers"
        return self.kind if self.kind == "uniform" else f"{self.kind} (beta={self.beta:g})"


def _scaled(budget: Budget, multipliers: list[float]) -> list[Budget]:
    """``budget`` times each multiplier; token counts by largest remainder (ties: the lower layer), summing exactly."""
    if budget.tokens is None:
        return [dataclasses.replace(budget, ratio=budget.ratio * m) for m in multipliers]
    exact = [budget.tokens * m for m in multipliers]
    tokens = [int(x) for x in exact]
    for index in sorted(range(len(exact)), key=lambda i: round(tokens[i] - exact[i], 9))[: round(sum(exact)) - sum(tokens)]:
        tokens[index] += 1
    for index in range(len(tokens)):
        while tokens[index] < 1:  # keep at least one token: take it from the largest layer
            tokens[index] += 1
            tokens[max(range(len(tokens)), key=tokens.__getitem__)] -= 1
    return [dataclasses.replace(budget, tokens=t) for t in tokens]


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    spans: list[list[int]] = []
    for index in indices:
        if spans and index == spans[-1][1] + 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _amount(budget: Budget) -> float:
    return budget.tokens if budget.tokens is not None else budget.ratio


def _schedule(raw: Any, path: str, file: str) -> Schedule | None:
    if not any(k in raw for k in ("schedule", "beta", "per_layer")):
        return None
    kind, line = raw.get("schedule", _DEFAULT["budget", "schedule"]), _line(raw)
    if kind not in SCHEDULES:
        raise _error(file, _line(raw, "schedule"), f"{path}.schedule", f"unknown schedule {kind!r}"
                     f"{did_you_mean(str(kind), SCHEDULES)}", f"Use one of: {', '.join(SCHEDULES)}, or per_layer: [...]")
    beta = raw.get("beta", _DEFAULT["budget", "beta"])
    if "beta" in raw and kind not in ("pyramid", "funnel"):
        raise _error(file, _line(raw, "beta"), f"{path}.beta", f"beta only applies to schedule pyramid or funnel, "
                     f"not {kind}", "E.g. budget: {ratio: 0.2, schedule: pyramid, beta: 20}")
    if not (_type_ok(beta, float) and beta >= 1):
        raise _error(file, _line(raw, "beta"), f"{path}.beta", f"must be a number >= 1, got {beta!r}",
                     "The top layer gets budget/beta and the bottom one 2*budget - budget/beta (PyramidKV: 20)")
    per_layer = raw.get("per_layer")
    if per_layer is not None:
        where = (file, _line(raw, "per_layer"), f"{path}.per_layer")
        if kind != "uniform":
            raise _error(*where, f"per_layer and schedule: {kind} exclude each other", "Give one of them")
        if not (isinstance(per_layer, list) and per_layer and all(_type_ok(m, float) and m > 0 for m in per_layer)):
            raise _error(*where, f"expected a list of positive multipliers, got {per_layer!r}",
                         "E.g. per_layer: [1.5, 1.0, 0.5]: layer budgets as multiples of the budget, averaging 1")
        average = sum(per_layer) / len(per_layer)
        if abs(average - 1.0) > 1e-6:
            raise _error(*where, f"the multipliers average {average:.6g}, not 1",
                         "They scale the budget per layer, so the mean layer budget stays the recipe's budget")
        per_layer = tuple(float(m) for m in per_layer)
    return Schedule(kind, float(beta), per_layer, path, line)


def _budget(raw: Any, path: str, file: str, line: int | None, rule: bool = False) -> tuple[Budget, bool, Schedule | None]:
    """(Budget, whether slack was given, schedule).

    A rule's budget may give only a schedule: its Budget then has neither ratio nor tokens,
    and the rule's layers share the top-level amount.
    """
    _check_keys(raw, BUDGET_KEYS, f"{path}.", file, line)
    schedule = _schedule(raw, path, file)
    given = [k for k in ("ratio", "tokens") if k in raw]
    if rule and not given and schedule is not None:
        slack = raw.get("slack", _DEFAULT["budget", "slack"])
        if not (_type_ok(slack, int) and slack >= 0):
            raise _error(file, _line(raw, "slack"), f"{path}.slack", f"must be an integer >= 0, got {slack!r}")
        return Budget(slack=slack), "slack" in raw, schedule
    if len(given) != 1:
        problem = "give exactly one of ratio/tokens" + (", not both" if given else "")
        raise _error(file, _line(raw), path, problem, "E.g. budget: {ratio: 0.2} or budget: {tokens: 512}")
    ratio, tokens, slack = raw.get("ratio"), raw.get("tokens"), raw.get("slack", _DEFAULT["budget", "slack"])
    if ratio is not None and not (_type_ok(ratio, float) and 0 < ratio <= 1):
        raise _error(file, _line(raw, "ratio"), f"{path}.ratio", f"must be a number in (0, 1], got {ratio!r}",
                     "A ratio is the share of the prompt to keep, e.g. 0.2; for a count use tokens: N")
    if tokens is not None and not (_type_ok(tokens, int) and tokens >= 1):
        raise _error(file, _line(raw, "tokens"), f"{path}.tokens", f"must be an integer >= 1, got {tokens!r}")
    if not (_type_ok(slack, int) and slack >= 0):
        raise _error(file, _line(raw, "slack"), f"{path}.slack", f"must be an integer >= 0, got {slack!r}")
    return Budget(tokens=tokens, ratio=None if ratio is None else float(ratio), slack=slack), "slack" in raw, schedule


@dataclass(frozen=True)
class _Selector:
    text: str
    spans: tuple[tuple[int, int], ...]  # (first, last); negative counts from the end

    def indices(self, count: int, noun: str, file: str, line: int | None, path: str) -> list[int]:
        out: list[int] = []
        for lo, hi in self.spans:
            a, b = (lo + count if lo < 0 else lo), (hi + count if hi < 0 else hi)
            if not (0 <= a < count and 0 <= b < count):
                raise _error(file, line, path, f"selector {self.text} is out of range: the model has {count} {noun}s "
                             f"({noun}s 0-{count - 1})", 'Use indices in that range ("-1" is the last one)')
            out.extend(range(a, b + 1))
        return out


def _selector(value: Any, path: str, file: str, line: int | None) -> _Selector:
    items = value if isinstance(value, list) else [value]
    spans: list[tuple[int, int]] = []
    for item in items:
        parts = item.split(",") if isinstance(item, str) else [item]
        for part in parts:
            if isinstance(part, int) and not isinstance(part, bool):
                spans.append((part, part))
                continue
            text = part.strip() if isinstance(part, str) else None
            m = re.fullmatch(r"(\d+)\s*-\s*(\d*)", text or "")
            if text in ("all", "*"):
                spans.append((0, -1))
            elif text and re.fullmatch(r"-?\d+", text):
                spans.append((int(text), int(text)))
            elif m and (not m[2] or int(m[1]) <= int(m[2])):
                spans.append((int(m[1]), int(m[2]) if m[2] else -1))
            else:
                raise _error(file, line, path, f"cannot read selector {part!r}", f"Use {SELECTOR}")
    if not spans:
        raise _error(file, line, path, "empty selector", 'Use an index, a range, a list or "all"')
    return _Selector(repr(value), tuple(spans))


@dataclass(frozen=True)
class _Rule:
    path: str
    line: int | None
    layers: _Selector
    heads: _Selector | None
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
            if amount.tokens is None and amount.ratio is None:
                continue  # no amount to spread: `_head` reports the missing budget
            shares = dict(zip(layers, _scaled(amount, schedule.multipliers(len(layers), self._file)), strict=True))
            for index in layers:
                grid[index] = [(c, p, (shares[index], None, o), ln) if o == owner else (c, p, (b, s, o), ln)
                               for c, p, (b, s, o), ln in grid[index]]
            low, high = min(shares.values(), key=_amount), max(shares.values(), key=_amount)
            notes.append(f"{owner}: {schedule.describe()} over layers {_spans(layers)}: "
                         f"{low.describe()} to {high.describe()}, mean {amount.describe()}")
        return notes

    def _apply(self, rule: _Rule, cell: tuple) -> tuple:
        cls, params, budget, _ = cell
        if rule.policy is not None and rule.policy is not cls:
            cls, params = rule.policy, rule.fresh
        elif rule.params is not None:
            params = _build_params(cls, rule.params, params, f"{rule.path}.params", self._file, _line(rule.params))
        if rule.budget is not None:
            amount, slack_given, schedule = rule.budget
            if amount.tokens is None and amount.ratio is None:  # only a schedule: the top-level amount
                amount = dataclasses.replace(self.budget, slack=amount.slack if slack_given else self.budget.slack)
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
            budget = UNBOUNDED
        elif budget.tokens is None and budget.ratio is None:
            raise _error(self._file, line, "budget", f'policy "{cls.name}" evicts tokens but has no budget',
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
        try:
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            problem = " ".join(str(p) for p in (getattr(exc, "context", None), getattr(exc, "problem", None)) if p)
            raise _error(file, mark.line + 1 if mark else None, "YAML", f"invalid YAML: {problem or exc}",
                         "Check the indentation, colons and quotes around this line") from None
        except OSError as exc:
            raise RecipeError(f"{file}: cannot read recipe: {exc}") from None
    if not isinstance(data, dict):
        raise _error(file, _line(data), "recipe", f"the top level must be a mapping, got {type(data).__name__}",
                     f"Start the file with `kvpolicy: {SCHEMA_VERSION}` and the recipe's keys")
    _check_keys(data, TOP_KEYS, "", file)
    if data.get("kvpolicy") != SCHEMA_VERSION:
        problem = "missing schema version" if "kvpolicy" not in data else f"unsupported schema version {data['kvpolicy']!r}"
        raise _error(file, _line(data, "kvpolicy"), "kvpolicy", problem,
                     f"This kvpolicy reads schema version {SCHEMA_VERSION}: write `kvpolicy: {SCHEMA_VERSION}`")
    for key in ("name", "description"):
        if key in data and not isinstance(data[key], str):
            raise _error(file, _line(data, key), key, f"expected a string, got {data[key]!r}")
    backend = data.get("backend", _DEFAULT["top", "backend"])
    if backend not in BACKEND_NAMES:
        raise _error(file, _line(data, "backend"), "backend", f"unknown backend {backend!r}"
                     f"{did_you_mean(str(backend), BACKEND_NAMES)}", f"Use one of: {', '.join(BACKEND_NAMES)}")

    def policy(raw: Any, path: str, line: int | None) -> Any:
        if not isinstance(raw, str):
            raise _error(file, line, path, f"expected a policy name, got {raw!r}", f"Available: {', '.join(registry.names())}")
        try:
            return registry.get(raw)
        except KVPolicyError as exc:
            raise RecipeError(f"{file}:{line}: {path}: {exc}" if line else f"{file}: {path}: {exc}") from None

    cls = policy(data.get("policy", _DEFAULT["top", "policy"]), "policy", _line(data, "policy"))
    params = _build_params(cls, data.get("params") or {}, None, "params", file, _line(data, "params"))
    budget, _, schedule = _budget(data["budget"], "budget", file, _line(data, "budget")) if "budget" in data else (
        UNBOUNDED, False, None)
    rules = []
    for kind in ("layers", "heads"):
        raw_rules = data.get(kind) or []
        if not isinstance(raw_rules, list):
            raise _error(file, _line(data, kind), kind, f"expected a list of rules, got {raw_rules!r}",
                         f'E.g. {kind}: [{{layers: "0-1", policy: full}}]')
        for index, raw in enumerate(raw_rules):
            path = f"{kind}[{index}]"
            _check_keys(raw, RULE_KEYS[kind], f"{path}.", file, _line(data, kind))
            line = _line(raw)
            need = "heads" if kind == "heads" else "layers"
            if need not in raw:
                raise _error(file, line, path, f"a {kind[:-1]} rule needs `{need}`", f'E.g. {need}: "0-1"')
            rule_cls = policy(raw["policy"], f"{path}.policy", _line(raw, "policy")) if "policy" in raw else None
            fresh = rule_cls and _build_params(rule_cls, raw.get("params") or {}, None, f"{path}.params", file,
                                               _line(raw, "params"))
            rules.append(_Rule(
                path, line,
                _selector(raw.get("layers", RULES["heads"][0].default), f"{path}.layers", file, _line(raw, "layers")),
                _selector(raw["heads"], f"{path}.heads", file, _line(raw, "heads")) if kind == "heads" else None,
                rule_cls, raw.get("params"), fresh,
                _budget(raw["budget"], f"{path}.budget", file, _line(raw, "budget"), rule=True) if "budget" in raw else None))
    return Recipe(name=data.get("name", stem), description=data.get("description", _DEFAULT["top", "description"]),
                  source=label,
                  budget=budget, backend=backend, schedule=schedule, _file=file, _default=(cls, params, _line(data, "policy")),
                  _rules=tuple(rules))


def with_budget(recipe: Recipe, budget: Budget) -> Recipe:
    """A copy of ``recipe`` with its top-level budget replaced (rules with their own budget keep theirs)."""
    if not isinstance(budget, Budget):
        raise TypeError(f"expected a kvpolicy.plan.Budget, got {budget!r}")
    return dataclasses.replace(recipe, budget=budget)

"""A recipe resolved for a model's shape: its rules applied to every (layer, KV head), its budgets spread.

Rules apply in order over a grid of `Cell`s, one per (layer, KV head), that starts with the recipe's
policy and top-level budget (layer rules first, so that head rules win over them). A rule's budget
takes what it leaves out from the top-level budget (`Budget.over`); then each budget with a schedule
is spread over the layers whose heads share it. Every cell becomes a `HeadPlan`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .budget import BY_POLICY, UNBOUNDED, Budget, budget_amount, scale_budget
from .checks import build_params, line_of, recipe_error
from .plan import HeadPlan, LayerPlan
from .selectors import Selector, spans_text


@dataclass(frozen=True)
class Rule:
    """One entry of a recipe's ``layers:`` or ``heads:`` list, read and checked."""

    path: str  # its YAML path, e.g. "layers[0]"
    line: int | None
    layers: Selector
    heads: Selector | None
    policy: Any  # policy class, or None to keep the cell's
    params: Any  # raw params mapping, or None
    fresh: Any  # the params of a cell switching to `policy`
    budget: Budget | None


@dataclass(frozen=True)
class Cell:
    """What one (layer, KV head) has got so far: a policy class, its params, its budget, the line that set them."""

    policy: Any
    params: Any
    budget: Budget
    line: int | None


def takes_budget(cls: type) -> bool:
    """True if a recipe's budget applies to heads of policy ``cls``: it evicts and does not size its heads
    itself (FastGen's ``dynamic_budget``)."""
    return cls.evicts and not cls.dynamic_budget


def resolve_layers(start: Cell, rules: tuple[Rule, ...], num_layers: int, num_kv_heads: int,
                   file: str) -> tuple[list[LayerPlan], list[str]]:
    """Every layer's plan for a model of ``num_layers`` x ``num_kv_heads``, from the recipe's ``start`` cell (its
    policy, params and top-level budget) and its ``rules``; and a note per budget schedule, saying how it spread."""
    grid = [[start] * num_kv_heads for _ in range(num_layers)]
    for rule in rules:
        for layer in rule.layers.indices(num_layers, "layer", file, rule.line, f"{rule.path}.layers"):
            heads = range(num_kv_heads) if rule.heads is None else rule.heads.indices(
                num_kv_heads, "KV head", file, rule.line, f"{rule.path}.heads")
            for head in heads:
                grid[layer][head] = _apply(rule, grid[layer][head], start.budget, file)
    notes = _spread_schedules(grid, file)
    return [LayerPlan([_head(cell, file) for cell in row]) for row in grid], notes


def _apply(rule: Rule, cell: Cell, top: Budget, file: str) -> Cell:
    policy, params = cell.policy, cell.params
    if rule.policy is not None and rule.policy is not policy:
        policy, params = rule.policy, rule.fresh
    elif rule.params is not None:
        params = build_params(policy, rule.params, params, f"{rule.path}.params", file, line_of(rule.params))
    budget = rule.budget.over(top) if rule.budget is not None else cell.budget
    return Cell(policy, params, budget, rule.line)


def _spread_schedules(grid: list[list[Cell]], file: str) -> list[str]:
    """Replace each scheduled budget by its per-layer share, over the layers whose heads take that budget."""
    owners: dict[str, tuple[Budget, list[int]]] = {}
    for index, row in enumerate(grid):
        for cell in row:
            if cell.budget.schedule is not None and takes_budget(cell.policy):
                layers = owners.setdefault(cell.budget.source, (cell.budget, []))[1]
                if not layers or layers[-1] != index:
                    layers.append(index)
    notes = []
    for source, (amount, layers) in owners.items():
        if not amount.is_limited:
            continue  # no amount to spread: `_head` reports the missing budget
        schedule = amount.schedule
        shares = dict(zip(layers, scale_budget(amount, schedule.multipliers(len(layers), file)), strict=True))
        for index in layers:
            grid[index] = [dataclasses.replace(c, budget=shares[index])
                           if c.budget.source == source and c.budget.schedule is not None else c for c in grid[index]]
        low, high = min(shares.values(), key=budget_amount), max(shares.values(), key=budget_amount)
        notes.append(f"{source}: {schedule.describe()} over layers {spans_text(layers)}: "
                     f"{low.describe()} to {high.describe()}, mean {amount.describe()}")
    return notes


def _head(cell: Cell, file: str) -> HeadPlan:
    cls, budget = cell.policy, cell.budget
    if cls.dynamic_budget:
        budget = BY_POLICY  # the policy sizes its cells itself (FastGen); a recipe budget does not apply
    elif not cls.evicts:
        # kept whole, at its precisions; with tiers the slack still amortizes moving tokens down a tier,
        # without them there is nothing to amortize
        budget = dataclasses.replace(UNBOUNDED, tiers=budget.tiers, slack=budget.slack) if budget.tiers else UNBOUNDED
    elif not budget.is_limited:
        raise recipe_error(file, cell.line, "budget", f'policy "{cls.name}" evicts tokens but has no budget',
                           "Add e.g. budget: {ratio: 0.2} at the top level or to this rule")
    return HeadPlan(cls.name, cell.params, budget)

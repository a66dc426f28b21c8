"""Layer budget schedules in recipes: uniform, pyramid (PyramidKV), funnel, per-layer multipliers."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from helpers import StepRecorder, greedy
from tiny_models import padded_batch, tiny_model

from kvpolicy.commands.cli import main
from kvpolicy.errors import RecipeError
from kvpolicy.hf.session import attach
from kvpolicy.recipe import builtin_recipe_names, load_recipe, with_budget
from kvpolicy.recipe.budget import UNBOUNDED, Budget

NEW_RECIPES = ["h2o-recent75", "tova", "snapkv", "snapkv-wide", "pyramidkv", "scissorhands", "roco"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def budgets(plan, head: int = 0) -> list[Budget]:
    return [layer.heads[head].budget for layer in plan.layers]


def error(tmp_path: Path, text: str, layers: int = 5) -> str:
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path).resolve(layers, 2)
    message = str(info.value)
    assert str(path) in message
    return message


@pytest.mark.parametrize("name", NEW_RECIPES)
def test_new_builtin_recipes(name):
    assert name in builtin_recipe_names()
    recipe = load_recipe(name)
    assert recipe.description
    plan = recipe.resolve(30, 3)
    assert len(plan.layers) == 30 and all(head.budget.ratio for layer in plan.layers for head in layer.heads)
    ratios = [b.ratio for b in budgets(plan)]
    assert sum(ratios) / 30 == pytest.approx(recipe.budget.ratio)


def test_pyramid_tokens_fall_with_depth_and_keep_the_mean(tmp_path):
    plan = load_recipe(write(tmp_path, "kvpolicy: 1\npolicy: h2o\nbudget: {tokens: 100, schedule: pyramid, beta: 20}\n"))
    # bottom 2b - b/beta = 195, top b/beta = 5, linear in between; rounded so the sum is exact
    assert [b.tokens for b in budgets(plan.resolve(5, 2))] == [195, 148, 100, 52, 5]
    assert all(layer.heads[1].budget == layer.heads[0].budget for layer in plan.resolve(5, 2).layers)
    tokens = [b.tokens for b in budgets(plan.resolve(7, 2))]
    assert sum(tokens) == 700 and tokens == sorted(tokens, reverse=True)


def test_funnel_is_the_mirror(tmp_path):
    pyramid = load_recipe(write(tmp_path, "kvpolicy: 1\npolicy: h2o\nbudget: {ratio: 0.2, schedule: pyramid, beta: 4}\n"))
    funnel = load_recipe(write(tmp_path, "kvpolicy: 1\npolicy: h2o\nbudget: {ratio: 0.2, schedule: funnel, beta: 4}\n"))
    down, up = [b.ratio for b in budgets(pyramid.resolve(6, 1))], [b.ratio for b in budgets(funnel.resolve(6, 1))]
    assert up == down[::-1]
    assert up[0] == pytest.approx(0.2 / 4) and up[-1] == pytest.approx(2 * 0.2 - 0.2 / 4)
    assert sum(up) / 6 == pytest.approx(0.2)


def test_uniform_and_single_layer(tmp_path):
    recipe = load_recipe(write(tmp_path, "kvpolicy: 1\npolicy: h2o\nbudget: {tokens: 64, slack: 4, schedule: uniform}\n"))
    assert budgets(recipe.resolve(4, 1)) == [Budget(tokens=64, slack=4)] * 4
    pyramid = load_recipe(write(tmp_path, "kvpolicy: 1\npolicy: h2o\nbudget: {tokens: 64, schedule: pyramid}\n"))
    assert budgets(pyramid.resolve(1, 1)) == [Budget(tokens=64)]


def test_per_layer_multipliers(tmp_path):
    recipe = load_recipe(write(tmp_path, "kvpolicy: 1\npolicy: h2o\nbudget: {tokens: 10, per_layer: [1.5, 1, 0.5]}\n"))
    assert [b.tokens for b in budgets(recipe.resolve(3, 2))] == [15, 10, 5]
    ratio = load_recipe(write(tmp_path, "kvpolicy: 1\npolicy: h2o\nbudget: {ratio: 0.4, per_layer: [0.5, 1.5]}\n"))
    assert [b.ratio for b in budgets(ratio.resolve(2, 1))] == pytest.approx([0.2, 0.6])


def test_tiny_layer_budgets_keep_one_token(tmp_path):
    recipe = load_recipe(write(tmp_path, "kvpolicy: 1\npolicy: h2o\nbudget: {tokens: 2, schedule: pyramid, beta: 20}\n"))
    tokens = [b.tokens for b in budgets(recipe.resolve(4, 1))]
    assert min(tokens) == 1 and sum(tokens) == 8


def test_schedule_spreads_over_the_layers_that_use_the_budget(tmp_path):
    recipe = load_recipe(
        write(
            tmp_path,
            """
        kvpolicy: 1
        policy: h2o
        budget: {tokens: 100, schedule: pyramid, beta: 2}
        layers:
          - {layers: "0-1", policy: full}
          - {layers: 4, budget: {tokens: 7}}
    """,
        )
    )
    plan = recipe.resolve(6, 2)
    assert budgets(plan)[:2] == [UNBOUNDED, UNBOUNDED]
    assert budgets(plan)[4] == Budget(tokens=7)
    assert [budgets(plan)[i].tokens for i in (2, 3, 5)] == [150, 100, 50]  # 3 layers: 2b - b/2, b, b/2
    assert "budget: pyramid (beta=2) over layers 2-3,5: 50 tokens to 150 tokens, mean 100 tokens" in plan.describe()


def test_rule_schedule_inherits_the_top_level_amount(tmp_path):
    recipe = load_recipe(
        write(
            tmp_path,
            """
        kvpolicy: 1
        policy: h2o
        budget: {ratio: 0.3, slack: 2}
        layers:
          - {layers: "2-", budget: {schedule: funnel, beta: 3}}
    """,
        )
    )
    plan = recipe.resolve(5, 1)
    assert budgets(plan)[:2] == [Budget(ratio=0.3, slack=2)] * 2
    ratios = [b.ratio for b in budgets(plan)[2:]]
    assert ratios == pytest.approx([0.1, 0.3, 0.5]) and all(b.slack == 2 for b in budgets(plan))
    swept = with_budget(recipe, Budget(tokens=30))  # a budget sweep keeps the schedule
    assert [b.tokens for b in budgets(swept.resolve(5, 1))] == [30, 30, 10, 30, 50]


def test_with_budget_keeps_the_top_level_schedule():
    recipe = with_budget(load_recipe("pyramidkv"), Budget(tokens=64))
    tokens = [b.tokens for b in budgets(recipe.resolve(30, 3))]
    assert sum(tokens) == 64 * 30 and tokens[0] > 64 > tokens[-1]


@pytest.mark.parametrize(
    "budget,where,message",
    [
        ("{ratio: 0.2, schedule: pyramd}", "budget.schedule", 'unknown schedule \'pyramd\' (did you mean "pyramid"'),
        ("{ratio: 0.2, schedule: pyramid, beta: 0.5}", "budget.beta", "must be a number >= 1"),
        ("{ratio: 0.2, beta: 4}", "budget.beta", "beta only applies to schedule pyramid or funnel"),
        ("{ratio: 0.2, per_layer: [1, 1.5, 0.5, 1.5, 0.6]}", "budget.per_layer", "average 1.02, not 1"),
        ("{ratio: 0.2, per_layer: [2, 0, 1, 1, 1]}", "budget.per_layer", "positive multipliers"),
        ("{ratio: 0.2, per_layer: [1, 1]}", "budget.per_layer", "2 multipliers for 5 layers that use this budget"),
        ("{ratio: 0.2, schedule: funnel, per_layer: [1, 1, 1, 1, 1]}", "budget.per_layer", "exclude each other"),
        ("{schedule: pyramid}", "budget", "exactly one of ratio/tokens"),
    ],
)
def test_schedule_errors(tmp_path, budget, where, message):
    text = f"kvpolicy: 1\npolicy: h2o\nbudget: {budget}\n"
    found = error(tmp_path, text)
    assert f"r.yaml:3: {where}" in found and message in found


def test_rule_schedule_without_any_amount(tmp_path):
    message = error(tmp_path, 'kvpolicy: 1\npolicy: h2o\nlayers:\n  - {layers: "1-", budget: {schedule: pyramid}}\n')
    assert "no budget" in message


def test_validate_prints_per_layer_budgets(capsys):
    assert main(["validate", "pyramidkv", "--layers", "4", "--kv-heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "budget: pyramid (beta=20) over layers 0-3: 0.01 of prompt to 0.39 of prompt, mean 0.2 of prompt" in out
    assert "layers 0: heads 0-1: snapkv(" in out and "budget=0.39 of prompt" in out
    assert "layers 3: heads 0-1: snapkv(" in out and "budget=0.01 of prompt" in out


def test_scheduled_layers_really_hold_their_budgets():
    model = tiny_model("llama")  # 3 layers: pyramid with beta 2 over 6 tokens -> 9, 6, 3
    ids, mask = padded_batch(lengths=(17, 14))
    recipe = load_recipe({"kvpolicy": 1, "policy": "tova", "budget": {"tokens": 6, "schedule": "pyramid", "beta": 2}})
    session = attach(model, recipe)
    recorder = StepRecorder(lambda: [int(layer.valid.sum(dim=2).max()) for layer in session.last_cache.layers])
    greedy(model, ids, mask, 4, recorder=recorder, cache=session.new_cache())
    session.detach()
    assert recorder.steps == [[9, 6, 3]] * 4
    assert all(
        torch.equal(layer.valid.sum(dim=2), torch.full((2, 2), n)) for layer, n in zip(session.last_cache.layers, [9, 6, 3], strict=True)
    )

"""The registry: built-ins come through the plugin hook; broken plugins are reported, not fatal."""

from __future__ import annotations

import types

import pytest
import torch

from kvpolicy import hookimpl
from kvpolicy.errors import KVPolicyError
from kvpolicy.policies.base import Policy
from kvpolicy.registry import Registry


class KeyNorm(Policy):
    name = "test_keynorm"
    description = "test plugin policy"

    def score(self, state, view):
        return view.positions.float()


def plugin(*policies) -> types.ModuleType:
    module = types.ModuleType("fake_plugin")

    @hookimpl
    def kvpolicy_register_policies():
        return list(policies)

    module.kvpolicy_register_policies = kvpolicy_register_policies
    return module


def test_builtins_register_through_the_hook():
    registry = Registry(load_entry_points=False)
    assert registry.names() == [
        "adakv", "d2o", "expected-attention", "fastgen", "full", "h2o", "h2o-kvzip", "h2o-kvzip-ada", "kvzip", "kvzip-ada", "kvzip-global", "lazy", "roco", "scissorhands", "snapkv", "streaming", "tova", "window"
    ]
    assert {entry.source for entry in registry.policies.values()} == {"built-in"}
    assert registry.get("h2o").needs == frozenset({"colsum"})


def test_plugin_policy_is_registered_with_its_source():
    registry = Registry(load_entry_points=False)
    registry._add_plugin(plugin(KeyNorm), "fake", "plugin fake 0.1")
    assert registry.get("test_keynorm") is KeyNorm
    assert registry.policies["test_keynorm"].source == "plugin fake 0.1"


@pytest.mark.parametrize(
    "bad,reason",
    [
        (type("NoName", (Policy,), {}), "has no `name`"),
        (type("Dup", (Policy,), {"name": "h2o"}), "already registered"),
        (type("Needs", (Policy,), {"name": "needy", "needs": frozenset({"logits"})}), "unknown statistics"),
        (dict, "not a kvpolicy.Policy"),
    ],
)
def test_broken_plugin_is_reported_and_others_still_work(bad, reason):
    registry = Registry(load_entry_points=False)
    registry._add_plugin(plugin(bad), "broken", "plugin broken 0.1")
    assert reason in registry.broken["broken"]
    assert registry.get("h2o")
    with pytest.raises(KVPolicyError, match="Available: adakv, d2o, expected-attention, fastgen, full, h2o, h2o-kvzip, h2o-kvzip-ada, kvzip, kvzip-ada, kvzip-global, lazy, roco, scissorhands, snapkv, streaming, tova, window"):
        registry.get("needy")


def test_unknown_policy_suggests_the_closest():
    with pytest.raises(KVPolicyError, match='did you mean "streaming"'):
        Registry(load_entry_points=False).get("streamin")


def test_policy_scores_have_the_view_shape():
    view_positions = torch.arange(6).expand(2, 3, 6)
    from tiny_models import char_tokenizer

    from kvpolicy.policies.base import CellArray, TokenView

    sizes = {"groups": 2, "head_dim": 8}  # 2 query heads per KV head, head_dim 8
    view = TokenView(view_positions, torch.ones(2, 3, 6, dtype=torch.bool), torch.tensor([6, 6]), torch.full((2, 3), 4),
                     token_ids=torch.arange(6, dtype=torch.int32).expand(2, 3, 6), keys=torch.randn(2, 3, 6, 8),
                     values=torch.randn(2, 3, 6, 8), inv_freq=1e-4 ** (torch.arange(4) / 4))

    def cell(kind):
        if isinstance(kind, CellArray):
            return torch.zeros(2, 3, *(sizes[dim] for dim in kind.dims), dtype=kind.dtype)
        return torch.zeros(2, 3, dtype=kind)

    for name in Registry(load_entry_points=False).names():
        policy = Registry(load_entry_points=False).get(name)()
        policy.prepare(tokenizer=char_tokenizer())
        state = {key: torch.zeros(2, 3, 6, dtype=dtype) for key, dtype in policy.state.items()}
        state |= {key: cell(kind) for key, kind in policy.cell_state.items()}
        assert policy.score(state, view).shape == (2, 3, 6), name


@pytest.mark.parametrize(
    "score,message",
    [
        (lambda self, state, view: view.positions.float()[..., :-1], "returned scores of shape"),
        (lambda self, state, view: torch.full(view.positions.shape, float("nan")), "returned NaN scores"),
    ],
)
def test_policy_with_bad_scores_fails_with_its_name(score, message):
    from helpers import uniform_plan
    from tiny_models import tiny_model

    from kvpolicy.hf.session import attach
    from kvpolicy.recipe.budget import Budget

    bad = type("Bad", (Policy,), {"name": "test_bad", "score": score})
    registry = Registry(load_entry_points=False)
    registry._add_plugin(plugin(bad), "bad", "plugin bad 0.1")
    model = tiny_model("llama")
    plan = uniform_plan(model, "h2o", Budget(tokens=4))
    for layer in plan.layers:
        layer.heads = [type(head)("test_bad", bad.Params(), head.budget) for head in layer.heads]
    session = attach(model, plan, registry=registry)
    try:
        with pytest.raises(KVPolicyError, match=f"policy 'test_bad' {message}"):
            model(input_ids=torch.randint(1, 100, (1, 9)), cache=session.new_cache())
    finally:
        session.detach()

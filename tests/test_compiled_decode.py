"""The static decode step compiles whole (``fullgraph=True``, no graph break, no host sync) and gives eager's tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import padded_batch, tiny_model

import kvpolicy
from kvpolicy.errors import KVPolicyError
from kvpolicy.hf.compiled import _model_step, static_blockers
from kvpolicy.recipe import load_recipe, with_budget
from kvpolicy.recipe.budget import Budget

POLICIES = ["h2o", "streaming", "window", "tova", "snapkv", "scissorhands"]
BUDGET, NEW_TOKENS = 8, 12


@pytest.fixture(scope="module")
def model():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None  # random weights: run every step
    return model


def recipe(name: str, **budget):
    """The built-in policy at a fixed budget with no slack (a recipe's slack, such as Scissorhands' 16, would keep the
    step eager: compaction every slack + 1 steps changes shapes)."""
    swept = with_budget(load_recipe(name), Budget(**(budget or {"tokens": BUDGET})))
    return dataclasses.replace(swept, budget=dataclasses.replace(swept.budget, slack=budget.get("slack", 0)))


class CountingBackend:
    """A torch.compile backend that runs the captured graph as it is and counts the graphs it was given."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return graph.forward


def prefilled(model, name: str):
    session = kvpolicy.attach(model, recipe(name))
    ids, mask = padded_batch(lengths=(17, 11, 9))
    cache = session.new_cache()
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
    return cache, logits.argmax(dim=-1, keepdim=True)


@pytest.mark.parametrize("name", POLICIES)
def test_the_decode_step_is_one_graph_without_breaks(model, name):
    cache, token = prefilled(model, name)
    assert static_blockers(cache) == []
    for layer in cache.layers:
        layer.static_step.prime(token.device)
        layer.static_step.active = True
    positions = cache.layers[0].tokens_seen[:, None].clone()
    mask = torch.ones(token.shape[0], 1, 1, 1, dtype=torch.bool)
    with torch.inference_mode():
        explained = torch._dynamo.explain(_model_step)(model, "cache", cache, token, positions, mask)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("name", POLICIES)
def test_compiled_generate_gives_the_eager_tokens(model, name):
    ids, mask = padded_batch()  # rows of 17, 11 and 6 tokens: the short row fills its budget while decoding
    with torch.inference_mode():
        eager = kvpolicy.attach(model, recipe(name)).generate(input_ids=ids, attention_mask=mask,
                                                              max_new_tokens=NEW_TOKENS, do_sample=False)
    backend = CountingBackend()
    session = kvpolicy.attach(model, recipe(name)).compile(backend=backend)
    compiled = session.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(compiled, eager)
    assert session.compiled.compiled_steps == NEW_TOKENS - 1 - 2  # 2 eager steps until the short row is full
    again = session.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)  # a fresh cache
    assert torch.equal(again, eager)
    assert backend.graphs == 1  # captured once: no step or new cache asked for another graph
    layer = session.last_cache.layers[0]
    assert layer.get_seq_length() == ids.shape[1] + NEW_TOKENS - 1
    assert layer.used == BUDGET and all(len(head) == BUDGET for row in layer.kept_positions() for head in row)


def test_inductor_compiles_the_h2o_step_to_the_eager_tokens(model):
    ids, mask = padded_batch(lengths=(12, 10))
    with torch.inference_mode():
        eager = kvpolicy.attach(model, recipe("h2o")).generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                                               do_sample=False)
    session = kvpolicy.attach(model, recipe("h2o")).compile()
    assert torch.equal(session.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6), eager)
    assert session.compiled.compiled_steps == 5


@pytest.mark.parametrize(("spec", "blocker"), [
    ("full", "no one common budget"),
    (with_budget(load_recipe("h2o"), Budget(tokens=BUDGET, slack=4)), "slack 4"),
    (with_budget(load_recipe("expected-attention"), Budget(tokens=BUDGET)), "reads the cached keys or the queries' moments"),
    (with_budget(load_recipe("d2o-merge"), Budget(tokens=BUDGET)), "merges the tokens it evicts"),
])
def test_layers_that_cannot_be_static_decode_eagerly_and_say_why(model, spec, blocker):
    ids, mask = padded_batch()
    with torch.inference_mode():
        eager = kvpolicy.attach(model, spec).generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                                                      do_sample=False)
    session = kvpolicy.attach(model, spec).compile(backend=CountingBackend())
    assert torch.equal(session.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5), eager)
    assert session.compiled.compiled_steps == 0
    assert any(blocker in reason for reason in static_blockers(session.last_cache))


def test_a_policy_returning_nan_is_caught_after_compiled_steps(model):
    import types

    from kvpolicy.hookspecs import hookimpl
    from kvpolicy.policies.window import Window
    from kvpolicy.registry import Registry

    class NaNAfterAWhile(Window):
        name = "nan_later"

        def score(self, state, view):
            scores = super().score(state, view)
            return torch.where(view.seen[:, None, None] > 24, torch.nan, scores)  # decided on the device

    plugin = types.ModuleType("nan_plugin")
    plugin.kvpolicy_register_policies = hookimpl(lambda: [NaNAfterAWhile])
    registry = Registry(load_entry_points=False)
    registry.add_plugin(plugin, "nan")
    plan = recipe("window").resolve(3, 2)
    for layer in plan.layers:
        layer.heads = [type(head)("nan_later", NaNAfterAWhile.Params(), head.budget) for head in layer.heads]
    session = kvpolicy.attach(model, plan, registry=registry).compile(backend=CountingBackend())
    ids, mask = padded_batch()
    with pytest.raises(KVPolicyError, match="nan_later.*NaN"):
        session.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12)
    assert session.compiled.compiled_steps > 0  # caught after compiled steps, not by an eager one


def test_compiled_generate_refuses_what_it_does_not_do(model):
    session = kvpolicy.attach(model, recipe("h2o")).compile(backend=CountingBackend())
    ids, mask = padded_batch()
    with pytest.raises(KVPolicyError, match="greedily"):
        session.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=True)
    with pytest.raises(KVPolicyError, match="num_beams"):
        session.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, num_beams=2)

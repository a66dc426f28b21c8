"""Tests of the `random` policy on a tiny random Llama (built from a config, no download)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import kvpolicy_random
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvpolicy
from kvpolicy.registry import Registry

PROMPT, NEW, BUDGET = 40, 8, 12
SEEN = PROMPT + NEW - 1  # the last generated token is never fed back
LAYERS, KV_HEADS = 2, 2


@pytest.fixture(scope="module")
def registry() -> Registry:
    registry = Registry(load_entry_points=False)
    registry.add_plugin(kvpolicy_random, "kvpolicy-random")
    return registry


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def recipe(registry: Registry, **params):
    return kvpolicy.load_recipe(
        {"kvpolicy": 1, "policy": "random", "budget": {"tokens": BUDGET}, "params": params}, registry=registry
    )


def kept(model, registry, **params) -> list[list[list[int]]]:
    """[layer][KV head] -> sorted positions kept in batch row 0 after a prompt and a few decode steps."""
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    session = kvpolicy.attach(model, recipe(registry, **params), registry=registry)
    try:
        out = session.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                               min_new_tokens=NEW, do_sample=False)
    finally:
        session.detach()
    assert out.shape[1] == PROMPT + NEW
    cache = session.last_cache
    return [[sorted(head) for head in cache.kept_positions(layer)[0]] for layer in range(LAYERS)]


def test_registers(registry):
    assert registry.policies["random"].source == "plugin kvpolicy-random"
    assert not registry.broken
    plan = recipe(registry, seed=3, recent=2).resolve(LAYERS, KV_HEADS)
    assert plan.layers[1].heads[1].policy == "random"


def test_entry_point(capsys):
    try:
        importlib.metadata.distribution("kvpolicy-random")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("kvpolicy-random is not installed; the entry point cannot be found")
    assert kvpolicy.get_registry().get("random")
    from kvpolicy.commands.cli import main

    assert main(["policies"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("random "))
    assert line.split(None, 1)[1].startswith("[plugin kvpolicy-random 0.1.0]"), line


def test_example_recipe(registry):
    example = Path(__file__).parents[1] / "examples" / "random.yaml"
    assert kvpolicy.load_recipe(str(example), registry=registry).resolve(LAYERS, KV_HEADS)


def test_budget_held(model, registry):
    for layer in kept(model, registry):
        for head in layer:
            assert len(head) == BUDGET
            assert len(set(head)) == BUDGET and all(0 <= p < SEEN for p in head)


def test_recent_protected(model, registry):
    for layer in kept(model, registry, recent=5):
        for head in layer:
            assert len(head) == BUDGET
            assert head[-5:] == list(range(SEEN - 5, SEEN))


def test_recent_over_budget_is_the_window(model, registry):
    for layer in kept(model, registry, recent=BUDGET + 10):
        for head in layer:
            assert head == list(range(SEEN - BUDGET, SEEN))


def test_seed_reproducible(model, registry):
    first = kept(model, registry, seed=7)
    assert kept(model, registry, seed=7) == first
    assert kept(model, registry, seed=8) != first
    # not a window in disguise: older tokens survive, and the KV heads choose apart
    assert any(p < SEEN - BUDGET for layer in first for head in layer for p in head)
    assert first[0][0] != first[0][1]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"recent": -1}, "recent must be >= 0"),
        ({"seed": -3}, "seed must be in [0, 2**32 - 1]"),
        ({"seed": "zero"}, "seed"),
        ({"sed": 1}, 'did you mean "seed"'),
    ],
)
def test_bad_params(registry, params, expected):
    with pytest.raises(kvpolicy.RecipeError) as error:
        recipe(registry, **params)
    assert expected in str(error.value)

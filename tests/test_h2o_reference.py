"""H2O's kept set equals a brute-force reference (explicit attention matrices, accumulated, selected)."""

from __future__ import annotations

import pytest
from helpers import run_against_reference, uniform_plan
from policy_references import BruteForceH2O
from tiny_models import padded_batch, tiny_model

from kvpolicy.recipe.budget import Budget

STEPS = 21  # the prefill pass plus 20 decode steps


@pytest.mark.parametrize(
    "arch,budget,lengths",
    [("llama", 7, (17, 12, 9)), ("opt", 8, (17, 12, 9)), ("mistral", 6, (13, 13))],  # the last: no padding
)
def test_h2o_matches_bruteforce(arch, budget, lengths):
    model = tiny_model(arch)
    ids, mask = padded_batch(lengths=lengths)

    steps = run_against_reference(
        model, BruteForceH2O(budget), uniform_plan(model, "h2o", Budget(tokens=budget), recent_ratio=0.5), ids, mask, STEPS
    )
    layers = range(model.config.num_hidden_layers)
    assert all(len(head) == budget for step in steps for layer in layers for row in step[layer] for head in row)
    if arch == "llama":  # the heads of a layer are free to keep different tokens, and here they do
        assert any(row[0] != row[1] for step in steps for layer in layers for row in step[layer])


def test_h2o_with_decay_matches_bruteforce():
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=(17, 12, 9))
    plan = uniform_plan(model, "h2o", Budget(tokens=7), recent_ratio=0.25, decay=0.8)
    steps = run_against_reference(model, BruteForceH2O(7, recent_ratio=0.25, decay=0.8), plan, ids, mask, STEPS)
    plain = run_against_reference(
        model, BruteForceH2O(7, recent_ratio=0.25), uniform_plan(model, "h2o", Budget(tokens=7), recent_ratio=0.25),
        ids, mask, STEPS,
    )
    assert steps != plain  # the decay changes which heavy hitters survive


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_h2o_under_a_threshold_budget_matches_bruteforce(arch):
    """``budget: {tokens: 9, threshold: 1.2}``: each head keeps its recent tokens and those whose accumulated
    attention is at least 1.2 x its other kept tokens' attention spread over every token seen, at most 9; the heads
    then hold different counts that change from step to step."""
    model = tiny_model(arch)
    ids, mask = padded_batch(lengths=(17, 12, 9))
    plan = uniform_plan(model, "h2o", Budget(tokens=9, threshold=1.2), recent_ratio=0.25)
    steps = run_against_reference(model, BruteForceH2O(9, recent_ratio=0.25, threshold=1.2), plan, ids, mask, STEPS)
    counts = [len(head) for step in steps for layer in step.values() for row in layer for head in row]
    assert max(counts) <= 9 and len(set(counts)) > 3, sorted(set(counts))

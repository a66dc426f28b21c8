"""H2O's kept set equals a brute-force reference (explicit attention matrices, accumulated, selected)."""

from __future__ import annotations

import pytest
import torch
from h2o_reference import NAME, BruteForceH2O
from helpers import StepRecorder, greedy, uniform_plan
from tiny_models import padded_batch, tiny_model

from kvpolicy.attach import attach
from kvpolicy.plan import Budget

STEPS = 21  # the prefill pass plus 20 decode steps


@pytest.mark.parametrize(
    "arch,budget,lengths",
    [("llama", 7, (17, 12, 9)), ("opt", 8, (17, 12, 9)), ("mistral", 6, (13, 13))],  # the last: no padding
)
def test_h2o_matches_bruteforce(arch, budget, lengths):
    model = tiny_model(arch)
    ids, mask = padded_batch(lengths=lengths)

    reference = BruteForceH2O(budget)
    reference.register()
    model.set_attn_implementation(NAME)
    recorder = StepRecorder(lambda: dict(reference.current))
    ref_tokens, ref_logits = greedy(model, ids, mask, STEPS, recorder=recorder)
    model.set_attn_implementation("sdpa")

    session = attach(model, uniform_plan(model, "h2o", Budget(tokens=budget), recent_ratio=0.5))
    layers = range(model.config.num_hidden_layers)
    ours = StepRecorder(lambda: {layer: session.last_cache.kept_positions(layer) for layer in layers})
    tokens, logits = greedy(model, ids, mask, STEPS, recorder=ours, cache=session.new_cache())
    session.detach()

    assert len(ours.steps) == len(recorder.steps) == STEPS
    for step, (mine, theirs) in enumerate(zip(ours.steps, recorder.steps, strict=True)):
        for layer in layers:
            assert mine[layer] == theirs[layer], f"step {step} layer {layer}"
            assert all(len(head) == budget for row in mine[layer] for head in row)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    if arch == "llama":  # the heads of a layer are free to keep different tokens, and here they do
        assert any(row[0] != row[1] for step in ours.steps for layer in layers for row in step[layer])

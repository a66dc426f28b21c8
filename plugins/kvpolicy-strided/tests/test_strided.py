"""The strided policy: registered through the entry point, scores by position, keeps the right tokens."""

from __future__ import annotations

import pytest
import torch
from kvpolicy_strided import Strided, StridedParams

import kvpolicy
from kvpolicy import TokenView


def expected_kept(seen: int, budget: int, sinks: int, stride: int, recent: int) -> set[int]:
    kept = set(range(min(sinks, seen))) | set(range(seen - recent, seen))
    older = [p for p in range(seen - 1, -1, -1) if p % stride == 0 and p not in kept]
    others = [p for p in range(seen - 1, -1, -1) if p not in kept and p % stride != 0]
    for p in older + others:
        if len(kept) >= budget:
            break
        kept.add(p)
    return kept


def test_registered_from_the_installed_plugin():
    entry = kvpolicy.get_registry().policies["strided"]
    assert entry.policy is Strided
    assert entry.source.startswith("plugin kvpolicy-strided ")
    assert Strided.needs == frozenset() and Strided.state == {}


def test_score_ranks_sinks_recent_then_stride():
    seen, budget = 40, 16
    positions = torch.arange(seen).expand(1, 2, seen)
    view = TokenView(positions=positions, valid=torch.ones(1, 2, seen, dtype=torch.bool),
                     seen=torch.tensor([seen]), budget=torch.full((1, 2), budget))
    scores = Strided(StridedParams(sinks=4, stride=4, recent_ratio=0.5)).score({}, view)
    top = set(scores[0, 0].topk(budget).indices.tolist())
    assert top == expected_kept(seen, budget, 4, 4, 8) == set(range(4)) | set(range(32, 40)) | {16, 20, 24, 28}


@pytest.mark.parametrize("bad", [{"sinks": -1}, {"stride": 0}, {"recent_ratio": 1.5}])
def test_bad_params_are_rejected(bad):
    recipe = {"kvpolicy": 1, "policy": "strided", "budget": {"tokens": 8}, "params": bad}
    with pytest.raises((ValueError, kvpolicy.RecipeError)):
        kvpolicy.load_recipe(recipe)


def test_attached_to_a_tiny_model_keeps_the_strided_set(tiny_llama):
    recipe = kvpolicy.load_recipe({"kvpolicy": 1, "policy": "strided", "budget": {"tokens": 16},
                                   "params": {"sinks": 4, "stride": 4, "recent_ratio": 0.5}})
    session = kvpolicy.attach(tiny_llama, recipe)
    try:
        ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(0))
        out = session.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    finally:
        session.detach()
    assert out.shape == (1, 46)
    cache = session.last_cache
    seen = 45  # the last generated token is never fed back
    for layer in range(2):
        for head in cache.kept_positions(layer)[0]:
            assert set(head) == expected_kept(seen, 16, 4, 4, 8)

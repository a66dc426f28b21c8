"""recency_h2o (decay math, H2O as the no-decay limit) and the kvtokens task, on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch
from kvpolicy_recency_h2o import KVTokens, RecencyH2O, RecencyH2OParams

import kvpolicy
from kvpolicy import AttentionStats, Budget, with_budget
from kvpolicy.tasks import Context, Row, available_tasks


def recipe(policy: str, tokens: int, **params):
    return kvpolicy.load_recipe({"kvpolicy": 1, "policy": policy, "budget": {"tokens": tokens}, "params": params})


def test_policy_and_task_registered_from_the_installed_plugin():
    entry = kvpolicy.get_registry().policies["recency_h2o"]
    assert entry.policy is RecencyH2O and entry.source.startswith("plugin kvpolicy-recency-h2o ")
    assert RecencyH2O.needs == frozenset({"colsum"})
    assert isinstance(available_tasks()["kvtokens"], KVTokens)


def test_accumulated_attention_halves_every_half_life_tokens():
    policy = RecencyH2O(RecencyH2OParams(half_life=4))
    state = {"acc": torch.ones(2, 1, 3)}
    colsum = torch.tensor([[[0.0, 0.0, 1.0]], [[0.0, 0.0, 1.0]]])
    policy.observe(state, AttentionStats(queries=torch.tensor([4, 8]), colsum=colsum))
    assert state["acc"].tolist() == [[[0.5, 0.5, 1.5]], [[0.25, 0.25, 1.25]]]


@pytest.mark.parametrize("bad", [{"half_life": 0}, {"recent_ratio": -0.1}])
def test_bad_params_are_rejected(bad):
    with pytest.raises((ValueError, kvpolicy.RecipeError)):
        recipe("recency_h2o", 8, **bad)


def kept(model, spec, ids, steps=16):
    session = kvpolicy.attach(model, spec)
    try:
        session.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False)
    finally:
        session.detach()
    cache = session.last_cache
    return [cache.kept_positions(layer) for layer in range(len(cache.layers))]


def test_an_endless_half_life_is_h2o_and_a_short_one_is_not(tiny_llama):
    ids = torch.randint(1, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    h2o = kept(tiny_llama, recipe("h2o", 16, recent_ratio=0.25), ids)
    assert kept(tiny_llama, recipe("recency_h2o", 16, recent_ratio=0.25, half_life=1e12), ids) == h2o
    short = kept(tiny_llama, recipe("recency_h2o", 16, recent_ratio=0.25, half_life=1.0), ids)
    assert short != h2o
    assert all(len(head) == 16 for layer in short for row in layer for head in row)


def test_kvtokens_counts_the_budget_after_prefill(tiny_llama):
    text = torch.randint(1, 128, (100,), generator=torch.Generator().manual_seed(2))
    ctx = Context(tiny_llama, None, text, prompt_tokens=40)
    spec = recipe("recency_h2o", 8)
    rows = [Row("full", None, kvpolicy.load_recipe("full")),
            Row("recency_h2o", "8", with_budget(spec, Budget(tokens=8)), Budget(tokens=8))]
    task = KVTokens()
    assert task.tokens_needed(ctx) == 40 and task.settings(ctx) == {"prompt_tokens": 40}
    full, bounded = task.run(ctx, rows)
    assert full["kv_tokens_per_layer"] == [40.0, 40.0] and full["kv_kept_ratio"] == 1.0
    assert bounded["kv_tokens_mean"] == 8.0 and bounded["kv_kept_ratio"] == pytest.approx(0.2)


def test_importing_the_plugin_leaves_the_tasks_and_transformers_unloaded():
    """Every kvpolicy command imports the plugin to find its policy: the task (and transformers) load only when the
    tasks hook asks for them."""
    import subprocess
    import sys

    code = ("import sys, kvpolicy_recency_h2o; heavy = [m for m in ('kvpolicy.tasks', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy; from kvpolicy_recency_h2o import KVTokens; assert 'kvpolicy.tasks' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

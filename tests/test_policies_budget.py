"""Every built-in evicting policy on the cache: budgets held; Scissorhands, RoCo, TOVA, SnapKV, AdaKV: parity, what they keep."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import StepRecorder, greedy, per_head_counts, uniform_plan
from tiny_models import ARCHS, padded_batch, tiny_model

from kvpolicy.hf.session import attach, attach_rows
from kvpolicy.policies.base import AttentionStats, TokenView
from kvpolicy.recipe.budget import Budget
from kvpolicy.registry import get_registry

LENGTHS = (17, 11, 6)
POLICIES = [
    ("tova", {}),
    ("snapkv", {"window": 4, "kernel": 3}),
    ("snapkv", {"window": 4, "pooling": "max", "decode": "evict_oldest"}),
    ("scissorhands", {"history_window": 8, "recent": 2}),
    ("roco", {"sink_length": 1, "recent_tokens": 2, "recent_ratio": 0.3}),
    ("adakv", {"window": 2, "kernel": 3}),
    ("adakv", {"window": 3, "pooling": "max", "alpha": 0.5, "decode": "evict_oldest"}),
]

# the budget test covers the core policies too, and FastGen (whose budgets are its own: see below)
FASTGEN = {"special_tokens": (2,), "punct_tokens": tuple(range(10, 128, 7))}
BUDGET_POLICIES = [("h2o", {}), ("window", {}), ("streaming", {"sinks": 2}), *POLICIES, ("fastgen", FASTGEN),
                   ("fastgen", {**FASTGEN, "threshold": 0.7, "gqa": "mean"})]


@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize("budget", [Budget(tokens=5), Budget(ratio=0.5)])
@pytest.mark.parametrize("policy,params", BUDGET_POLICIES)
def test_budget_held_after_prefill_and_every_step(policy, params, budget, arch):
    model = tiny_model(arch)
    ids, mask = padded_batch(lengths=LENGTHS)
    session = attach(model, uniform_plan(model, policy, budget, **params))
    dynamic = get_registry().get(policy).dynamic_budget
    recorder = StepRecorder(lambda: per_head_counts(session.last_cache) if not dynamic else
                            (per_head_counts(session.last_cache), [layer.budgets.limits.clone() for layer in session.last_cache.layers]))
    greedy(model, ids, mask, 12, recorder=recorder, cache=session.new_cache())
    session.detach()
    expected = torch.tensor([budget.tokens or math.ceil(n * budget.ratio) for n in LENGTHS])
    assert len(recorder.steps) == 12
    if dynamic:
        # FastGen: the recipe's budget does not apply; every head holds what its pattern allows at every step
        # (tests/test_fastgen.py checks those figures against the patterns)
        for step, (counts, budgets) in enumerate(recorder.steps):
            for layer_counts, layer_budgets in zip(counts, budgets, strict=True):
                assert torch.equal(layer_counts, layer_budgets), f"step {step}"
                assert bool((layer_counts <= torch.tensor(LENGTHS)[:, None] + step).all()), f"step {step}"
        seen = torch.tensor(LENGTHS)[:, None] + 11
        assert any(bool((layer_counts < seen).any()) for layer_counts in recorder.steps[-1][0])  # some heads evict
        return
    if get_registry().get(policy).allocates:
        # head-wise budgets (AdaKV): each row's heads share heads x budget; each head's share, at least
        # floor(alpha x budget), is set at the prefill (every prompt here is over budget) and then held
        heads = recorder.steps[0][0].shape[1]
        floor = torch.floor(expected * params.get("alpha", 0.2)).long()
        for step, counts in enumerate(recorder.steps):
            for layer_counts, first in zip(counts, recorder.steps[0], strict=True):
                assert torch.equal(layer_counts.sum(dim=1), expected * heads), f"step {step}"
                assert torch.equal(layer_counts, first) and bool((layer_counts >= floor[:, None]).all()), f"step {step}"
        assert any(len(set(row.tolist())) > 1 for layer_counts in recorder.steps[0] for row in layer_counts)
        return
    for step, counts in enumerate(recorder.steps):
        for layer_counts in counts:
            assert torch.equal(layer_counts, expected[:, None].expand_as(layer_counts)), f"step {step}"


def test_scissorhands_drops_many_tokens_at_once():
    """Budget 5 + slack 3: the paper's cache of B = 8 tokens that drops m = 3 (+ the new one) at once."""
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=(17,))
    session = attach(model, uniform_plan(model, "scissorhands", Budget(tokens=5, slack=3), history_window=8, recent=2))
    recorder = StepRecorder(lambda: session.last_cache.layers[0].memory()["tokens_max"])
    greedy(model, ids, mask, 9, recorder=recorder, cache=session.new_cache())
    session.detach()
    assert recorder.steps == [5, 6, 7, 8, 5, 6, 7, 8, 5]


@pytest.mark.parametrize("arch", ARCHS)
def test_large_budget_equals_transformers(arch):
    model = tiny_model(arch)
    ids, mask = padded_batch()
    ref_tokens, ref_logits = greedy(model, ids, mask, 12)
    for policy, params in POLICIES:
        session = attach(model, uniform_plan(model, policy, Budget(tokens=1000), **params))
        try:
            tokens, logits = greedy(session.model, ids, mask, 12, cache=session.new_cache())
        finally:
            session.detach()
        assert torch.equal(tokens, ref_tokens), policy
        torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4, msg=policy)


NEEDLE, NEEDLE_AT, PROMPT = 7, 10, 40


def needle_model():
    """A tiny llama whose layer-0 queries all attend to one token id (NEEDLE) wherever it is.

    Every embedding gets a shared coordinate (0) that the queries read, and NEEDLE alone a
    large coordinate 1 that the keys read; both land in RoPE's slowest-rotating dimension
    (7 of 16), so the query-key product barely depends on the distance.
    """
    model = tiny_model("llama")
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, :2] = 0.0
        embed[:, 0] = 1.0
        embed[NEEDLE, 1] = 3.0
        attention = model.model.layers[0].self_attn
        attention.q_proj.weight.zero_()
        attention.k_proj.weight.zero_()
        for head in range(6):
            attention.q_proj.weight[head * 16 + 7, 0] = 1.0
        for head in range(2):
            attention.k_proj.weight[head * 16 + 7, 1] = 1.0
    return model


@pytest.mark.parametrize(
    "policy,params,kept",
    [
        ("snapkv", {"window": 8, "kernel": 5}, True),
        ("snapkv", {"window": 8, "kernel": 5, "pooling": "max"}, True),
        ("window", {}, False),
        ("streaming", {"sinks": 4}, False),
    ],
)
def test_snapkv_keeps_what_the_last_queries_look_at(policy, params, kept):
    model = needle_model()
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(8, 128, (1, PROMPT), generator=generator)
    ids[0, NEEDLE_AT] = NEEDLE
    session = attach(model, uniform_plan(model, policy, Budget(tokens=16), **params))
    recorder = StepRecorder(lambda: session.last_cache.kept_positions(0)[0])
    greedy(model, ids, torch.ones_like(ids), 4, recorder=recorder, cache=session.new_cache())
    session.detach()
    for step, heads in enumerate(recorder.steps):  # after the prefill and each decode step
        for positions in heads:
            assert len(positions) == 16
            assert (NEEDLE_AT in positions) is kept, (step, positions)
            if policy == "snapkv":  # the observation window (the last 8 prompt tokens) is kept whole
                assert set(range(PROMPT - 8, PROMPT)) <= set(positions)


def test_snapkv_without_a_long_call_keeps_the_newest():
    """Fed one token at a time there is no prompt to score: SnapKV keeps the most recent tokens."""
    model = tiny_model("llama")
    session = attach(model, uniform_plan(model, "snapkv", Budget(tokens=4), window=2))
    cache = session.new_cache()
    for token in range(1, 10):
        model(input_ids=torch.tensor([[token]]), cache=cache)
    session.detach()
    assert cache.kept_positions(1)[0] == [[5, 6, 7, 8]] * 2


def test_tova_one_selection_per_layer():
    """The score is the layer-wide mean over KV heads, matched by position even when slots differ."""
    tova = get_registry().get("tova")()
    positions = torch.tensor([[[0, 1, 2, 3], [3, 2, 1, 0]]])  # head 1 holds the same tokens, reversed
    state = {"row": torch.zeros(1, 2, 4)}
    tova.observe(state, AttentionStats(queries=torch.tensor([1]), last_rows=torch.tensor(
        [[[[0.1, 0.2, 0.3, 0.4]], [[0.2, 0.4, 0.0, 0.4]]]])))
    view = TokenView(positions, torch.ones(1, 2, 4, dtype=torch.bool), torch.tensor([4]), torch.tensor([[2, 2]]))
    scores = tova.score(state, view)
    # token 0: (0.1 + 0.4) / 2, token 1: (0.2 + 0.0) / 2, token 2: (0.3 + 0.4) / 2, token 3: (0.4 + 0.2) / 2
    torch.testing.assert_close(scores[0, 0], torch.tensor([0.25, 0.1, 0.35, 0.3]))
    torch.testing.assert_close(scores[0, 1], torch.tensor([0.3, 0.35, 0.1, 0.25]))


@pytest.mark.parametrize(
    "policy,params,message",
    [
        ("snapkv", {"kernel": 4}, "odd"),
        ("snapkv", {"pooling": "mean"}, "pooling"),
        ("snapkv", {"decode": "drop"}, "decode"),
        ("snapkv", {"window": 0}, "window"),
        ("adakv", {"alpha": 1.5}, "alpha"),
        ("adakv", {"kernel": 2}, "odd"),
        ("scissorhands", {"history_window": 0}, "history_window"),
        ("scissorhands", {"recent": -1}, "recent"),
        ("roco", {"recent_ratio": 1.5}, "recent_ratio"),
        ("roco", {"sink_length": -1}, "sink_length"),
    ],
)
def test_params_are_validated(policy, params, message):
    cls = get_registry().get(policy)
    with pytest.raises(ValueError, match=message):
        cls.Params(**params).validate()


def test_evicts_and_is_limited():
    """`Policy.evicts` (False: budgets do not apply) and `Budget.is_limited` (an amount is given)."""
    from kvpolicy.policies.base import Policy
    from kvpolicy.policies.fastgen import FastGen
    from kvpolicy.policies.full import Full
    from kvpolicy.recipe.budget import BY_POLICY, UNBOUNDED, Budget

    assert Policy.evicts and FastGen.evicts and not Full.evicts

    class Version1Plugin(Policy):  # hook API version 1 called it `bounded`
        name = "keeps-all"
        bounded = False

    assert not Version1Plugin.evicts
    assert Budget(tokens=8).is_limited and Budget(ratio=0.2).is_limited
    assert not UNBOUNDED.is_limited and not BY_POLICY.is_limited


def _layer_limits(model, plans, ids) -> list[torch.Tensor]:
    """Each layer's per-cell budgets after feeding ``ids`` one token at a time to one row per plan."""
    session = attach_rows(model, plans)
    try:
        cache = session.new_cache()
        with torch.inference_mode():
            for t in range(ids.shape[1]):
                model(input_ids=ids[:, t : t + 1].expand(len(plans), -1), past_key_values=cache, use_cache=True)
        return [layer.budgets.limits.clone() for layer in cache.layers]
    finally:
        session.detach()


def test_rows_that_weigh_layers_differently_each_get_the_budgets_they_get_alone():
    """A sweep batches rows whose layers' weights come from different policies (here D2O's two readings of sparsity,
    beside an H2O row that weighs nothing): each row's layer budgets are the ones it gets in a batch of its own, not
    a mean over the batch's policies."""
    model = tiny_model("opt")  # 4 KV heads: the heads' variance range differs across layers
    ids = torch.randint(1, 100, (1, 24), generator=torch.Generator().manual_seed(3))
    plans = [uniform_plan(model, "d2o", Budget(tokens=8)),
             uniform_plan(model, "d2o", Budget(tokens=8), sparsity="head_range"),
             uniform_plan(model, "h2o", Budget(tokens=8))]
    together = _layer_limits(model, plans, ids)
    for row, plan in enumerate(plans):
        alone = _layer_limits(model, [plan], ids)
        assert [limits[row].tolist() for limits in together] == [limits[0].tolist() for limits in alone], row
    assert any(limits[0].tolist() != limits[1].tolist() for limits in together)  # the two readings differ
    assert all(limits[2].tolist() == [8] * 4 for limits in together)

"""The merge store operation (dense and ragged) against explicit weighted means, and what the cache refuses."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch
from helpers import model_shape
from tiny_models import tiny_model

import kvpolicy
from kvpolicy.errors import KVPolicyError
from kvpolicy.hookspecs import hookimpl
from kvpolicy.policies.base import MergePlan
from kvpolicy.policies.h2o import H2O
from kvpolicy.recipe.budget import Budget
from kvpolicy.recipe.plan import HeadPlan, LayerPlan, Plan
from kvpolicy.registry import Registry
from kvpolicy.storage.dense import DenseStore
from kvpolicy.storage.ragged import RaggedStore


class Sizing:
    slack, uniform_limit, budgets_grow = 0, None, False

    def segment_sizes(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens + 3

    def grown_segments(self, needed: torch.Tensor) -> torch.Tensor:
        return needed + 3


def explicit_merge(keys, values, merges):
    """``merges``: {(b, h, target): (self weight, [(source, weight), ...])}; Python-level weighted means."""
    keys, values = keys.clone(), values.clone()
    for (b, h, target), (own, sources) in merges.items():
        total = own + sum(w for _, w in sources)
        for tensor in (keys, values):
            mixed = own * tensor[b, h, target].double()
            for source, w in sources:
                mixed = mixed + w * tensor[b, h, source].double()
            tensor[b, h, target] = (mixed / total).float()
    return keys, values


def as_lists(merges, batch, heads):
    width = max(len(s) for _, s in merges.values())
    source = torch.zeros(batch, heads, width * 2, dtype=torch.long)
    target = torch.zeros_like(source)
    weight, own = torch.zeros(source.shape), torch.ones(source.shape)
    filled = {}
    for (b, h, t), (self_weight, sources) in merges.items():
        for s, w in sources:
            i = filled.get((b, h), 0)
            source[b, h, i], target[b, h, i], weight[b, h, i], own[b, h, i] = s, t, w, self_weight
            filled[(b, h)] = i + 1
    return source, target, weight, own


MERGES = {  # two sources into one target, one into another, a cell that merges nothing
    (0, 0, 1): (2.718, [(4, 1.5), (7, 0.5)]),
    (0, 1, 0): (1.0, [(2, 3.0)]),
    (1, 1, 5): (0.25, [(3, 2.0), (6, 1.0), (8, 0.75)]),
}


def filled_dense(batch=2, heads=2, tokens=9, dim=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, tokens, dim, generator=generator)
    values = torch.randn(batch, heads, tokens, dim, generator=generator)
    store = DenseStore(keys, values, {}, Sizing())
    store.append(keys, values)
    return store, keys, values


def test_dense_merge_writes_the_weighted_mean_into_each_target_and_nothing_else():
    store, keys, values = filled_dense()
    expected_keys, expected_values = explicit_merge(keys, values, MERGES)
    store.merge(*as_lists(MERGES, 2, 2))
    got_keys, got_values = store.attention_kv()
    assert torch.allclose(got_keys, expected_keys, atol=1e-6) and torch.allclose(got_values, expected_values, atol=1e-6)
    changed = (got_keys != keys).any(dim=-1)
    assert changed.sum() == 3 and bool(changed[0, 0, 1] and changed[0, 1, 0] and changed[1, 1, 5])


def test_a_token_merged_with_its_own_copy_is_unchanged_and_weights_are_normalized():
    store, keys, values = filled_dense()
    store.keys[0, 0, 3] = keys[0, 0, 2]
    store.values[0, 0, 3] = values[0, 0, 2]
    store.merge(*as_lists({(0, 0, 2): (5.0, [(3, 123.0)])}, 2, 2))
    assert torch.allclose(store.keys[0, 0, 2], keys[0, 0, 2], atol=1e-6)


def test_ragged_merge_reaches_old_and_newly_appended_slots():
    store, _, _ = filled_dense(tokens=9)
    scores = torch.arange(9, dtype=torch.float).expand(2, 2, 9).clone()
    keep = torch.tensor([[5, 3], [4, 6]])
    store.evict(scores, keep, torch.full((2, 2), 9))
    ragged = RaggedStore.from_dense(store, keep)
    generator = torch.Generator().manual_seed(3)
    ragged.append(torch.randn(2, 2, 2, 4, generator=generator), torch.randn(2, 2, 2, 4, generator=generator))
    ragged.end_pass()
    keys = ragged.slot_keys().clone()  # [B, Hkv, used, D]: old slots below each cell's count, this pass's at 6 and 7
    values = ragged.values[ragged.slot_rows(torch.arange(ragged.used).expand(2, 2, -1))].clone()
    merges = {(0, 1, 0): (2.718, [(6, 1.0), (7, 2.0)]), (1, 0, 3): (1.0, [(1, 0.5)]), (1, 1, 7): (3.0, [(2, 1.0)])}
    expected_keys, expected_values = explicit_merge(keys, values, merges)
    ragged.merge(*as_lists(merges, 2, 2))
    got_values = ragged.values[ragged.slot_rows(torch.arange(ragged.used).expand(2, 2, -1))]
    valid = ragged.slots.valid[:, :, : ragged.used]
    assert torch.allclose(ragged.slot_keys()[valid], expected_keys[valid], atol=1e-6)
    assert torch.allclose(got_values[valid], expected_values[valid], atol=1e-6)


class MergesIntoEvicted(H2O):
    """A broken plugin: merges every leaving token into another leaving one."""

    name = "bad_merge"
    merges = True

    def merge(self, state, view, keys, kept):
        leaving = view.valid & ~kept
        first = torch.sort((~leaving).to(torch.int8), dim=2, stable=True).indices[..., :1]
        target = torch.where(leaving, first.expand_as(leaving), -1)
        target = torch.where(target == torch.arange(target.shape[2]), -1, target)
        return MergePlan(target, torch.ones_like(state["acc"]), torch.ones_like(state["acc"]))


def test_a_merge_into_a_slot_that_is_not_kept_is_a_clear_error(monkeypatch):
    module = types.ModuleType("kvpolicy_bad_merge")

    @hookimpl
    def kvpolicy_register_policies():
        return [MergesIntoEvicted]

    module.kvpolicy_register_policies = kvpolicy_register_policies
    monkeypatch.setitem(sys.modules, "kvpolicy_bad_merge", module)
    registry = Registry(load_entry_points=False)
    registry.add_plugin(module, "bad-merge")
    model = tiny_model("llama")
    layers, heads = model_shape(model)
    head = HeadPlan("bad_merge", MergesIntoEvicted.Params(), Budget(tokens=4))
    plan = Plan("bad-merge", [LayerPlan([head] * heads) for _ in range(layers)])
    session = kvpolicy.attach(model, plan, registry=registry)
    try:
        with pytest.raises(KVPolicyError, match="policy 'bad_merge' merges a token into a slot that is not kept"):
            session.generate(torch.randint(1, 100, (1, 12)), max_new_tokens=2, do_sample=False)
    finally:
        session.detach()


def test_merging_with_precision_tiers_is_refused_in_one_line():
    model = tiny_model("llama")
    recipe = {"kvpolicy": 1, "policy": "d2o", "budget": {"memory": 0.3, "tiers": [{"bits": 16, "share": 0.5}, {"bits": 4}]}}
    with pytest.raises(KVPolicyError, match="policy 'd2o' merges evicted tokens into kept ones, which precision tiers"):
        session = kvpolicy.attach(model, recipe)
        session.generate(torch.randint(1, 100, (1, 12)), max_new_tokens=1, do_sample=False)


def repeated_call(counts: torch.Tensor, queries: int, needs: frozenset, seed: int = 0):
    """Two `AttentionCall`s over the same cache: slots standing for ``counts`` [B, Hkv, T] tokens with log n as their
    key bias, and the same cache with each slot repeated n times (per cell, padded with invalid slots), then
    ``queries`` new tokens (one row padded when there are several); also which slot of the first each slot of the
    second copies (``index``)."""
    from kvpolicy.backend.call import AttentionCall

    generator = torch.Generator().manual_seed(seed)
    batch, kv_heads, old = counts.shape
    q_heads, dim = 2 * kv_heads, 8
    keys = torch.randn(batch, kv_heads, old + queries, dim, generator=generator)
    values = torch.randn(batch, kv_heads, old + queries, dim, generator=generator)
    query = torch.randn(batch, q_heads, queries, dim, generator=generator)
    query_valid = None
    if queries > 1:
        query_valid = torch.ones(batch, queries, dtype=torch.bool)
        query_valid[1, :2] = False  # a left-padded row
    seen = torch.arange(old + queries)
    query_positions = torch.arange(old, old + queries).expand(batch, -1).clone()
    if query_valid is not None:
        query_positions = torch.where(query_valid, old + torch.cumsum(query_valid.long(), 1) - 1, -1)
    valid = torch.ones(batch, kv_heads, old + queries, dtype=torch.bool)
    if query_valid is not None:
        valid[:, :, old:] &= query_valid[:, None]
    key_positions = torch.cat([seen[:old].expand(batch, kv_heads, -1),
                               query_positions[:, None].expand(-1, kv_heads, -1)], dim=2)
    bias = torch.cat([counts.float().log(), torch.zeros(batch, kv_heads, queries)], dim=2)
    biased = AttentionCall(keys=keys, values=values, valid=valid, key_positions=key_positions,
                           query_positions=query_positions, query_valid=query_valid, past_slots=old, scaling=0.3,
                           needs=needs, key_bias=bias)
    width = int(counts.sum(dim=2).max())
    copies = [[torch.repeat_interleave(torch.arange(old), counts[b, h]) for h in range(kv_heads)] for b in range(batch)]
    index = torch.zeros(batch, kv_heads, width, dtype=torch.long)
    present = torch.zeros(batch, kv_heads, width, dtype=torch.bool)
    for b in range(batch):
        for h in range(kv_heads):
            index[b, h, : len(copies[b][h])], present[b, h, : len(copies[b][h])] = copies[b][h], True
    index = torch.cat([index, torch.arange(old, old + queries).expand(batch, kv_heads, -1)], dim=2)

    def gathered(tensor):
        return tensor.gather(2, index[..., None].expand(-1, -1, -1, dim))

    repeated = AttentionCall(keys=gathered(keys), values=gathered(values),
                             valid=torch.cat([present, valid[:, :, old:]], dim=2),
                             key_positions=key_positions.gather(2, index), query_positions=query_positions,
                             query_valid=query_valid, past_slots=width, scaling=0.3, needs=needs)
    return query, biased, repeated, index


@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("needs", [frozenset({"colsum"}), frozenset(), frozenset({"colsum", "last_rows"})])
def test_a_key_bias_of_log_n_attends_as_n_copies_of_the_slot(queries, needs):
    """What proportional attention promises: a slot standing for n tokens with log n on its logits gives the output of
    a cache holding its key and value n times, and its column sum is the copies' together (decode steps, a later
    prompt chunk with pads, a call with no statistics)."""
    from kvpolicy.backend import torch_ref

    counts = torch.tensor([[[1, 3, 1, 2, 1, 1], [2, 1, 1, 1, 4, 1]], [[1, 1, 1, 1, 1, 5], [1, 2, 2, 2, 1, 1]]])
    query, biased, repeated, index = repeated_call(counts, queries, needs)
    got, want = torch_ref.attend(query, biased), torch_ref.attend(query, repeated)
    real = slice(None) if biased.query_valid is None else biased.query_valid
    torch.testing.assert_close(got.output[real], want.output[real], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got.output, torch_ref.attend(query, dataclasses.replace(biased, key_bias=None)).output)
    if "colsum" in needs:
        slots = biased.keys.shape[2]
        pooled = torch.zeros_like(got.stats.colsum).scatter_add_(2, index, torch.where(repeated.valid, want.stats.colsum,
                                                                                         0.0))
        torch.testing.assert_close(got.stats.colsum, pooled[..., :slots], atol=2e-5, rtol=2e-5)

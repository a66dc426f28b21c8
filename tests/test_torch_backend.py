"""The torch path's score tracking (`torch_ref.attend_tracking`) equals one dense softmax over every query and key.

The path normalizes nothing until after its matmuls (the output and the column sums take each
row's 1 / sum afterwards) and works in query chunks; the reference here builds the whole
[B, Hq, q, T] probability matrix with `torch.softmax`. Cases: GQA, left pads, keys evicted from
the middle of the cache, a query chunk boundary inside the call, a row that sees no key.
(`colmax` is checked by the same reference: a pad query's row there is all 0.)
"""

from __future__ import annotations

import pytest
import torch

from kvpolicy.backend import torch_ref

EVERY_STAT = frozenset({"colsum", "colsum_sq", "below_uniform", "last_rows", "colsum_heads", "colmax"})


def dense_reference(query, keys, values, mask, query_valid, scaling, last_rows):
    """Output [B, q, Hq, D] and the statistics, from the full probability matrix (rows that see nothing: 0)."""
    batch, q_heads, queries, _ = query.shape
    groups = q_heads // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1)
    v = values.repeat_interleave(groups, dim=1)
    head_mask = mask.repeat_interleave(groups, dim=1)  # [B, Hq, q, T]
    logits = (query @ k.transpose(-1, -2) * scaling).masked_fill(~head_mask, -torch.inf)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    out = (probs @ v).transpose(1, 2)
    probs = probs * query_valid[:, None, :, None]
    per_head = probs.view(batch, keys.shape[1], groups, queries, -1)
    seen = mask.sum(dim=-1, keepdim=True).clamp(min=1)[:, :, None]
    below = (mask[:, :, None] & (per_head * seen < 1.0) & query_valid[:, None, None, :, None]).float()
    return out, {
        "colsum": per_head.sum(dim=3).mean(dim=2),
        "colsum_sq": per_head.square().sum(dim=3).mean(dim=2),
        "below_uniform": below.sum(dim=3).mean(dim=2),
        "colsum_heads": per_head.sum(dim=3),
        "colmax": per_head.amax(dim=(2, 3)),  # KVzip's: the most any real query of any of the G heads gave
        "last_rows": per_head.mean(dim=2)[:, :, queries - last_rows :],
    }


def make_call(seed=0, batch=2, kv_heads=2, groups=3, past=40, queries=45, dim=32):
    """A call as a layer makes it after eviction: past slots with holes, new tokens after them, row 0 left-padded."""
    gen = torch.Generator().manual_seed(seed)
    total = past + queries
    query = torch.randn(batch, kv_heads * groups, queries, dim, generator=gen)
    keys = torch.randn(batch, kv_heads, total, dim, generator=gen) * 2.0  # peaked rows: a softmax that must be stable
    values = torch.randn(batch, kv_heads, total, dim, generator=gen)
    valid = torch.ones(batch, kv_heads, total, dtype=torch.bool)
    valid[:, :, :past] = torch.rand(batch, kv_heads, past, generator=gen) > 0.3
    valid[0, 1, :past] = False  # a cell whose past was all evicted: its pad queries see no key at all
    query_valid = torch.ones(batch, queries, dtype=torch.bool)
    query_valid[0, :3] = False
    valid[:, :, past : past + 3] &= query_valid[:, None, :3]
    positions = torch.arange(total).expand(batch, kv_heads, total)
    query_slots = past + torch.arange(queries)
    mask = valid[:, :, None, :] & (positions[:, :, None, :] <= query_slots[None, None, :, None])  # [B, Hkv, q, T]
    mask &= query_valid[:, None, :, None]
    return query, keys, values, mask, query_valid, past


@pytest.mark.parametrize("chunk", [1, 16, 64])
def test_tracking_equals_a_dense_softmax(monkeypatch, chunk):
    monkeypatch.setattr(torch_ref, "_CHUNK_QUERIES", chunk)
    query, keys, values, mask, query_valid, past = make_call()
    scaling, last_rows = query.shape[-1] ** -0.5, 5
    out, stats = torch_ref.attend_tracking(
        query, keys, values, lambda lo, hi, width: mask[:, :, lo:hi, :width], scaling, EVERY_STAT, query_valid,
        past, last_rows,
    )
    ref_out, ref = dense_reference(query, keys, values, mask, query_valid, scaling, last_rows)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0, :3], torch.zeros_like(out[0, :3]))  # the pads of the empty cell's row: 0, not NaN
    for name, expected in ref.items():
        torch.testing.assert_close(getattr(stats, name), expected, atol=2e-5, rtol=2e-5, msg=name)
    assert stats.queries.tolist() == [42, 45]


def test_a_fresh_prompt_without_a_mask_equals_the_dense_softmax():
    query, keys, values, _, _, _ = make_call(seed=1, past=0, queries=70)
    scaling = 0.2
    causal = torch.ones(70, 70, dtype=torch.bool).tril().expand(2, 2, 70, 70)
    out, stats = torch_ref.attend_tracking(query, keys, values, None, scaling, frozenset({"colsum"}), None, 0)
    ref_out, ref = dense_reference(query, keys, values, causal, torch.ones(2, 70, dtype=torch.bool), scaling, 0)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stats.colsum, ref["colsum"], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("needs", [frozenset({"last_rows"}), frozenset({"below_uniform", "last_rows"}),
                                   frozenset({"colsum"})])
def test_only_the_statistics_asked_for_are_computed(needs):
    """SnapKV and TOVA read the last rows alone: no column sums are made for them (nor any other statistic)."""
    query, keys, values, mask, query_valid, past = make_call(seed=2)
    _, stats = torch_ref.attend_tracking(
        query, keys, values, lambda lo, hi, width: mask[:, :, lo:hi, :width], 0.2, needs, query_valid, past, 4,
    )
    for name in EVERY_STAT:
        assert (getattr(stats, name) is not None) == (name in needs), name


def count_calls(monkeypatch, name):
    calls = []
    original = getattr(torch_ref, name)
    monkeypatch.setattr(torch_ref, name, lambda *args: calls.append(1) or original(*args))
    return calls


@pytest.mark.parametrize("logits", ["ordinary", "overflowing", "underflowing"])
def test_logits_out_of_exp2s_range_take_the_shifted_path_and_stay_exact(monkeypatch, logits):
    """Without each row's maximum, exp2 of large logits overflows and of very negative ones vanishes: such a chunk is
    redone with the maximum subtracted. Ordinary logits never are (the fast path is the one taken)."""
    monkeypatch.setattr(torch_ref, "_CHUNK_QUERIES", 16)
    shifted = count_calls(monkeypatch, "_shifted_exp2_attend")
    query, keys, values, mask, query_valid, past = make_call(seed=3)
    if logits == "overflowing":  # row maxima past 60 in base 2
        query = query * 12.0
    if logits == "underflowing":  # one more dimension adds -53 (natural units) to every logit: softmax is unchanged
        query = torch.cat([query, torch.full_like(query[..., :1], -300.0)], dim=-1)
        keys = torch.cat([keys, torch.ones_like(keys[..., :1])], dim=-1)
        values = torch.cat([values, torch.zeros_like(values[..., :1])], dim=-1)
    scaling = query.shape[-1] ** -0.5
    needs = EVERY_STAT - {"below_uniform"}  # (which always takes the shifted path: see the test below)
    out, stats = torch_ref.attend_tracking(
        query, keys, values, lambda lo, hi, width: mask[:, :, lo:hi, :width], scaling, needs, query_valid, past, 5,
    )
    # float64: at logits of 50-70 float32's own rounding of them moves probabilities by ~1e-5, here and in any reference
    ref_out, ref = dense_reference(query.double(), keys.double(), values.double(), mask, query_valid, scaling, 5)
    tolerance = 1e-5 if logits == "ordinary" else 5e-5
    torch.testing.assert_close(out, ref_out.float(), atol=tolerance, rtol=tolerance)
    for name in needs:
        torch.testing.assert_close(getattr(stats, name), ref[name].float(), atol=2 * tolerance, rtol=2 * tolerance,
                                   msg=name)
    assert bool(out.isfinite().all())
    assert (len(shifted) > 0) == (logits != "ordinary")


def test_below_uniform_counts_come_from_the_shifted_softmax(monkeypatch):
    """A query that sees one key gives it probability 1, never below uniform: exact with the row maximum subtracted
    (exp2(l) * (1 / exp2(l)) can round below 1)."""
    free = count_calls(monkeypatch, "_exp2_attend")
    query, keys, values, _, _, _ = make_call(seed=5, past=0, queries=40)
    only_itself = torch.eye(40, dtype=torch.bool).expand(2, 2, 40, 40)
    _, stats = torch_ref.attend_tracking(query, keys, values, lambda lo, hi, width: only_itself[:, :, lo:hi, :width],
                                         0.2, frozenset({"below_uniform"}), None, 0)
    assert not free
    assert float(stats.below_uniform.max()) == 0.0


def test_tracking_under_autograd_gives_the_same_numbers():
    """The logits buffer is written with ``out=``, which autograd refuses: a call that tracks gradients does not."""
    query, keys, values, _, _, _ = make_call(seed=4, past=0, queries=40)
    with torch.no_grad():
        expected, _ = torch_ref.attend_tracking(query, keys, values, None, 0.2, frozenset({"colsum"}), None, 0)
    out, _ = torch_ref.attend_tracking(query.requires_grad_(), keys, values, None, 0.2, frozenset({"colsum"}), None, 0)
    torch.testing.assert_close(out, expected)
    assert out.requires_grad

"""The cache really holds the budget: per layer, per (row, KV head), after prefill and every decode step."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import StepRecorder, greedy, per_head_counts, uniform_plan
from tiny_models import padded_batch, tiny_model

from kvpolicy.errors import KVPolicyError
from kvpolicy.hf.session import attach
from kvpolicy.recipe.budget import Budget

LENGTHS = (17, 11, 6)


def test_memory_report_is_the_real_storage():
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=LENGTHS)
    session = attach(model, uniform_plan(model, "h2o", Budget(tokens=6)))
    greedy(model, ids, mask, 5, cache=session.new_cache())
    session.detach()
    report = session.last_cache.memory_report()
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * head_dim * 4  # K and V, fp32
    rows, heads, layers = len(LENGTHS), config.num_key_value_heads, config.num_hidden_layers
    assert report.live_kv_bytes == 6 * rows * heads * layers * per_token
    real = sum(t.numel() * t.element_size() for layer in session.last_cache.layers for t in (layer.store.keys, layer.store.values))
    assert report.allocated_kv_bytes == real
    # storage shrank to the budget after the prompt: the budget, one slot for the next token, one scratch slot
    assert report.allocated_kv_bytes == (6 + 2) * rows * heads * layers * per_token
    assert "total" in str(report)


def test_pads_are_never_kept_and_positions_count_real_tokens():
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=LENGTHS)
    session = attach(model, uniform_plan(model, "full"))
    model(input_ids=ids, attention_mask=mask, cache=session.new_cache())
    session.detach()
    kept = session.last_cache.kept_positions(0)
    for row, length in enumerate(LENGTHS):
        assert kept[row] == [list(range(length))] * model.config.num_key_value_heads


def test_streaming_keeps_sinks_and_recent():
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=(17,))
    session = attach(model, uniform_plan(model, "streaming", Budget(tokens=6), sinks=2))
    greedy(model, ids, mask, 3, cache=session.new_cache())
    session.detach()
    # 17 prompt tokens + 2 fed back (the last generated token is never fed)
    assert session.last_cache.kept_positions(1)[0][0] == [0, 1, 15, 16, 17, 18]


def test_window_keeps_the_most_recent():
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=(17,))
    session = attach(model, uniform_plan(model, "window", Budget(tokens=4)))
    model(input_ids=ids, attention_mask=mask, cache=session.new_cache())
    session.detach()
    assert session.last_cache.kept_positions(2)[0][1] == [13, 14, 15, 16]


def test_ratio_budget_needs_a_prompt_length_when_fed_token_by_token():
    model = tiny_model("llama")
    session = attach(model, uniform_plan(model, "h2o", Budget(ratio=0.2)))
    with pytest.raises(KVPolicyError, match="prompt_tokens"):
        model(input_ids=torch.tensor([[5]]), cache=session.new_cache())
    cache = session.new_cache(prompt_tokens=20)
    for token in range(1, 12):
        model(input_ids=torch.tensor([[token]]), cache=cache)
    session.detach()
    assert cache.layers[0].memory()["tokens_max"] == 4


def test_slack_amortizes_compaction():
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=(17,))
    session = attach(model, uniform_plan(model, "h2o", Budget(tokens=5, slack=3)))
    recorder = StepRecorder(lambda: session.last_cache.layers[0].memory()["tokens_max"])
    greedy(model, ids, mask, 9, recorder=recorder, cache=session.new_cache())
    session.detach()
    assert recorder.steps == [5, 6, 7, 8, 5, 6, 7, 8, 5]


def test_aligned_evictions_come_when_a_row_starts_a_new_block():
    """``align``: past its first eviction (budget + slack exceeded), a row over budget evicts when its next token
    lies in a later block of `align` positions than its last eviction did, so the tokens kept past the budget never
    span two blocks; ``slack`` still bounds them. A 17-token prompt, budget 5, slack 7, blocks of 4."""
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=(17,))
    counts = {}
    for align in (0, 4):
        session = attach(model, uniform_plan(model, "h2o", Budget(tokens=5, slack=7, align=align)))
        recorder = StepRecorder(lambda session=session: (int(session.last_cache.layers[0].tokens_seen[0]),
                                                         session.last_cache.layers[0].memory()["tokens_max"]))
        greedy(model, ids, mask, 12, recorder=recorder, cache=session.new_cache())
        session.detach()
        counts[align] = recorder.steps
    # by the rule, written out: evicted at the prompt (17 tokens seen), then at 20, 24, 28 (new blocks of 4)
    seen, evicted_at, expected = 17, 17, [(17, 5)]
    for _ in range(11):
        seen += 1
        if seen // 4 > evicted_at // 4:
            evicted_at = seen
        expected.append((seen, 5 + seen - evicted_at))
    assert counts[4] == expected
    assert [held for _, held in counts[0]] == [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8]  # every slack + 1 steps


def test_rows_with_different_recipes_match_each_recipe_alone():
    from kvpolicy.hf.session import attach_rows

    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=(14,))
    plans = [
        uniform_plan(model, "full"),
        uniform_plan(model, "h2o", Budget(tokens=5)),
        uniform_plan(model, "streaming", Budget(ratio=0.5), sinks=2),
        uniform_plan(model, "window", Budget(tokens=4)),
    ]
    alone = []
    for plan in plans:
        session = attach(model, plan)
        alone.append(greedy(model, ids, mask, 8, cache=session.new_cache())[1])
        session.detach()
    session = attach_rows(model, plans)
    batch = len(plans)
    _, logits = greedy(model, ids.expand(batch, -1), mask.expand(batch, -1), 8, cache=session.new_cache())
    session.detach()
    for row, expected in enumerate(alone):
        torch.testing.assert_close(logits[row : row + 1], expected, atol=1e-4, rtol=1e-4)
    assert [int(n) for n in session.last_cache.layers[0].valid.sum(dim=2)[:, 0]] == [21, 5, 7, 4]


def test_rows_whose_policies_read_different_windows_match_each_recipe_alone():
    """A layer computes `last_rows` for its widest window; each policy must still see only its own rows."""
    from kvpolicy.hf.session import attach_rows

    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=(16,))
    plans = [
        uniform_plan(model, "snapkv", Budget(tokens=9), window=3, kernel=3),
        uniform_plan(model, "snapkv", Budget(tokens=9), window=6, kernel=3),
        uniform_plan(model, "scissorhands", Budget(tokens=8), history_window=2, recent=2),
        uniform_plan(model, "scissorhands", Budget(tokens=8), history_window=5, recent=2),
    ]
    alone = []
    for plan in plans:
        session = attach(model, plan)
        greedy(model, ids, mask, 6, cache=session.new_cache())
        alone.append([session.last_cache.kept_positions(layer)[0] for layer in range(3)])
        session.detach()
    session = attach_rows(model, plans)
    batch = len(plans)
    greedy(model, ids.expand(batch, -1), mask.expand(batch, -1), 6, cache=session.new_cache())
    session.detach()
    together = [[session.last_cache.kept_positions(layer)[row] for layer in range(3)] for row in range(batch)]
    assert together == alone
    assert alone[0] != alone[1] and alone[2] != alone[3]  # the windows matter here, so mixing them would show


def test_slack_amortizes_compaction_in_a_ragged_batch():
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=LENGTHS)
    session = attach(model, uniform_plan(model, "h2o", Budget(ratio=0.5, slack=2)))
    recorder = StepRecorder(lambda: (session.last_cache.layers[0].evictions, per_head_counts(session.last_cache)[0]))
    greedy(model, ids, mask, 7, recorder=recorder, cache=session.new_cache())
    session.detach()
    budgets = torch.tensor([math.ceil(n * 0.5) for n in LENGTHS])
    evictions = [step[0] for step in recorder.steps]
    assert evictions == [1, 1, 1, 2, 2, 2, 3]  # after the prompt, then once every slack + 1 steps
    for step, (_, counts) in enumerate(recorder.steps):
        assert torch.equal(counts[:, 0], budgets + (step % 3)), step

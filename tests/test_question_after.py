"""Compression before the question is known: `kvpolicy compare --question after`, and the probe KVzip scores by.

The after-compression track reads a prompt's context, lets the cache compress it, then reads the question and
answers with nothing evicted after the context (kvpress's protocol). With nothing evicted at all (`full`) both
tracks give the same answer; rows of one batch stay independent however the others evict. A probing policy's
passes leave no trace in the cache but its scores.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import char_tokenizer, padded_batch, tiny_model

import kvpolicy
from kvpolicy.commands.cli import main
from kvpolicy.errors import KVPolicyError
from kvpolicy.hf.cache import cache_keyword
from kvpolicy.recipe import load_recipe, with_budget
from kvpolicy.recipe.budget import Budget
from kvpolicy.tasks import Context, Row
from kvpolicy.tasks.passkey import greedy_answers, make_prompt

KVZIP = {"kvpolicy": 1, "policy": "kvzip", "budget": {"tokens": 40}, "params": {"chunk": 64}}


def rows(*specs):
    return [Row(str(i), None, spec) for i, spec in enumerate(specs)]


def answers(model, tokenizer, specs, question, prompt):
    ctx = Context(model=model, tokenizer=tokenizer, text_ids=torch.zeros(1), question=question)
    return greedy_answers(ctx, rows(*specs), prompt.input_ids, 8, prompt.context_end)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama"), char_tokenizer()


def test_full_answers_alike_in_both_tracks_and_rows_stay_independent(llama):
    """The bug this caught: after the context a row kept every token on ragged storage without settling each pass."""
    model, tokenizer = llama
    prompt = make_prompt(tokenizer, 300, 0.5, "q")
    assert 0 < prompt.context_end < len(prompt.input_ids)
    assert tokenizer.decode(prompt.input_ids[prompt.context_end :]).lstrip("\n").startswith("What is the pass key?")
    full, h2o = load_recipe("full"), with_budget(load_recipe("h2o"), Budget(tokens=30))
    alone = answers(model, tokenizer, [full], "in-prompt", prompt)
    assert answers(model, tokenizer, [full], "after", prompt) == alone
    after_h2o = answers(model, tokenizer, [h2o], "after", prompt)
    assert answers(model, tokenizer, [full, h2o], "after", prompt) == alone + after_h2o
    assert answers(model, tokenizer, [h2o], "in-prompt", prompt) != after_h2o  # the track changes what is kept


def test_after_the_context_nothing_is_evicted(llama):
    model, tokenizer = llama
    prompt = make_prompt(tokenizer, 300, 0.5, "q")
    session = kvpolicy.attach(model, with_budget(load_recipe("h2o"), Budget(tokens=30)))
    cache = session.new_cache()
    ids = torch.tensor([prompt.input_ids])
    ctx = Context(model=model, tokenizer=tokenizer, text_ids=torch.zeros(1), question="after")
    with torch.inference_mode():
        from kvpolicy.tasks.base import forward, prefill

        prefill(ctx, ids, cache, prompt.context_end)
        question = len(prompt.input_ids) - prompt.context_end
        assert all(layer.valid.sum(dim=2).eq(30 + question).all() for layer in cache.layers)
        forward(model, torch.tensor([[5]]), cache)
        assert all(layer.valid.sum(dim=2).eq(31 + question).all() for layer in cache.layers)
    session.detach()


def test_the_probe_leaves_the_cache_as_the_prompt_left_it_and_evicts_once_over(llama):
    """A padded batch: positions, lengths and what the next pass sees are the prompt's; each head keeps its budget."""
    model, tokenizer = llama
    ids, mask = padded_batch(lengths=(70, 50, 30))
    plain = kvpolicy.attach(model, "full")
    full_cache = plain.new_cache()
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, **{cache_keyword(model): full_cache})
    plain.detach()
    session = kvpolicy.attach(model, KVZIP, tokenizer=tokenizer)
    cache = session.new_cache()
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, **{cache_keyword(model): cache})
    assert cache.probe.state == "done"
    for ours, reference in zip(cache.layers, full_cache.layers, strict=True):
        assert ours.slots_seen == reference.slots_seen == 70
        assert torch.equal(ours.tokens_seen, torch.tensor([70, 50, 30]))
        assert ours.valid.sum(dim=2).tolist() == [[40, 40], [40, 40], [30, 30]]
        assert int(ours.positions[ours.valid].max()) < 70  # no probe token stayed
    session.detach()


def test_a_probing_policy_without_a_tokenizer_or_with_tiers_says_what_to_do(llama):
    model, tokenizer = llama
    with pytest.raises(KVPolicyError, match=r"policy 'kvzip' writes its repeat request with the model's tokenizer"):
        kvpolicy.attach(model, KVZIP)
    tiered = {**KVZIP, "budget": {"tokens": 40, "tiers": [{"bits": 16, "share": 0.5}, {"bits": 4}]}}
    session = kvpolicy.attach(model, tiered, tokenizer=tokenizer)
    with pytest.raises(KVPolicyError, match=r"probe, which precision tiers do not support yet"):
        session.new_cache()
    session.detach()
    session = kvpolicy.attach(model, KVZIP, tokenizer=tokenizer)
    embeds = model.get_input_embeddings()(torch.tensor([[5, 6, 7]]))
    with pytest.raises(KVPolicyError, match=r"gave no input_ids"), torch.inference_mode():
        model(inputs_embeds=embeds, **{cache_keyword(model): session.new_cache()})
    session.detach()


def test_compare_runs_both_tracks_side_by_side(tiny, tmp_path):
    folder, text = tiny
    out = tmp_path / "run"
    code = main(["compare", "--model", folder, "--text-file", text, "--tokens", "64", "--prompt-tokens", "300",
                 "--recipes", "h2o", "kvzip", "--budgets", "0.2", "--tasks", "passkey", "--question", "in-prompt",
                 "after", "--out", str(out)])
    assert code == 0
    found = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {(r["task"], r["recipe"]) for r in found} == {(task, recipe) for task in ("passkey", "passkey/after")
                                                         for recipe in ("full", "h2o", "kvzip")}
    by = {(r["task"], r["recipe"]): r for r in found}
    assert by[("passkey", "full")]["answers"] == by[("passkey/after", "full")]["answers"]
    assert by[("passkey/after", "kvzip")]["question"] == "after" and by[("passkey/after", "kvzip")]["settings"]["question"] == "after"
    assert "--question in-prompt after" in found[0]["command"]

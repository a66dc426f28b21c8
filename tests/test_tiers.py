"""Precision tiers and byte budgets (#15): recipes, tier sizes, the tiered store on a tiny model and on SmolLM2."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from helpers import uniform_plan
from tiny_models import VOCAB, tiny_model

from kvpolicy.errors import KVPolicyError, RecipeError
from kvpolicy.hf.session import attach
from kvpolicy.recipe import load_recipe
from kvpolicy.recipe.budget import Budget, Tier
from kvpolicy.storage.tier_formats import TierCosts
from kvpolicy.storage.tier_sizing import tier_sizes, waiting_room
from kvpolicy.storage.tiered import TieredStore


def recipe(tmp_path, body: str):
    path = tmp_path / "r.yaml"
    path.write_text("kvpolicy: 1\n" + textwrap.dedent(body))
    return load_recipe(str(path))


def stream(model, session, ids: torch.Tensor, prompt: int, check=None) -> tuple[torch.Tensor, object]:
    """Prefill ``prompt`` tokens, then feed the rest one at a time; ``check(cache)`` after every pass. Logits of every
    fed token's successor, [n, vocab]."""
    cache = session.new_cache(prompt_tokens=prompt)
    out = []
    with torch.inference_mode():
        logits = model(input_ids=ids[:, :prompt], cache=cache, use_cache=True).logits[:, -1]
        if check:
            check(cache)
        for index in range(prompt, ids.shape[1]):
            out.append(logits)
            logits = model(input_ids=ids[:, index : index + 1], cache=cache, use_cache=True).logits[:, -1]
            if check:
                check(cache)
    return torch.cat(out), cache


def random_ids(length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- recipes --------------------------------------------------------------------------------------------------------
def test_builtin_tier_recipes_resolve_and_say_their_tiers():
    mixed = load_recipe("h2o-mixed").resolve(3, 2).describe()
    assert "0.2 of the prompt's 16-bit bytes (+16 slack) in tiers 16-bit 0.5 + 4-bit rest" in mixed
    kivi = load_recipe("kivi").resolve(3, 2).describe()
    assert "full()" in kivi and "unbounded (+32 slack) in tiers 16-bit 128 tokens + 4-bit rest" in kivi


@pytest.mark.parametrize("budget, line, fragment", [
    ("budget: {memory: 1.5}", 3, "budget.memory: must be a number in (0, 1], got 1.5"),
    ("budget: {memory: 0.2, tokens: 5}", 3, "give exactly one of ratio/tokens/memory, not tokens and memory"),
    ("budget:\n  memory: 0.2\n  tiers:\n    - {bits: 4}\n", 6, "tiers[0].bits: the first tier must keep 16 bits"),
    ("budget:\n  memory: 0.2\n  tiers:\n    - {bits: 16, share: 0.5}\n    - {bits: 3}\n", 7,
     "tiers[1].bits: must be one of 16, 8, 4, 2, got 3"),
    ("budget: {memory: 0.2, tiers: [{bits: 16, share: 0.5}, {bits: 16}]}", 3, "16 bits after a tier of 16"),
    ("budget: {memory: 0.2, tiers: [{bits: 16}, {bits: 4}]}", 3, "every tier but the last needs a size"),
    ("budget: {memory: 0.2, tiers: [{bits: 16, share: 0.7}, {bits: 8, share: 0.4}, {bits: 4}]}", 3,
     "the tiers' shares add up to 1.1"),
    ("budget: {memory: 0.2, tiers: [{bits: 16, share: 0.5}, {bits: 4, group: 12}]}", 3, "must be a power of two >= 8"),
    ("budget: {memory: 0.2, tiers: [{bits: 16, share: 0.5}, {bits: 4, keys: tokn}]}", 3, 'did you mean "token"'),
    ("budget: {memory: 0.2, tiers: [{bits: 16, shar: 0.5}, {bits: 4}]}", 3, 'unknown key (did you mean "share"?)'),
    ("budget: {tiers: [{bits: 16, share: 0.5}, {bits: 4}]}", 3, "a share needs a budget to share"),
    ("budget: {memory: 0.2, tiers: {bits: 16}}", 3, "expected a list of tiers"),
])
def test_memory_and_tier_errors_name_the_key_and_line(tmp_path, budget, line, fragment):
    with pytest.raises(RecipeError) as error:
        recipe(tmp_path, f"policy: h2o\n{budget}").resolve(2, 2)
    assert f"r.yaml:{line}:" in str(error.value) and fragment in str(error.value)


def test_evicting_policy_with_tiers_but_no_amount_needs_a_budget(tmp_path):
    with pytest.raises(RecipeError, match="evicts tokens but has no budget"):
        recipe(tmp_path, "policy: h2o\nbudget: {tiers: [{bits: 16, tokens: 8}, {bits: 4}]}").resolve(2, 2)


def test_layer_schedules_spread_memory_budgets(tmp_path):
    plan = recipe(tmp_path, "policy: h2o\nbudget: {memory: 0.2, schedule: pyramid, beta: 2, "
                            "tiers: [{bits: 16, share: 0.5}, {bits: 4}]}").resolve(4, 1)
    memories = [layer.heads[0].budget.memory for layer in plan.layers]
    assert memories == sorted(memories, reverse=True) and math.isclose(sum(memories) / 4, 0.2)
    assert all(layer.heads[0].budget.tiers[1].bits == 4 for layer in plan.layers)


# --- tier sizes -------------------------------------------------------------------------------------------------------
COSTS = TierCosts(token=(256 + 9, 72 + 9), cell=256, reference_token=256)  # head size 64: 16-bit, 4-bit (+ metadata)


def test_tier_sizes_from_tokens_and_from_bytes():
    tiers = (Tier(16, share=0.25), Tier(4))
    assert tier_sizes(Budget(tokens=100, tiers=tiers), 1000, COSTS, slack=0) == [25, 75]
    assert tier_sizes(Budget(ratio=0.1, tiers=tiers), 1000, COSTS, slack=0) == [25, 75]
    money = math.floor(0.2 * 1000 * 256) - 256
    top = int(0.25 * money) // 265 - 1  # the 16-bit share also pays for the token waiting between evictions
    low = (money - (top + 1) * 265) // 81
    assert tier_sizes(Budget(memory=0.2, tiers=tiers), 1000, COSTS, slack=0) == [top, low]
    alone = TierCosts(token=(265,), cell=0, reference_token=256)
    assert tier_sizes(Budget(memory=0.2, slack=3), 1000, alone, slack=3) == [math.floor(0.2 * 1000 * 256) // 265 - 4]
    fixed = (Tier(16, tokens=64), Tier(2))
    assert tier_sizes(Budget(tiers=fixed), 1000, COSTS, slack=0)[0] == 64  # nothing bounds the rest


def test_the_slack_waits_in_at_most_an_eighth_of_the_16_bit_tier():
    """h2o-mixed's slack of 16 holds at 4K tokens, but on a 300-token prompt it would take over half of the 16-bit tier
    (measured on SmolLM2, 300 + 100 tokens at 20%: perplexity 14.44 with 16 waiting, against 14.22 for eviction alone)."""
    mixed = Budget(memory=0.2, slack=16, tiers=(Tier(16, share=0.5), Tier(4)))
    assert waiting_room([(mixed, 4000)], COSTS, 16) == 16
    room = tier_sizes(mixed, 300, COSTS, 0)[0] + 1
    assert room < 40 and waiting_room([(mixed, 300)], COSTS, 16) == room // 8
    assert waiting_room([(mixed, 4000), (mixed, 300)], COSTS, 16) == room // 8  # one slack per layer: the tightest
    kivi = Budget(slack=32, tiers=(Tier(16, tokens=128), Tier(4)))  # a 16-bit tier in tokens: waiting costs it nothing
    assert waiting_room([(kivi, 300)], COSTS, 32) == 32


def test_a_memory_budget_too_small_for_its_tiers_says_so():
    with pytest.raises(KVPolicyError, match="too few for the tiers .* raise memory"):
        tier_sizes(Budget(memory=0.001, tiers=(Tier(16, share=0.5), Tier(4))), 100, COSTS, slack=0)


# --- the tiered store on a tiny model ---------------------------------------------------------------------------------
def layer_tiers_of_positions(layer) -> dict[tuple[int, int, int], int]:
    """(row, head, position) -> tier index of every kept token of a tiered layer."""
    store: TieredStore = layer.store
    out = {}
    valid, positions = store.slots.valid[:, :, : store.used], store.slots.positions[:, :, : store.used]
    for tier in range(len(store.tiers)):
        lo, hi = store.offset(tier), min(store.offset(tier) + store.caps[tier], store.used)
        for b, h, s in (valid[:, :, lo:hi]).nonzero().tolist():
            out[(b, h, int(positions[b, h, lo + s]))] = tier
    return out


@pytest.mark.parametrize("keys", ["channel", "cell", "token"])
def test_byte_budget_held_after_every_pass_and_tokens_only_move_down(tmp_path, keys):
    model = tiny_model("llama")
    spec = recipe(tmp_path, "policy: h2o\nbudget: {memory: 0.3, slack: 2, tiers: [{bits: 16, share: 0.4}, "
                            f"{{bits: 8, share: 0.3, keys: {keys}}}, {{bits: 2, keys: {keys}}}]}}")
    session = attach(model, spec)
    prompt, batch = 48, 2
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    budget_bytes = math.floor(0.3 * prompt * 4 * head_dim) * batch * model.config.num_key_value_heads
    history: dict[tuple, int] = {}
    steps = {"n": 0}

    def check(cache):
        steps["n"] += 1
        for index, layer in enumerate(cache.layers):
            assert layer.nbytes() <= budget_bytes, (steps["n"], index, layer.nbytes(), budget_bytes)
            sizes = layer.budgets.tier_sizes
            tiers = layer_tiers_of_positions(layer)
            counts = torch.zeros_like(sizes)
            for (b, h, _), tier in tiers.items():
                counts[tier, b, h] += 1
            assert bool((counts[1:] <= sizes[1:]).all()) and bool((counts[0] <= sizes[0] + layer.budgets.slack).all())
            for key, tier in tiers.items():
                assert history.get((index, *key), 0) <= tier, f"token {key} of layer {index} moved up a tier"
                history[(index, *key)] = tier

    ids = random_ids(prompt + 60, batch=batch)
    stream(model, session, ids, prompt, check)
    assert steps["n"] == 61 and set(history.values()) == {0, 1, 2}  # every tier was used


def test_a_16_bit_tier_in_bfloat16_is_the_dense_cache_exactly():
    model = tiny_model("llama").to(torch.bfloat16)
    ids = random_ids(70, seed=3)
    plain = attach(model, uniform_plan(model, "h2o", Budget(tokens=20)))
    tiered = attach(model, uniform_plan(model, "h2o", Budget(tokens=20, tiers=(Tier(16),))))
    logits_dense, cache_dense = stream(model, plain, ids, 30)
    logits_tiered, cache_tiered = stream(model, tiered, ids, 30)
    assert isinstance(cache_tiered.layers[0].store, TieredStore)
    assert torch.equal(logits_dense, logits_tiered)
    assert [layer.kept_positions() for layer in cache_dense.layers] == [
        layer.kept_positions() for layer in cache_tiered.layers]


def test_kivi_style_tiers_keep_every_token_and_the_recent_ones_at_16_bits(tmp_path):
    model = tiny_model("llama")
    session = attach(model, recipe(tmp_path, "policy: full\nbudget: {tiers: [{bits: 16, tokens: 8}, {bits: 4}]}"))
    _, cache = stream(model, session, random_ids(50), 20)
    for layer in cache.layers:
        tiers = layer_tiers_of_positions(layer)
        assert sorted(p for (_, _, p) in tiers) == sorted(list(range(50)) * 2)  # every token of both heads
        assert {p for (b, h, p), t in tiers.items() if t == 0} == set(range(42, 50))


def test_a_policy_that_evicts_nothing_keeps_its_recipes_slack(tmp_path):
    """`full` with tiers (KIVI-style) moves tokens down every `slack` + 1 tokens, not at every step."""
    spec = recipe(tmp_path, "policy: full\nbudget: {slack: 4, tiers: [{bits: 16, tokens: 8}, {bits: 4}]}")
    assert spec.resolve(2, 2).layers[0].heads[0].budget.slack == 4
    model = tiny_model("llama")
    top_sizes = []
    _, cache = stream(model, attach(model, spec), random_ids(50), 20,
                      check=lambda c: top_sizes.append(sum(t == 0 for t in layer_tiers_of_positions(c.layers[0]).values())))
    assert max(top_sizes) == 2 * (8 + 4) and min(top_sizes[1:]) >= 2 * 8  # both heads: up to 4 tokens wait at 16 bits
    assert len(set(top_sizes)) > 2


@pytest.mark.parametrize("bits, bound", [(8, 0.02), (4, 0.15), (2, 0.6)])
def test_quantized_tiers_stay_close_to_the_full_cache(tmp_path, bits, bound):
    """Nothing evicted, everything past 4 recent tokens quantized: the logits' error shrinks with the bits."""
    model = tiny_model("llama")
    ids = random_ids(60, seed=5)
    full, _ = stream(model, attach(model, load_recipe("full")), ids, 40)
    quantized, cache = stream(model, attach(model, recipe(
        tmp_path, f"policy: full\nbudget: {{tiers: [{{bits: 16, tokens: 4}}, {{bits: {bits}, group: 16}}]}}")), ids, 40)
    error = float((quantized - full).norm() / full.norm())
    assert 0 < error < bound, error
    report = str(cache.memory_report())
    assert f"{bits}-bit" in report and "tiered" in report


def test_policies_tiers_cannot_serve_yet_are_refused(tmp_path):
    model = tiny_model("llama")
    session = attach(model, recipe(tmp_path, "policy: adakv\nbudget: {memory: 0.3, tiers: [{bits: 16, share: 0.5}, "
                                             "{bits: 4}]}"))
    with pytest.raises(KVPolicyError, match="'adakv' splits budgets among its heads.*precision tiers"):
        stream(model, session, random_ids(30), 20)


def test_a_group_that_does_not_divide_the_head_size_is_named():
    from kvpolicy.storage.tiered import check_head_dim

    with pytest.raises(KVPolicyError, match="groups 32 channels per scale, but the head size is 80"):
        check_head_dim(80, (Tier(16, share=0.5), Tier(4, group=32)), 3)
    check_head_dim(16, (Tier(16, share=0.5), Tier(4, group=32)), 3)  # wider than the head: one group per token


def test_compare_at_equal_bytes(tiny, tmp_path, capsys):
    """--budget-unit memory labels and records its rows; fidelity runs tiered rows (batched apart from the full cache)
    and a quantized cache that evicts nothing is measured, not taken for the full cache."""
    from test_compare import compare, results

    out = tmp_path / "sweep"
    mixed = tmp_path / "mixed16.yaml"
    mixed.write_text("kvpolicy: 1\npolicy: h2o\nbudget: {memory: 0.2, tiers: [{bits: 16, share: 0.5}, {bits: 4}]}\n")
    quantized = tmp_path / "kivi2.yaml"
    quantized.write_text("kvpolicy: 1\npolicy: full\nbudget: {tiers: [{bits: 16, tokens: 8}, {bits: 2}]}\n")
    assert compare(tiny, out, "--recipes", "h2o", str(mixed), str(quantized), "--budgets", "0.3", "--budget-unit",
                   "memory", "--tasks", "ppl", "memory", "fidelity") == 0
    rows = results(out)
    budgeted = [r for r in rows if r["budget"] is not None]
    assert {r["budget"] for r in budgeted} == {"0.3 mem"} and all(r["budget_memory"] == 0.3 for r in budgeted)
    assert len(budgeted) == 6  # h2o and the mixed recipe, three tasks each
    fidelity = {r["recipe"]: r for r in rows if r["task"] == "fidelity"}
    assert fidelity["full"]["kl"] == 0.0 and fidelity["kivi2"]["kl"] > 0 and fidelity["mixed16"]["kl"] > 0
    assert "30% bytes" in capsys.readouterr().out
    # the quality plot puts the recipe that keeps every token at the bytes its memory row measured
    from kvpolicy.commands.common import pyplot
    from kvpolicy.commands.compare_report import _panel, own_bytes_of

    own = own_bytes_of(rows)
    kivi_bytes = next(r["bytes_vs_16bit"] for r in rows if r["task"] == "memory" and r["recipe"] == "kivi2")
    assert set(own) == {"kivi2"} and own["kivi2"] == pytest.approx(100 * kivi_bytes) and 0 < kivi_bytes < 2
    figure, ax = pyplot().subplots()
    _panel(ax, [r for r in rows if r["task"] == "ppl"], "ppl", {"0.3 mem": 30.0}, own)
    drawn = {line.get_label(): line for line in ax.get_lines()}
    point = next(line for label, line in drawn.items() if label.startswith("kivi2"))
    assert list(point.get_xdata()) == [pytest.approx(100 * kivi_bytes)]
    assert list(drawn["h2o"].get_xdata()) == [30.0]
    pyplot().close(figure)


@pytest.mark.slow
def test_h2o_mixed_on_smollm2_holds_its_bytes_and_beats_eviction_at_equal_bytes():
    """SmolLM2, 300 prompt tokens of pydoc text then 100 one at a time, 20% of a 16-bit cache's bytes: every layer holds
    at most its bytes after every pass, and H2O deciding precision beats H2O evicting (measured at 400 + 200 tokens:
    perplexity 10.49 vs 11.19, full cache 9.66)."""
    import kvpolicy
    from kvpolicy.commands.common import read_text
    from kvpolicy.recipe import with_budget

    model, tokenizer = kvpolicy.load_model("smollm2")
    ids = tokenizer(read_text(None)[0], return_tensors="pt")["input_ids"][:, 5000:5400]
    prompt, kv_heads, head_dim = 300, model.config.num_key_value_heads, 64
    per_layer = math.floor(0.2 * prompt * 4 * head_dim) * kv_heads

    def within(cache):
        held = [layer.nbytes() for layer in cache.layers]
        assert max(held) <= per_layer, (max(held), per_layer)

    def perplexity(logits):
        return math.exp(float(torch.nn.functional.cross_entropy(logits, ids[0, prompt:])))

    with torch.inference_mode():  # a full cache fed token by token equals one pass over the whole text
        full = model(input_ids=ids).logits[0, prompt - 1 : -1]
    mixed, cache = stream(model, attach(model, load_recipe("h2o-mixed")), ids, prompt, within)
    evicting, _ = stream(model, attach(model, with_budget(load_recipe("h2o"), Budget(memory=0.2))), ids, prompt, within)
    assert perplexity(full) < perplexity(mixed) < perplexity(evicting)
    report = str(cache.memory_report())
    assert "16-bit" in report and "4-bit" in report


def test_a_long_stream_holds_its_bytes_flat(tiny, tmp_path):
    """`kvpolicy bench --stream-tokens` with a budget in bytes and three tiers: after warm-up everything the cache
    holds (K/V, scales, ranges, per-slot metadata) stays flat, at or under the budget."""
    from test_bench import read

    from kvpolicy.commands.cli import main

    model, text = tiny
    recipe_file = tmp_path / "tiers.yaml"
    recipe_file.write_text("kvpolicy: 1\npolicy: h2o\nbudget: {memory: 0.3, tiers: [{bits: 16, share: 0.4}, "
                           "{bits: 4, share: 0.3}, {bits: 2}]}\n")
    out = tmp_path / "stream"
    assert main(["bench", "--model", model, "--text-file", text, "--recipe", str(recipe_file), "--stream-tokens", "900",
                 "--stream-budget", "200", "--stream-chunk", "1", "--every", "50", "--threads", "1",
                 "--out", str(out)]) == 0
    summary = read(out / "bench.jsonl")[-1]
    assert summary["samples_after_warmup"] >= 8 and summary["live_over_budget"] <= 0
    assert summary["allocated_spread"] <= 0.01 and summary["flat"] is True


def test_rows_of_different_budgets_keep_their_slack(tmp_path):
    """A batch of rows at 40% and 80% of the bytes (what `compare` runs as one batch): each cell counts its own 16-bit
    tokens, so the smaller row's tier does not end the slack of every cell at every step (it did: one eviction per
    token, at up to 6x the time a token of a 4,000-token perplexity run)."""
    from kvpolicy.hf.session import attach_rows

    model = tiny_model("llama")
    tiers = "  tiers: [{bits: 16, share: 0.5}, {bits: 4}]\n"
    plans = []
    for memory in (0.4, 0.8):
        path = tmp_path / f"m{memory}.yaml"
        path.write_text(f"kvpolicy: 1\npolicy: h2o\nbudget:\n  memory: {memory}\n  slack: 4\n" + tiers)
        plans.append(load_recipe(str(path)))
    session = attach_rows(model, plans)
    prompt, fed = 200, 40
    ids = random_ids(prompt + fed, batch=2)
    cache = session.new_cache(prompt_tokens=prompt)
    with torch.inference_mode():
        model(input_ids=ids[:, :prompt], cache=cache, use_cache=True)
        assert all(layer.budgets.slack == 4 for layer in cache.layers)
        before = [layer.evictions for layer in cache.layers]
        for index in range(prompt, prompt + fed):
            model(input_ids=ids[:, index : index + 1], cache=cache, use_cache=True)
    sizes = cache.layers[0].budgets.tier_sizes[0]
    assert int(sizes.min()) < int(sizes.max())  # the rows' 16-bit tiers differ
    for layer, first in zip(cache.layers, before, strict=True):
        assert layer.evictions - first <= fed // 5 + 1, layer.evictions - first

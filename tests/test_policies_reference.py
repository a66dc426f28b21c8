"""Scissorhands, LazyEviction, RoCo, TOVA, SnapKV, AdaKV and FastGen keep exactly what a brute-force reference keeps, at every step.

Each reference (tests/policy_references.py) computes attention by hand over Python sets
and applies the paper's rule to Python floats; kvpolicy must keep the same positions per
(layer, batch row, KV head) after the prefill and after every decode step, and generate
the same tokens. Left-padded batches, GQA (llama, 3 query heads per KV head) and MHA (opt).
"""

from __future__ import annotations

import pytest
from helpers import run_against_reference, uniform_plan
from policy_references import (
    BruteForceAdaKV,
    BruteForceD2O,
    BruteForceExpectedAttention,
    BruteForceFastGen,
    BruteForceH2OKVzip,
    BruteForceKVzip,
    BruteForceLazy,
    BruteForceRoCo,
    BruteForceScissorhands,
    BruteForceSnapKV,
    BruteForceTOVA,
)
from tiny_models import padded_batch, tiny_model

from kvpolicy.errors import KVPolicyError
from kvpolicy.hf.session import attach, model_shape
from kvpolicy.recipe.budget import Budget
from kvpolicy.recipe.plan import HeadPlan, LayerPlan, Plan
from kvpolicy.registry import get_registry

STEPS = 9  # the prefill pass plus 8 decode steps
FG_SPECIAL = (3, 5)
FG_PUNCT = tuple(range(10, 128, 9))
FG_CANDIDATES = ("local", "punct", "frequency", "punct+local", "frequency+local", "full")

CASES = {
    "tova": (lambda: BruteForceTOVA(7), "tova", Budget(tokens=7), {}),
    "snapkv-avg": (lambda: BruteForceSnapKV(8, window=4, kernel=3), "snapkv", Budget(tokens=8), {"window": 4, "kernel": 3}),
    "snapkv-max": (
        lambda: BruteForceSnapKV(9, window=3, kernel=5, pooling="max"),
        "snapkv", Budget(tokens=9), {"window": 3, "kernel": 5, "pooling": "max"},
    ),
    "snapkv-evict-oldest": (
        lambda: BruteForceSnapKV(8, window=4, kernel=3, decode="evict_oldest"),
        "snapkv", Budget(tokens=8), {"window": 4, "kernel": 3, "decode": "evict_oldest"},
    ),
    # w = 10: the 17- and 12-token prompts count their last 10 queries, the 9-token one all of them;
    # slack 2: the cache grows to 8 and drops 3 tokens at once (Scissorhands' amortized compression)
    "scissorhands": (
        lambda: BruteForceScissorhands(6, slack=2, history_window=10, recent=2),
        "scissorhands", Budget(tokens=6, slack=2), {"history_window": 10, "recent": 2},
    ),
    # window 3: evicts every 3 tokens (from 8 back to 6), the 3 newest pinned, the prompts' last 3 queries observed
    "lazy": (lambda: BruteForceLazy(6, window=3, threshold=1.0), "lazy", Budget(tokens=6),
             {"window": 3, "threshold": 1.0}),
    # recalls at 1.5x the uniform share; window 2: the prompts' last 2 queries, an eviction every other step
    "lazy-strict": (lambda: BruteForceLazy(7, window=2, threshold=1.5), "lazy", Budget(tokens=7),
                    {"window": 2, "threshold": 1.5}),
    # D2O: H2O's ranking, every evicted token merged or dropped by its head's EMA threshold, layer budgets from the
    # layers' attention sparsity (fixed at each row's first eviction)
    "d2o": (lambda: BruteForceD2O(6), "d2o", Budget(tokens=6), {}),
    "d2o-wide": (lambda: BruteForceD2O(11, recent_ratio=0.3, ema_keep=0.3, ema_new=0.7), "d2o", Budget(tokens=11),
                 {"recent_ratio": 0.3, "ema_keep": 0.3, "ema_new": 0.7}),
    "d2o-merge-only": (lambda: BruteForceD2O(7, layer_budgets=False), "d2o", Budget(tokens=7), {"layer_budgets": False}),
    # the layers' sparsity as the authors' code reads it: heads' variances min-max normalized within the layer
    "d2o-head-range": (lambda: BruteForceD2O(11, sparsity="head_range"), "d2o", Budget(tokens=11),
                       {"sparsity": "head_range"}),
    # a kept token weighs the tokens it stands for: merged ones carry their own count along
    "d2o-mass": (lambda: BruteForceD2O(5, keep_mass=True), "d2o", Budget(tokens=5), {"keep_mass": True}),
    # a merged key counts as the tokens it stands for in softmax (log n on its logits), with and without layer budgets
    "d2o-proportional": (lambda: BruteForceD2O(5, keep_mass=True, proportional=True), "d2o", Budget(tokens=5),
                         {"keep_mass": True, "proportional": True}),
    "d2o-proportional-merge-only": (lambda: BruteForceD2O(6, layer_budgets=False, proportional=True), "d2o",
                                    Budget(tokens=6), {"layer_budgets": False, "proportional": True}),
    # protected: 1 sink + 4 (half the budget): the 3 least stable other tokens stay out of the scope
    "roco": (
        lambda: BruteForceRoCo(8, recent_ratio=0.5, sink_length=1, recent_tokens=1),
        "roco", Budget(tokens=8), {"recent_ratio": 0.5, "sink_length": 1, "recent_tokens": 1},
    ),
    # protected (2 sinks + 1) < sinks + recent: some always-protected tokens fall in the scope
    "roco-small": (
        lambda: BruteForceRoCo(6, recent_ratio=0.2, sink_length=2, recent_tokens=3),
        "roco", Budget(tokens=6), {"recent_ratio": 0.2, "sink_length": 2, "recent_tokens": 3},
    ),
    # AdaKV: per-head budgets summing to heads x 8 per layer and row, set at the row's first eviction: the
    # prefill for the 17- and 12-token prompts; for the 6-token one (a scored prompt under budget) at the
    # third decode step, when its window and generated tokens are pinned and 3 prompt tokens compete
    "adakv": (
        lambda: BruteForceAdaKV(8, window=3, kernel=3, alpha=0.2),
        "adakv", Budget(tokens=8), {"window": 3, "kernel": 3, "alpha": 0.2},
    ),
    "adakv-max-half": (
        lambda: BruteForceAdaKV(9, window=2, kernel=5, alpha=0.5, pooling="max", decode="evict_oldest"),
        "adakv", Budget(tokens=9), {"window": 2, "kernel": 5, "alpha": 0.5, "pooling": "max", "decode": "evict_oldest"},
    ),
    # FastGen: token sets given as ids (the tiny models have no tokenizer); random prompts hold a few of each
    "fastgen": (
        lambda: BruteForceFastGen(FG_SPECIAL, FG_PUNCT),
        "fastgen", None, {"special_tokens": FG_SPECIAL, "punct_tokens": FG_PUNCT},
    ),
    "fastgen-mean-l1": (
        lambda: BruteForceFastGen(FG_SPECIAL, FG_PUNCT, threshold=0.7, recovery="l1", gqa="mean", sinks=1),
        "fastgen", None,
        {"special_tokens": FG_SPECIAL, "punct_tokens": FG_PUNCT, "threshold": 0.7, "recovery": "l1", "gqa": "mean",
         "sinks": 1},
    ),
    # candidates outside the paper's list, ordered by what they keep on each prompt, not by the list
    "fastgen-candidates": (
        lambda: BruteForceFastGen(FG_SPECIAL, FG_PUNCT, threshold=0.6, local_ratio=0.2, frequency_ratio=0.25,
                                  candidates=FG_CANDIDATES),
        "fastgen", None,
        {"special_tokens": FG_SPECIAL, "punct_tokens": FG_PUNCT, "threshold": 0.6, "local_ratio": 0.2,
         "frequency_ratio": 0.25, "candidates": FG_CANDIDATES},
    ),
    "fastgen-fixed": (
        lambda: BruteForceFastGen(FG_SPECIAL, FG_PUNCT, pattern="punct+frequency", frequency_ratio=0.4),
        "fastgen", None,
        {"special_tokens": FG_SPECIAL, "punct_tokens": FG_PUNCT, "pattern": "punct+frequency", "frequency_ratio": 0.4},
    ),
}
# the short prompt of the snapkv cases (3 tokens) is no longer than the window: nothing to score
LENGTHS = {"snapkv": (17, 12, 3), "adakv": (17, 12, 6)}


@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_bruteforce(case, arch):
    make_reference, policy, budget, params = CASES[case]
    model = tiny_model(arch)
    ids, mask = padded_batch(lengths=LENGTHS.get(policy, (17, 12, 9)))

    reference = make_reference()
    reference.layer_count = model.config.num_hidden_layers
    steps = run_against_reference(model, reference, uniform_plan(model, policy, budget, **params), ids, mask, STEPS)
    layers = range(model.config.num_hidden_layers)
    if policy == "fastgen":  # the same pattern per (layer, row, KV head), and heads of one layer differ
        cache = reference.kvpolicy_cache
        labels = {(layer, b, h): set(label.split("+")) for layer in layers
                  for b, row in enumerate(cache.layers[layer].cell_labels()) for h, label in enumerate(row)}
        assert labels == {key: set(pattern.split("+")) for key, pattern in reference.patterns.items()}
        assert any(len(head) < 17 for layer in layers for head in steps[0][layer][0])  # some heads compress
        if "pattern" not in params:
            assert len({frozenset(p) for p in labels.values()}) > 1, labels
        return
    assert all(len(head) < 17 for head in steps[0][0][0])  # the longest prompt was really compressed
    if arch == "llama" and policy != "tova":  # per-head policies: the heads of a layer choose differently
        assert any(row[0] != row[1] for step in steps for layer in layers for row in step[layer])
    if policy == "d2o":  # tokens were merged (and logits still equal: the merges matched); layers' budgets differ
        assert reference.merges > 0
        if case == "d2o-wide" and arch == "llama":
            assert len({tuple(b) for b in reference.budgets.values()}) > 1, reference.budgets
        if case == "d2o-head-range":  # 4 heads (OPT): layers differ; 2 KV heads (llama): each layer's mean is 0.5
            assert (len({tuple(b) for b in reference.budgets.values()}) > 1) == (arch == "opt"), reference.budgets
    if policy == "adakv":  # heads of a layer keep different numbers of tokens, summing to the layer's budget
        counts = [[len(head) for head in row] for step in steps for layer in layers for row in step[layer]]
        assert any(len(set(row)) > 1 for row in counts)
        assert all(sum(row) <= budget.tokens * len(row) for row in counts)


@pytest.mark.parametrize("proportional", [False, True])
@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_d2o_with_budgets_per_head_matches_bruteforce_on_ragged_storage(arch, proportional):
    """KV heads with their own budgets (5 and 10 here, 3 to 10 on OPT's four heads) scaled by one layer share: the
    cells differ enough for ragged storage, where merges must land in the right segment rows (and, with proportional
    attention, each slot's count of merged tokens must move with it)."""
    model = tiny_model(arch)
    layers, heads = model_shape(model)
    budgets = [5, 10] if heads == 2 else [3, 10, 6, 8]
    params = get_registry().get("d2o").Params(keep_mass=proportional, proportional=proportional)
    plan = Plan("d2o-heads", [LayerPlan([HeadPlan("d2o", params, Budget(tokens=n)) for n in budgets])
                              for _ in range(layers)])
    ids, mask = padded_batch(lengths=(17, 12, 9))
    reference = BruteForceD2O(max(budgets), head_budgets=budgets, keep_mass=proportional, proportional=proportional)
    reference.layer_count = layers
    run_against_reference(model, reference, plan, ids, mask, STEPS)
    cache = reference.kvpolicy_cache
    assert reference.merges > 0 and all(layer.ragged for layer in cache.layers)


KVZIP_REQUEST, KVZIP_NEXT = "Say it all again.", "Go on from"


@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize("policy", ["kvzip", "kvzip-ada", "kvzip-global"])
def test_kvzip_matches_bruteforce(policy, arch):
    """The probe passes (chunks of 16: two for the 30- and 20-token prompts, the second quoting the first's last 8
    tokens; one for the 9-token one, which gets a pass of pads alongside), the max-attention scores, the eviction once the probe
    is over, and the decode steps after it."""
    from tiny_models import char_tokenizer

    tokenizer = char_tokenizer()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    model = tiny_model(arch)
    ids, mask = padded_batch(lengths=(30, 20, 9))
    ada, model_wide = policy == "kvzip-ada", policy == "kvzip-global"
    reference = BruteForceKVzip(6, sinks=2, chunk=16, request=encode(f"\n\n{KVZIP_REQUEST}"),
                                request_next=encode(f"\n\n{KVZIP_NEXT}"), suffix=encode("\n"), heads_share=ada,
                                model_share=model_wide)
    params = {"sinks": 2, "chunk": 16, "request": KVZIP_REQUEST, "request_next": KVZIP_NEXT, **({"alpha": 0.0} if ada or model_wide else {})}
    # 3 steps: the prompt and 2 decode steps, each new token displacing a prompt token, whose scores are compared below
    steps = run_against_reference(model, reference, uniform_plan(model, policy, Budget(tokens=6), **params), ids, mask,
                                  3, tokenizer=tokenizer)
    layers = range(model.config.num_hidden_layers)
    assert all(len(head) == 6 for head in steps[0][0][0]) or ada or model_wide  # compressed once the probe was over
    assert len(reference.scores[(0, 0, 0)]) == 30  # every prompt token of the long row was scored
    # the scores themselves, of every prompt token still held: each its most attention in any probe pass
    compared = 0
    for index, layer in enumerate(reference.kvpolicy_cache.layers):
        state = layer.group_state(layer.policies.groups[0])
        pads = (mask.shape[1] - mask.sum(dim=1)).tolist()
        for b, h, slot in layer.valid[:, :, : layer.used].nonzero().tolist():
            position = int(layer.positions[b, h, slot])
            expected = reference.scores[(index, b, h)].get(position + pads[b])
            if expected is not None:
                assert abs(float(state["probe"][b, h, slot]) - expected) < 1e-5, (index, b, h, position)
                compared += 1
    assert compared >= 50, compared
    if arch == "llama":  # the heads of a layer keep different prompt tokens
        assert any(row[0] != row[1] for step in steps for layer in layers for row in step[layer])
    if ada:  # heads keep different counts, the layer's total the same
        counts = [[len(head) for head in row] for layer in layers for row in steps[0][layer]]
        assert any(len(set(row)) > 1 for row in counts) and all(sum(row) == 6 * len(row) for row in counts), counts
    if model_wide:  # layers keep different totals, the model's the same (the 9-token row has 9 a head to give)
        totals = [[sum(len(head) for head in steps[0][layer][row]) for layer in layers] for row in range(2)]
        heads = len(steps[0][0][0])
        assert all(len(set(row)) > 1 and sum(row) == 6 * heads * len(layers) for row in totals), totals


@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize("policy", ["h2o-kvzip", "h2o-kvzip-ada"])
def test_h2o_kvzip_matches_bruteforce(policy, arch):
    """H2O's recent window and heavy hitters, the heavy score of a prompt token KVzip's probe maximum plus the
    attention of the decode steps' queries; with -ada, each layer's budget split among its heads by those scores."""
    from tiny_models import char_tokenizer

    tokenizer = char_tokenizer()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    model = tiny_model(arch)
    ids, mask = padded_batch(lengths=(30, 20, 9))
    ada = policy.endswith("-ada")
    reference = BruteForceH2OKVzip(8, recent_ratio=0.25, chunk=16, request=encode(f"\n\n{KVZIP_REQUEST}"),
                                   request_next=encode(f"\n\n{KVZIP_NEXT}"), suffix=encode("\n"), heads_share=ada)
    params = {"recent_ratio": 0.25, "chunk": 16, "request": KVZIP_REQUEST, "request_next": KVZIP_NEXT,
              **({"alpha": 0.0} if ada else {})}
    steps = run_against_reference(model, reference, uniform_plan(model, policy, Budget(tokens=8), **params), ids,
                                  mask, STEPS, tokenizer=tokenizer)
    counts = [[len(head) for head in row] for layer in range(3) for row in steps[0][layer]]
    if ada:
        assert any(len(set(row)) > 1 for row in counts) and all(sum(row) == 8 * len(row) for row in counts), counts
    else:
        assert all(count == 8 for row in counts for count in row)
    assert any(row[0] != row[1] for step in steps for layer in range(3) for row in step[layer]) or arch == "opt"


EA_CASES = {
    # 2 sinks pinned and their queries left out; the rotation averaged over the next 8 positions
    "plain": ({"sinks": 2, "future_positions": 8}, {"sinks": 2, "future": 8}),
    # the mean query alone, a recent window, older queries fading, one far horizon
    "mean-recent-decay": ({"sinks": 1, "future_positions": 64, "covariance": False, "recent_ratio": 0.3, "decay": 0.9},
                          {"sinks": 1, "future": 64, "covariance": False, "recent_ratio": 0.3, "decay": 0.9}),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("case", list(EA_CASES))
def test_expected_attention_matches_bruteforce(case, arch):
    params, reference_args = EA_CASES[case]
    model = tiny_model(arch)
    config = model.config
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    reference = BruteForceExpectedAttention(7, theta=theta, **reference_args)
    ids, mask = padded_batch(lengths=(17, 12, 9))
    steps = run_against_reference(model, reference, uniform_plan(model, "expected-attention", Budget(tokens=7),
                                                                 **params), ids, mask, STEPS)
    assert all(len(head) == 7 for head in steps[0][0][0])  # the longest prompt was compressed
    layers = range(config.num_hidden_layers)
    # the heads of a layer keep different tokens, beyond the pinned ones
    assert any(row[0] != row[1] for step in steps for layer in layers for row in step[layer])


def test_expected_attention_on_a_model_without_rope_is_refused():
    model = tiny_model("opt")
    with pytest.raises(KVPolicyError, match="expected attention.*RoPE model"):
        attach(model, uniform_plan(model, "expected-attention", Budget(tokens=7))).new_cache()

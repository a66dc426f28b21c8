"""FastGen: profiling picks each head's pattern; budgets and memory follow the patterns; token ids; recipes.

The brute-force comparison (kept tokens at every step, GQA and MHA, padded batches) is in
tests/test_policies_reference.py; parity when everything is kept in tests/test_parity.py.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from helpers import StepRecorder, greedy, run_script_under_interpreter, uniform_plan
from tiny_models import char_tokenizer, padded_batch, tiny_model

from kvpolicy.commands.cli import main
from kvpolicy.commands.profile import profile_model, recipe_patterns
from kvpolicy.errors import KVPolicyError, RecipeError
from kvpolicy.hf.session import attach
from kvpolicy.policies.base import AttentionStats, TokenView
from kvpolicy.policies.fastgen import (
    FastGen,
    FastGenParams,
    parse_pattern,
    pattern_name,
    tokenizer_token_sets,
)
from kvpolicy.recipe import load_recipe

SPECIAL, PUNCT = (2,), (10, 11, 12)
TOKENS = {"special_tokens": SPECIAL, "punct_tokens": PUNCT}
PROMPT = 30  # RoPE's 0.1 rad/position pair stays monotonic over < 31 positions (see handmade_model)


def handmade_model():
    """A tiny llama whose layer-0 KV head 0 attends only to punctuation, KV head 1 only to the last few tokens,
    and whose layer-1 heads attend to every token alike.

    Embeddings: a shared coordinate 0 for every token, coordinate 1 only for punctuation (ids 10-12).
    Layer 0, KV head 0 (query heads 0-2): queries read coordinate 0 and keys coordinate 1 into RoPE's
    slowest pair (dims 7/15, almost no rotation): a large logit for punctuation keys wherever they are.
    KV head 1 (query heads 3-5): queries and keys both read coordinate 0 into the 0.1 rad/position pair
    (dims 2/10), so q.k = c cos(0.1 (i - j)): largest for the query's own position, falling with distance.
    Layer 1: zero queries, so every visible key gets the same weight.
    """
    model = tiny_model("llama")
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, :2] = 0.0
        embed[:, 0] = 1.0
        embed[list(PUNCT), 1] = 3.0
        first = model.model.layers[0].self_attn
        first.q_proj.weight.zero_()
        first.k_proj.weight.zero_()
        for head in range(3):
            first.q_proj.weight[head * 16 + 7, 0] = 1.0  # punctuation head
            first.q_proj.weight[(head + 3) * 16 + 2, 0] = 3.0  # local head
        first.k_proj.weight[0 * 16 + 7, 1] = 1.0
        first.k_proj.weight[1 * 16 + 2, 0] = 3.0
        model.model.layers[1].self_attn.q_proj.weight.zero_()
    return model


def prompt_ids(length: int = PROMPT, seed: int = 0) -> torch.Tensor:
    """Ordinary tokens (20-127), punctuation at positions 0, 10 and 20."""
    ids = torch.randint(20, 128, (1, length), generator=torch.Generator().manual_seed(seed))
    ids[0, [0, 10, 20]] = torch.tensor(PUNCT)
    return ids


@pytest.mark.parametrize("candidates,expected_local", [
    (None, "special+punct+frequency+local"),  # the paper's list: local only comes with the rest
    (("special", "special+punct", "local", "special+punct+frequency", "full"), "local"),
])
def test_profile_picks_the_pattern_each_head_was_built_for(candidates, expected_local):
    model = handmade_model()
    params = {**TOKENS, **({"candidates": candidates} if candidates else {})}
    profile = profile_model(model, None, prompt_ids(), **params)
    assert profile.patterns[0] == ["special+punct", expected_local]
    assert profile.patterns[1] == ["full", "full"]
    assert min(profile.recovery[0]) >= 0.95 and profile.recovery[1] == [1.0, 1.0]
    # what each kept after the 30-token prompt: 3 punctuation tokens; 9 local (+ 9 frequent, + punct)
    assert profile.kept[0][0] == 3 and profile.kept[1] == [PROMPT, PROMPT]
    assert profile.kept[0][1] == (9 if expected_local == "local" else 3 + 9 + 9)


def test_the_written_recipe_reproduces_the_profile(tmp_path):
    """Profile -> YAML -> load: the same pattern per head, and generation keeps what run-time profiling keeps."""
    model = handmade_model()
    ids = prompt_ids()
    profile = profile_model(model, None, ids, **TOKENS)
    path = profile.write(tmp_path / "profiled.yaml")
    text = path.read_text()
    assert "policy: fastgen" in text and "policy: full" in text and "pattern: special+punct" in text
    recipe = load_recipe(path)
    assert recipe_patterns(recipe.resolve(3, 2)) == profile.patterns

    def kept_per_step(spec):
        session = attach(model, spec)
        recorder = StepRecorder(lambda: [session.last_cache.kept_positions(n) for n in range(3)])
        tokens, _ = greedy(model, ids, torch.ones_like(ids), 6, recorder=recorder, cache=session.new_cache())
        session.detach()
        return tokens, recorder.steps, session.last_cache

    runtime_tokens, runtime_steps, _ = kept_per_step(uniform_plan(model, "fastgen", **TOKENS))
    tokens, steps, cache = kept_per_step(recipe)
    assert steps == runtime_steps and torch.equal(tokens, runtime_tokens)
    assert [layer.cell_labels()[0] for layer in cache.layers] == profile.patterns
    # a fixed pattern without frequency reads no attention statistics: that layer-0 head runs plain SDPA
    punct_only = next(p for p in attach(model, recipe)._policies.values() if p.params.pattern == "special+punct")
    assert punct_only.needs == frozenset() and punct_only.profile_needs == frozenset()


def row_tokens(sequences: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each row's real tokens (prompt without pads, then the generated ones), by position."""
    width = mask.shape[1]
    return [[*seq[:width][mask[b].bool()].tolist(), *seq[width:].tolist()] for b, seq in enumerate(sequences)]


def expected_kept(pattern: str, tokens: list[int], length: int, before: set[int], params: FastGenParams):
    """(count, positions that must be kept) for a head with ``pattern`` after ``length`` real tokens, when it
    held ``before`` (the previous pass's kept positions plus the new token): every special and punctuation
    token, the newest ceil(r_l L), and min(ceil(r_f L), what is left of the rest) frequent ones."""
    if pattern == "full":
        return length, set(range(length))
    parts = set(pattern.split("+"))
    fixed = set()
    if "special" in parts:
        fixed |= {p for p in range(length) if tokens[p] in params.special_tokens or p < params.sinks}
    if "punct" in parts:
        fixed |= {p for p in range(length) if tokens[p] in params.punct_tokens}
    if "local" in parts:
        fixed |= set(range(length - math.ceil(params.local_ratio * length - 1e-9), length))
    rest = len(before - fixed)  # tokens evicted earlier do not come back
    frequent = min(math.ceil(params.frequency_ratio * length - 1e-9), rest) if "frequency" in parts else 0
    return len(fixed) + frequent, fixed


@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize("params", [
    {**TOKENS, "punct_tokens": tuple(range(10, 128, 7))},
    {**TOKENS, "punct_tokens": tuple(range(10, 128, 7)), "threshold": 0.6, "gqa": "mean", "sinks": 2,
     "local_ratio": 0.2, "frequency_ratio": 0.15, "candidates": ("special+punct", "punct+local", "frequency", "full")},
])
def test_budgets_and_memory_per_head_are_what_the_patterns_say(arch, params):
    model = tiny_model(arch)
    ids, mask = padded_batch(lengths=(17, 11, 6))
    session = attach(model, uniform_plan(model, "fastgen", **params))
    layers = range(model.config.num_hidden_layers)
    recorder = StepRecorder(lambda: [session.last_cache.kept_positions(n) for n in layers])
    sequences, _ = greedy(model, ids, mask, 10, recorder=recorder, cache=session.new_cache())
    session.detach()
    cache, fastgen = session.last_cache, FastGenParams(**params)
    tokens = row_tokens(sequences, mask)
    patterns = [layer.cell_labels() for layer in cache.layers]
    assert len({p for layer in patterns for row in layer for p in row}) > 1  # the heads differ
    for step, kept in enumerate(recorder.steps):
        for layer in layers:
            for b, row in enumerate(kept[layer]):
                length = int(mask[b].sum()) + step
                for h, positions in enumerate(row):
                    before = set(range(length)) if step == 0 else {*recorder.steps[step - 1][layer][b][h], length - 1}
                    count, fixed = expected_kept(patterns[layer][b][h], tokens[b], length, before, fastgen)
                    assert len(positions) == count, (step, layer, b, h, patterns[layer][b][h])
                    assert fixed <= set(positions) <= before, (step, layer, b, h)
    # memory: each cell's storage follows its own budget; the report splits live/allocated by pattern
    per_token = 2 * 16 * 4 if arch == "llama" else 2 * 24 * 4
    for layer, report in zip(cache.layers, cache.memory_report().layers, strict=True):
        counts = layer.valid.sum(dim=2)
        assert sum(n["live_kv_bytes"] for n in report["by_label"].values()) == report["live_kv_bytes"]
        assert sum(n["allocated_kv_bytes"] for n in report["by_label"].values()) == report["allocated_kv_bytes"]
        for label, numbers in report["by_label"].items():
            cells = [(b, h) for b, row in enumerate(layer.cell_labels()) for h, p in enumerate(row) if p == label]
            assert numbers["cells"] == len(cells)
            assert numbers["live_kv_bytes"] == sum(int(counts[b, h]) for b, h in cells) * per_token
        if layer.ragged:  # each segment: the cell's tokens, one slot for the next token, a 1/32 growth margin
            assert bool((layer.store.cap >= counts).all()) and bool((layer.store.cap <= counts + counts // 32 + 3).all())


def long_prompt(length: int) -> torch.Tensor:
    return torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_allocated_within_10_percent_of_live(arch):
    """A 440-token prompt and 40 decode steps; layer 0 full, KV head 0 punctuation only (about 4% of the tokens),
    the others special+punct+frequency+local (about 65%): each head's memory follows its own pattern."""
    model = tiny_model(arch)
    recipe = load_recipe({
        "kvpolicy": 1, "policy": "fastgen",
        "params": {**TOKENS, "punct_tokens": list(range(10, 128, 11)), "pattern": "special+punct+frequency+local"},
        "layers": [{"layers": "0", "policy": "full"}],
        "heads": [{"layers": "1-", "heads": [0], "params": {"pattern": "punct"}}],
    })
    session = attach(model, recipe)
    ids = long_prompt(440)
    greedy(model, ids, torch.ones_like(ids), 40, cache=session.new_cache())
    session.detach()
    report = session.last_cache.memory_report()
    assert report.allocated_kv_bytes <= 1.10 * report.live_kv_bytes, str(report)
    for numbers in report.layers[1:]:
        assert numbers["ragged"] and numbers["allocated_kv_bytes"] <= 1.10 * numbers["live_kv_bytes"], str(report)
        assert set(numbers["by_label"]) == {"punct", "special+punct+frequency+local"}
        punct = numbers["by_label"]["punct"]
        assert punct["tokens"] < 0.1 * 480 and punct["allocated_kv_bytes"] < 0.1 * report.layers[0]["live_kv_bytes"]
    assert set(report.by_label()) == {"full", "punct", "special+punct+frequency+local"}
    text = str(report)
    assert "heads by label" in text and all(label in text for label in report.by_label())


# --- token ids -----------------------------------------------------------------------------------------------


def cached_ids(cache, layer: int = 0) -> list[list[int]]:
    """The token id kept in every valid slot of [row][KV head 0], by position."""
    layer = cache.layers[layer]
    out = []
    for b in range(layer.valid.shape[0]):
        valid = layer.valid[b, 0, : layer.used]
        order = layer.positions[b, 0, : layer.used][valid].argsort()
        out.append(layer.store.slots.token_state["token_ids"][b, 0, : layer.used][valid][order].tolist())
    return out


def test_generate_and_plain_forward_calls_record_the_token_ids():
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=(12, 7))
    # a window of the whole length keeps every token, so the cache holds the id of every position
    plan = uniform_plan(model, "fastgen", pattern="special+punct+local", local_ratio=1.0, **TOKENS)
    session = attach(model, plan)
    sequences, _ = greedy(model, ids, mask, 5, cache=session.new_cache())
    assert cached_ids(session.last_cache) == [row[:-1] for row in row_tokens(sequences, mask)]
    cache = session.new_cache()
    model(input_ids=ids, attention_mask=mask, cache=cache)  # a plain forward, then one more token
    model(torch.tensor([[5], [6]]), attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1), cache=cache)
    assert cached_ids(cache) == [[*row[mask[b].bool()].tolist(), 5 + b] for b, row in enumerate(ids)]
    assert cache.token_feed.ids is None  # cleared after each pass
    session.detach()
    assert not model._forward_pre_hooks and not model._forward_hooks  # detach removes the hooks


def test_policies_that_read_no_token_ids_pay_nothing_for_them():
    model = tiny_model("llama")
    for plan in (uniform_plan(model, "h2o", __import__("kvpolicy").Budget(tokens=4)),
                 uniform_plan(model, "fastgen", pattern="frequency+local")):
        session = attach(model, plan)
        cache = session.new_cache()
        model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6]]), cache=cache)
        assert cache.token_feed is None and "token_ids" not in cache.layers[0].store.slots.token_state
        assert not model._forward_pre_hooks
        session.detach()


def test_inputs_embeds_alone_is_a_clear_error():
    model = tiny_model("llama")
    session = attach(model, uniform_plan(model, "fastgen", **TOKENS))
    embeds = model.get_input_embeddings()(torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(KVPolicyError, match="reads the token ids.*input_ids"):
        model(inputs_embeds=embeds, cache=session.new_cache())
    session.detach()


def test_token_sets_come_from_the_tokenizer_unless_the_recipe_lists_them():
    model = tiny_model("llama")
    tokenizer = char_tokenizer()
    with pytest.raises(KVPolicyError, match="needs the model's tokenizer.*tokenizer=tokenizer"):
        attach(model, uniform_plan(model, "fastgen"))
    special, punct = tokenizer_token_sets(tokenizer)
    assert set(special) == {0, 1, 2}  # <pad>, <unk>, <eos>
    assert {tokenizer.decode([i]) for i in punct} == set(".,:;!?'\"()[]{}-_/\\@#%&*")
    session = attach(model, uniform_plan(model, "fastgen"), tokenizer=tokenizer)
    policy = next(iter(session._policies.values()))
    assert policy.special_ids == special and policy.punct_ids == punct
    session.detach()
    # token strings in the recipe go through the tokenizer; each must be one token
    session = attach(model, uniform_plan(model, "fastgen", special_tokens=("<eos>",), punct_tokens=(".", 40)),
                     tokenizer=tokenizer)
    policy = next(iter(session._policies.values()))
    assert policy.special_ids == [2] and policy.punct_ids == [tokenizer.convert_tokens_to_ids("."), 40]
    session.detach()
    with pytest.raises(KVPolicyError, match="'ab' is not one token"):
        attach(model, uniform_plan(model, "fastgen", special_tokens=("ab",), punct_tokens=()), tokenizer=tokenizer)
    with pytest.raises(KVPolicyError, match="needs the tokenizer"):
        attach(model, uniform_plan(model, "fastgen", special_tokens=("<eos>",), punct_tokens=()))


# --- parameters ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params,message", [
    ({"threshold": 0.0}, "threshold must be in"),
    ({"threshold": 1.5}, "threshold must be in"),
    ({"local_ratio": 0.0}, "local_ratio"),
    ({"frequency_ratio": 2.0}, "frequency_ratio"),
    ({"recovery": "l2"}, "recovery"),
    ({"gqa": "max"}, "gqa"),
    ({"pattern": "special+punk"}, 'unknown pattern component .punk.*did you mean "punct"'),
    ({"candidates": ("special", "locality")}, "unknown pattern component 'locality'"),
    ({"candidates": ()}, "at least one"),
    ({"special_tokens": ("",)}, "non-empty token strings"),
    ({"pattern": "local+local"}, "twice"),
    ({"sinks": -1}, "sinks"),
    ({"punct_tokens": (-3,)}, "token ids >= 0"),
])
def test_bad_params_are_clear_errors(params, message):
    with pytest.raises(ValueError, match=message):
        FastGenParams(**params).validate()


def test_bad_pattern_in_a_recipe_names_the_file_and_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent("""\
        kvpolicy: 1
        policy: fastgen
        heads:
          - {layers: 2, heads: [0], params: {pattern: frequent+local}}
    """))
    with pytest.raises(RecipeError, match=r"r.yaml:4: heads\[0\].params: .*unknown pattern component 'frequent'"):
        load_recipe(path).resolve(3, 2)


def test_pattern_names_round_trip():
    for text in ("special", "punct+special", "local+frequency+punct", "full"):
        assert parse_pattern(pattern_name(parse_pattern(text))) == parse_pattern(text)
    assert pattern_name(parse_pattern("local+special")) == "special+local"


def test_a_recipe_budget_does_not_apply():
    recipe = load_recipe({"kvpolicy": 1, "policy": "fastgen", "budget": {"tokens": 8}})
    head = recipe.resolve(2, 1).layers[0].heads[0]
    assert head.budget.by_policy and "set by the policy" in recipe.resolve(2, 1).describe()


# --- GQA: how the query heads of a KV head combine -------------------------------------------------------------


def test_gqa_min_protects_every_query_head_mean_averages():
    """One KV head, 3 query heads over 10 tokens: two attend to their own token only, one to every token alike."""
    n = 10
    eye = torch.eye(n)
    uniform = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]
    rows = torch.stack([eye, eye, uniform])  # [G, query, key]
    near_mask = (torch.arange(n)[:, None] - torch.arange(n)[None, :]) < math.ceil(0.3 * n)
    stats = AttentionStats(
        queries=torch.tensor([n]), colsum=rows.sum(dim=1).mean(dim=0)[None, None],
        colsum_heads=rows.sum(dim=1)[None, None], near_colsum_heads=(rows * near_mask).sum(dim=1)[None, None],
    )
    view = TokenView(torch.arange(n)[None, None], torch.ones(1, 1, n, dtype=torch.bool), torch.tensor([n]),
                     torch.tensor([[n]]), token_ids=torch.full((1, 1, n), 50, dtype=torch.int32))
    chosen = {}
    for gqa in ("min", "mean"):
        policy = FastGen(FastGenParams(gqa=gqa, **TOKENS))
        policy.prepare()
        state = {"pattern": torch.zeros(1, 1, dtype=torch.int16), "recovery": torch.zeros(1, 1)}
        policy.profile(state, stats, view)
        chosen[gqa] = (pattern_name(int(state["pattern"])), float(state["recovery"]))
    # the uniform head recovers (3 local + 3 frequent of 10) well below 0.95: min keeps the whole cache
    assert chosen["min"] == ("full", 1.0)
    assert chosen["mean"][0] == "special+punct+frequency+local" and chosen["mean"][1] >= 0.95


# --- the command -------------------------------------------------------------------------------------------------


def test_profile_command_writes_a_recipe_validate_accepts(tiny, tmp_path, capsys):
    folder, text = tiny
    out = tmp_path / "tiny-fastgen.yaml"
    assert main(["profile", "--model", folder, "--prompt-file", text, "--tokens", "120", "--threshold", "0.9",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "expected KV saving at the prompt" in printed and "heads per pattern" in printed
    assert "layer" in printed and f"wrote {out}" in printed
    assert main(["validate", str(out), "--model", folder]) == 0
    assert "fastgen(" in capsys.readouterr().out
    # bad input: a clear error before the model loads
    assert main(["profile", "--model", folder, "--prompt", "x", "--threshold", "1.5", "--out", str(out)]) == 2
    assert "threshold must be in (0, 1]" in capsys.readouterr().err


# --- the Triton backend ------------------------------------------------------------------------------------------

TRITON_SCRIPT = """
import sys, torch
sys.path.insert(0, "tests")
from helpers import StepRecorder, greedy, uniform_plan
from tiny_models import padded_batch, tiny_model
from kvpolicy.hf.session import attach

model = tiny_model("llama")
ids, mask = padded_batch(lengths=(17, 12, 9))
plan = uniform_plan(model, "fastgen", special_tokens=(2,), punct_tokens=tuple(range(10, 128, 9)), threshold=0.8)
runs = {}
for backend in ("torch", "triton"):
    session = attach(model, plan, backend=backend)
    recorder = StepRecorder(lambda: [session.last_cache.kept_positions(n) for n in range(3)])
    tokens, logits = greedy(model, ids, mask, 4, recorder=recorder, cache=session.new_cache())
    session.detach()
    runs[backend] = (tokens, logits, recorder.steps, [layer.cell_labels() for layer in session.last_cache.layers])
assert runs["torch"][3] == runs["triton"][3]
assert runs["torch"][2] == runs["triton"][2]
assert torch.equal(runs["torch"][0], runs["triton"][0])
torch.testing.assert_close(runs["torch"][1], runs["triton"][1], atol=1e-4, rtol=1e-4)
print("ok")
"""


def test_triton_backend_profiles_on_torch_then_decodes_on_triton():
    """The profiling call falls back to the torch reference; decode steps use the kernels (interpreter)."""
    run_script_under_interpreter(TRITON_SCRIPT)

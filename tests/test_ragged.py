"""Ragged storage: a layer whose (row, KV head) cells keep different numbers of tokens holds each
cell's K/V in a segment sized to its own budget, frees the rest, and computes exactly what
equal-width (dense) storage computes."""

from __future__ import annotations

import textwrap

import pytest
import torch
from helpers import StepRecorder, greedy, per_head_counts, run_script_under_interpreter, uniform_plan
from tiny_models import padded_batch, tiny_model

import kvpolicy.storage.ragged
from kvpolicy.hf.session import attach, attach_rows, model_shape
from kvpolicy.recipe import load_recipe
from kvpolicy.recipe.budget import Budget
from kvpolicy.recipe.plan import HeadPlan, LayerPlan, Plan
from kvpolicy.registry import get_registry


def per_head_plan(model, heads: list[tuple[str, dict, Budget]]) -> Plan:
    """Every layer: KV head i follows heads[i] = (policy, params, budget)."""
    registry = get_registry()
    layer = [HeadPlan(name, registry.get(name).Params(**params), budget) for name, params, budget in heads]
    return Plan("per-head-test", [LayerPlan(list(layer)) for _ in range(model.config.num_hidden_layers)])


def storage_bytes(cache) -> int:
    return sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (layer.store.keys, layer.store.values))


def chunked_then_greedy(model, cache, ids, mask, chunk: int, steps: int):
    """Feed the prompt in chunks of ``chunk`` tokens, then ``steps`` greedy tokens; kept positions after each call."""
    kept, logits = [], []
    layers = range(model.config.num_hidden_layers)
    for lo in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, lo : lo + chunk], attention_mask=mask[:, : lo + chunk], cache=cache)
        kept.append([cache.kept_positions(layer) for layer in layers])
    for _ in range(steps):
        logits.append(out.logits[:, -1])
        token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = model(input_ids=token, attention_mask=mask, cache=cache)
        kept.append([cache.kept_positions(layer) for layer in layers])
    return kept, torch.stack(logits, dim=1)


CASES = {
    # ratio budgets over prompts of 17, 11 and 6 tokens: the rows keep 9, 6 and 3 (+ up to 2 slack)
    "rows": lambda m: uniform_plan(m, "h2o", Budget(ratio=0.5, slack=2)),
    # head 0 keeps 9 tokens, head 1 keeps 4
    "heads": lambda m: per_head_plan(m, [("h2o", {}, Budget(tokens=9)), ("h2o", {}, Budget(tokens=4))]),
    # two policies, one of them unbounded (its segment keeps growing)
    "heads-full": lambda m: per_head_plan(m, [("full", {}, Budget()), ("streaming", {"sinks": 2}, Budget(tokens=5))]),
    # keys re-rotated to their index within each cell (StreamingLLM's in-cache positions), cells of 7 and 3
    "heads-in-cache": lambda m: per_head_plan(m, [("streaming", {"sinks": 2, "positions": "in_cache"}, Budget(tokens=7)),
                                                  ("streaming", {"sinks": 1, "positions": "in_cache"}, Budget(tokens=3))]),
    "adakv": lambda m: uniform_plan(m, "adakv", Budget(tokens=6), window=2, kernel=3),
    "adakv-slack": lambda m: uniform_plan(m, "adakv", Budget(tokens=5, slack=2), window=2, kernel=3),
}


def run_both(monkeypatch, run):
    """``run()`` with ragged storage allowed, then with every layer kept dense."""
    ragged = run()
    monkeypatch.setattr(kvpolicy.storage.ragged, "MIN_SAVING", float("inf"))
    dense = run()
    monkeypatch.undo()
    return ragged, dense


@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize("case", list(CASES))
def test_ragged_storage_computes_what_dense_storage_computes(monkeypatch, case, arch):
    """Same kept tokens per (layer, row, head) after every pass, same tokens and logits; left-padded batch of 3."""
    if arch == "opt" and case == "heads-in-cache":
        pytest.skip("learned positions: no RoPE to re-rotate")
    model = tiny_model(arch)
    ids, mask = padded_batch(lengths=(17, 11, 6))
    plan = CASES[case](model) if arch == "llama" or not case.startswith("heads") else None
    if plan is None:  # opt has 4 KV heads: the per-head plans repeat over head pairs
        base = CASES[case](tiny_model("llama"))
        plan = Plan(base.name, [LayerPlan(layer.heads * 2) for layer in base.layers])
    layers = range(model.config.num_hidden_layers)

    def run():
        session = attach(model, plan)
        recorder = StepRecorder(lambda: ([session.last_cache.kept_positions(n) for n in layers],
                                         [session.last_cache.layers[n].ragged for n in layers]))
        tokens, logits = greedy(model, ids, mask, 10, recorder=recorder, cache=session.new_cache())
        session.detach()
        return tokens, logits, recorder.steps, session.last_cache

    (tokens, logits, steps, cache), (dense_tokens, dense_logits, dense_steps, dense_cache) = run_both(monkeypatch, run)
    # a layer goes ragged where per-cell segments save more than 1/16 (not where AdaKV happened to split evenly)
    assert any(layer.ragged for layer in cache.layers) and not any(layer.ragged for layer in dense_cache.layers)
    assert [kept for kept, _ in steps] == [kept for kept, _ in dense_steps]
    assert torch.equal(tokens, dense_tokens)
    torch.testing.assert_close(logits, dense_logits, atol=1e-5, rtol=1e-5)
    assert cache.memory_report().allocated_kv_bytes < dense_cache.memory_report().allocated_kv_bytes


@pytest.mark.parametrize("case", ["heads", "heads-full", "adakv-slack"])
def test_prompt_chunks_on_ragged_storage(monkeypatch, case):
    """Prompt chunks after the layer went ragged: segments grow for the chunk, then shrink back."""
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=(40, 31, 22))
    plan = CASES[case](model)

    def run():
        session = attach(model, plan)
        kept, logits = chunked_then_greedy(model, session.new_cache(), ids, mask, chunk=12, steps=6)
        session.detach()
        return kept, logits, session.last_cache

    (kept, logits, cache), (dense_kept, dense_logits, _) = run_both(monkeypatch, run)
    assert any(layer.ragged for layer in cache.layers)
    assert kept == dense_kept
    torch.testing.assert_close(logits, dense_logits, atol=1e-5, rtol=1e-5)


def test_rows_with_different_recipes_ragged_and_dense_agree(monkeypatch):
    """A full-cache row (its segments grow by re-layout) next to evicting rows."""
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=(14,))
    plans = [
        uniform_plan(model, "full"),
        uniform_plan(model, "h2o", Budget(tokens=5)),
        uniform_plan(model, "adakv", Budget(tokens=4), window=2),
        uniform_plan(model, "window", Budget(tokens=4)),
    ]

    def run():
        session = attach_rows(model, plans)
        recorder = StepRecorder(lambda: session.last_cache.kept_positions(1))
        ids4, mask4 = ids.expand(4, -1), mask.expand(4, -1)
        _, logits = greedy(model, ids4, mask4, 40, recorder=recorder, cache=session.new_cache())
        session.detach()
        return logits, recorder.steps, session.last_cache

    (logits, steps, cache), (dense_logits, dense_steps, _) = run_both(monkeypatch, run)
    assert steps == dense_steps
    torch.testing.assert_close(logits, dense_logits, atol=1e-5, rtol=1e-5)
    layer = cache.layers[1]
    assert layer.ragged and int(layer.store.cap[0].min()) >= 14 + 39  # the full row grew past its first segment
    assert layer.valid.sum(dim=2)[:, 0].tolist()[0] == 14 + 39


def check_report(cache, ratio: float = 1.10) -> None:
    """Allocated K/V within ``ratio`` of live on every layer; the report is the tensors' real storage.

    A layer whose cells happen to keep nearly equal counts stays dense (ragged saves < 1/16 there)."""
    report = cache.memory_report()
    assert any(numbers["ragged"] for numbers in report.layers)
    for layer, numbers in zip(cache.layers, report.layers, strict=True):
        assert numbers["allocated_kv_bytes"] <= ratio * numbers["live_kv_bytes"], numbers
        assert numbers["allocated_kv_bytes"] == storage_bytes_of(layer)
        metadata = [layer.positions, layer.valid, *layer.store.slots.token_state.values()]
        if numbers["ragged"]:
            metadata += [layer.store.offset, layer.store.cap, layer.store.cell_tokens]
            rows = int(layer.store.cap.sum())
            assert numbers["allocated_kv_bytes"] == rows * (layer.store.keys.shape[-1] + layer.store.values.shape[-1]) * 4
        assert numbers["metadata_bytes"] == sum(t.untyped_storage().nbytes() for t in metadata)
    assert report.allocated_kv_bytes == storage_bytes(cache)
    text = str(report)
    assert "ragged" in text and "workspace" in text


def storage_bytes_of(layer) -> int:
    return layer.store.keys.untyped_storage().nbytes() + layer.store.values.untyped_storage().nbytes()


def long_prompt(length: int) -> torch.Tensor:
    return torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(5))


def test_unequal_head_budgets_from_a_recipe_get_ragged_storage(tmp_path):
    """A `heads:` rule giving head 0 five times the budget: each head's memory is its own, not the largest."""
    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent("""
        kvpolicy: 1
        policy: h2o
        budget: {tokens: 24}
        heads:
          - {heads: [0], budget: {tokens: 120}}
    """))
    model = tiny_model("llama")
    session = attach(model, load_recipe(path))
    ids = long_prompt(300)
    recorder = StepRecorder(lambda: per_head_counts(session.last_cache))
    greedy(model, ids, torch.ones_like(ids), 6, recorder=recorder, cache=session.new_cache())
    session.detach()
    for counts in recorder.steps:
        assert all(layer.tolist() == [[120, 24]] for layer in counts)
    check_report(session.last_cache)
    dense = 2 * (120 + 2)  # equal-width storage: two cells of the largest budget + 2 slots each
    assert all(int(layer.store.cap.sum()) == 121 + 25 < dense for layer in session.last_cache.layers)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_adakv_allocated_within_10_percent_of_live(arch):
    """AdaKV at 20% of a 480-token prompt: heads keep different counts, memory follows each head's."""
    model = tiny_model(arch)
    session = attach(model, load_recipe("adakv"))  # window 32, kernel 7, max pooling, alpha 0.2
    ids = long_prompt(480)
    recorder = StepRecorder(lambda: per_head_counts(session.last_cache))
    greedy(model, ids, torch.ones_like(ids), 8, recorder=recorder, cache=session.new_cache())
    session.detach()
    heads = model_shape(model)[1]
    for counts in recorder.steps:
        assert torch.equal(torch.stack(counts), torch.stack(recorder.steps[0]))  # fixed after the prefill
        assert all(int(layer.sum()) == heads * 96 for layer in counts)  # 20% of 480 per head, on average
    assert any(len(set(layer[0].tolist())) > 1 for layer in recorder.steps[0])
    check_report(session.last_cache)


def test_adakv_without_a_long_call_splits_evenly_and_stays_dense():
    """Fed one token at a time nothing is scored: every head keeps its newest tokens, as SnapKV does, on the
    dense decode fast path."""
    model = tiny_model("llama")
    session = attach(model, uniform_plan(model, "adakv", Budget(tokens=4), window=2))
    cache = session.new_cache()
    for token in range(1, 10):
        model(input_ids=torch.tensor([[token]]), cache=cache)
    session.detach()
    assert cache.kept_positions(1)[0] == [[5, 6, 7, 8]] * 2
    assert all(layer.budgets.uniform_limit == 4 and not layer.ragged for layer in cache.layers)


def test_allocate_must_return_one_budget_per_cell():
    from kvpolicy.errors import KVPolicyError

    model = tiny_model("llama")
    registry = get_registry()
    policy_cls = registry.get("adakv")

    class Broken(policy_cls):
        def allocate(self, state, view, cells):
            return view.budget[:, :1]

    plan = uniform_plan(model, "adakv", Budget(tokens=4), window=2)
    session = attach(model, plan)
    session._policies = {key: Broken(policy.params) for key, policy in session._policies.items()}
    ids, mask = padded_batch(lengths=(9,))
    with pytest.raises(KVPolicyError, match="'adakv' allocated budgets of shape"):
        model(input_ids=ids, attention_mask=mask, cache=session.new_cache())
    session.detach()


TRITON_SCRIPT = """
import sys, torch
sys.path.insert(0, "tests")
from helpers import StepRecorder, greedy, uniform_plan
from tiny_models import padded_batch, tiny_model
from kvpolicy.hf.session import attach
from kvpolicy.recipe.budget import Budget
from kvpolicy.recipe.plan import HeadPlan, LayerPlan

model = tiny_model("llama")
ids, mask = padded_batch(lengths=(17, 12, 9))
runs = {}
heads = uniform_plan(model, "h2o", Budget(tokens=6))
heads.layers = [LayerPlan([layer.heads[0], HeadPlan("h2o", layer.heads[0].params, Budget(tokens=3))]) for layer in heads.layers]
plans = {"heads": heads, "adakv": uniform_plan(model, "adakv", Budget(tokens=6), window=3, kernel=3)}
for name, plan in plans.items():
    for backend in ("torch", "triton"):
        session = attach(model, plan, backend=backend)
        recorder = StepRecorder(lambda: [session.last_cache.kept_positions(n) for n in range(3)])
        tokens, logits = greedy(model, ids, mask, 4, recorder=recorder, cache=session.new_cache())
        session.detach()
        assert any(layer.ragged for layer in session.last_cache.layers), name
        runs[backend] = (tokens, logits, recorder.steps)
    assert runs["torch"][2] == runs["triton"][2], name
    assert torch.equal(runs["torch"][0], runs["triton"][0]), name
    torch.testing.assert_close(runs["torch"][1], runs["triton"][1], atol=1e-4, rtol=1e-4)
print("ok")
"""


def test_triton_backend_on_ragged_layers():
    """The Triton kernels read a ragged layer's dense copy as they read dense storage (interpreter, subprocess)."""
    run_script_under_interpreter(TRITON_SCRIPT)

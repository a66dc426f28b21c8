"""benchmarks/oracle_bound.py: its chunked perplexity is the model's, and its cache holds the budget."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch
from tiny_models import tiny_model

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "oracle_bound.py"


def _oracle():
    spec = importlib.util.spec_from_file_location("oracle_bound", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ids(count: int = 200) -> torch.Tensor:
    return torch.randint(1, 128, (count,), generator=torch.Generator().manual_seed(3))


def test_unbounded_oracle_is_the_models_own_perplexity():
    oracle, model, ids = _oracle(), tiny_model("llama"), _ids()
    with torch.inference_mode():
        logits = model(input_ids=ids[None]).logits[0].float()
    expected = math.exp(float(-logits[:-1].log_softmax(-1).gather(-1, ids[1:, None]).mean()))
    assert oracle.oracle_ppl(model, ids, budget=ids.numel()) == pytest_approx(expected)


def test_bounded_oracle_scores_each_chunk_from_the_budget_per_kv_head(monkeypatch):
    oracle, model, ids = _oracle(), tiny_model("llama"), _ids()
    kept: list[tuple[int, list]] = []
    original = oracle._cache

    def recording(keys, values, keep):
        cache = original(keys, values, keep)
        if keep is not None:
            kept.append((cache.layers[0].keys.shape[2], [k.clone() for k in keep]))
        return cache

    monkeypatch.setattr(oracle, "_cache", recording)
    full = oracle.oracle_ppl(model, ids, budget=ids.numel())
    bounded = oracle.oracle_ppl(model, ids, budget=40)
    # the chunks at 64, 128 and 192 (> 40 cached tokens) are each scored from exactly 40 tokens per (layer, KV head)
    assert [count for count, _ in kept] == [40, 40, 40]
    assert bounded != full
    # KV heads choose apart: some layer keeps different tokens in its two KV heads
    assert any(not torch.equal(layer[0, 0], layer[0, 1]) for _, keep in kept for layer in keep)


def pytest_approx(value: float):
    import pytest

    return pytest.approx(value, rel=1e-5)

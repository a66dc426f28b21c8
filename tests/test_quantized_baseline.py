"""transformers' own QuantizedCache as a baseline row of `kvpolicy compare` (kvpolicy/tasks/quantized_baseline.py).

The sweeps run on the tiny random Llama of tests/test_compare.py (3 layers, 2 KV heads, head size 16, fp32);
the HQQ and quanto ones skip when their package is not installed (``pip install -e ".[quantized]"``).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvpolicy.commands.cli import main
from kvpolicy.errors import KVPolicyError
from kvpolicy.tasks import quantized_baseline
from kvpolicy.tasks.quantized_baseline import measure, parse_baseline

TOKENS, PROMPT, DECODED = 64, 48, 16
LAYERS, KV_HEADS, HEAD_DIM, FP32 = 3, 2, 16, 4
RESIDUAL = 10  # the memory task holds 64 + 16 tokens: a flush at the 10th decoded token leaves 74 quantized, 6 not


def compare(tiny, out, *extra: str) -> int:
    folder, text = tiny
    return main(["compare", "--model", folder, "--text-file", text, "--tokens", str(TOKENS), "--prompt-tokens",
                 str(PROMPT), "--out", str(out), *extra])


def results(out) -> dict[tuple[str, str, str | None], dict]:
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {(r["task"], r["recipe"], r["budget"]): r for r in rows}


def bytes_16bit(tokens: int) -> int:
    return LAYERS * KV_HEADS * HEAD_DIM * 2 * 2 * tokens


# --- names and errors (no backend needed) ---------------------------------------------------------------------


def test_names_and_groups(monkeypatch):
    monkeypatch.setattr(quantized_baseline, "_importable", lambda module: True)
    assert parse_baseline("hf-hqq-4bit") == quantized_baseline.QuantizedBaseline("hf-hqq-4bit", "hqq", 4, 128)
    assert parse_baseline("hf-quanto-2bit-r0").residual == 0
    baseline = quantized_baseline.QuantizedBaseline("hf-hqq-2bit-r64", "hqq", 2, 64)
    assert (baseline.axis, baseline.group(64), baseline.group(128), baseline.group(16)) == (1, 16, 32, 4)
    quanto = quantized_baseline.QuantizedBaseline("hf-quanto-4bit", "quanto", 4, 128)
    assert (quanto.axis, quanto.group(64), quanto.group(16)) == (0, 64, 16)
    fp8 = parse_baseline("hf-fp8")
    assert (fp8.backend, fp8.residual) == ("fp8", None)


@pytest.mark.parametrize("name, message", [
    ("hf-hqq-3bit", "the hqq backend quantizes to 2, 4, 8 bits, not 3"),
    ("hf-quanto-8bit", "the quanto backend quantizes to 2, 4 bits, not 8"),
    ("hf-hqq-4bits", "unknown baseline 'hf-hqq-4bits'"),
    ("hf-kivi", "hf-hqq-<bits>bit"),
])
def test_bad_names_fail_in_one_line(name, message):
    with pytest.raises(KVPolicyError, match=message):
        parse_baseline(name)


def test_missing_backend_names_the_extra(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(quantized_baseline, "_importable", lambda module: False)
    assert compare(tiny, tmp_path / "run", "--recipes", "hf-hqq-4bit", "--tasks", "ppl") == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "needs the hqq package" in error and 'pip install -e ".[quantized]"' in error
    assert compare(tiny, tmp_path / "run", "--recipes", "hf-quanto-4bit", "--tasks", "ppl") == 2
    assert "pip install --no-deps optimum-quanto" in capsys.readouterr().err


# --- the fp8 backend: transformers alone ----------------------------------------------------------------------


def test_fp8_baseline_runs_once_with_its_bytes(tiny, tmp_path):
    out = tmp_path / "run"
    assert compare(tiny, out, "--recipes", "hf-fp8", "window", "--budgets", "0.5", "--tasks", "ppl", "memory",
                   "fidelity") == 0
    found = results(out)
    assert len(found) == 3 * 3  # full and hf-fp8 once (no budget), window at 50%
    fidelity = found["fidelity", "hf-fp8", None]
    assert "cannot share a kvpolicy batch" in fidelity["skipped"] and fidelity["length"] == PROMPT
    assert not {"greedy_match", "kl", "top1"} & set(fidelity)
    assert found["fidelity", "window", "0.5"]["kl"] > 0  # the other rows still ran
    full, fp8 = found["ppl", "full", None], found["ppl", "hf-fp8", None]
    assert fp8["ppl"] != full["ppl"] and fp8["ppl"] == pytest.approx(full["ppl"], rel=0.02)
    assert fp8["kv_tokens"] == full["kv_tokens"] == TOKENS - 1 and not fp8["evicts"]  # every token fed is kept
    memory = found["memory", "hf-fp8", None]
    tokens = TOKENS + DECODED
    codes, scales = LAYERS * 2 * KV_HEADS * tokens * HEAD_DIM, LAYERS * 2 * FP32  # 1 byte a code, a scale per tensor
    assert memory["kv_tier_bytes"] == {"codes": codes, "scales": scales, "residual": 0}
    assert memory["kv_live_bytes"] == memory["kv_allocated_bytes"] == codes + scales
    assert memory["bytes_vs_16bit"] == pytest.approx((codes + scales) / bytes_16bit(tokens))
    assert found["memory", "full", None]["bytes_vs_16bit"] == pytest.approx(2.0)  # fp32


# --- HQQ: the backend of the `quantized` extra ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hqq_sweep(tiny, tmp_path_factory):
    pytest.importorskip("hqq", reason='the HQQ backend: pip install -e ".[quantized]"')
    out = tmp_path_factory.mktemp("hqq") / "run"
    assert compare(tiny, out, "--recipes", "h2o", f"hf-hqq-4bit-r{RESIDUAL}", "--budget-unit", "memory",
                   "--budgets", "0.5", "--tasks", "ppl", "memory", "passkey") == 0
    return out


def test_hqq_baseline_runs_once_in_a_sweep_at_equal_bytes(hqq_sweep):
    found = results(hqq_sweep)
    name = f"hf-hqq-4bit-r{RESIDUAL}"
    assert {(recipe, budget) for _, recipe, budget in found} == {("full", None), ("h2o", "0.5 mem"), (name, None)}
    assert len(found) == 3 * 3
    passkey = found["passkey", name, None]
    assert 0.0 <= passkey["accuracy"] <= 1.0 and len(passkey["answers"]) == passkey["prompts"] == 5
    assert passkey["length"] == PROMPT


def test_hqq_ppl_is_close_to_the_full_cache_but_not_equal(hqq_sweep):
    found = results(hqq_sweep)
    full, baseline = found["ppl", "full", None], found["ppl", f"hf-hqq-4bit-r{RESIDUAL}", None]
    assert baseline["ppl"] != full["ppl"]
    assert baseline["ppl"] == pytest.approx(full["ppl"], rel=0.05)
    assert baseline["kv_tokens"] == full["kv_tokens"] == TOKENS - 1  # every token fed is kept


def test_hqq_memory_is_the_bytes_of_its_tensors(hqq_sweep):
    found = results(hqq_sweep)
    memory, full = found["memory", f"hf-hqq-4bit-r{RESIDUAL}", None], found["memory", "full", None]
    tokens = TOKENS + DECODED
    quantized, residual = tokens - 6, 6
    group = 8  # gcd(64, 16 / 2): 4-bit codes pack two a byte along HQQ's first axis
    per_tensor = KV_HEADS * quantized * HEAD_DIM  # quantized elements of one layer's keys (or values)
    expected = {
        "codes": LAYERS * 2 * per_tensor // 2,
        "scales": LAYERS * 2 * (per_tensor // group) * 2 * FP32,  # a scale and a zero point a group, fp32
        "residual": LAYERS * 2 * KV_HEADS * residual * HEAD_DIM * FP32,
    }
    assert memory["kv_tier_bytes"] == expected
    assert memory["kv_live_bytes"] == memory["kv_allocated_bytes"] == sum(expected.values())
    assert memory["kv_live_bytes"] < full["kv_live_bytes"]
    assert memory["bytes_vs_16bit"] == pytest.approx(sum(expected.values()) / bytes_16bit(tokens))
    assert 0 < found["memory", "h2o", "0.5 mem"]["bytes_vs_16bit"] < 1


def test_hqq_cache_bytes_equal_its_tensors_directly(tiny):
    """`measure` against the tensors of a cache filled by hand: every storage of every layer, once."""
    pytest.importorskip("hqq", reason='the HQQ backend: pip install -e ".[quantized]"')
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny[0]).eval()
    session = parse_baseline("hf-hqq-2bit-r4").open_session(model)
    try:
        cache = session.new_cache()
        with torch.inference_mode():
            model(input_ids=torch.arange(1, 12)[None], past_key_values=cache, use_cache=True)
            for token in range(5):
                model(input_ids=torch.tensor([[token + 1]]), past_key_values=cache, use_cache=True)
    finally:
        session.detach()
    tensors = []
    for layer in cache.layers:
        for codes, meta in (layer._quantized_keys, layer._quantized_values):
            tensors += [codes, meta["scale"], meta["zero"]]
        tensors += [layer.keys, layer.values]
    report = cache.memory_report()
    assert report.live_kv_bytes == sum(t.numel() * t.element_size() for t in tensors)
    assert report.tokens == 16 and cache.kept_tokens(0) == 16.0
    # 11 quantized at once, then one at a time: a flush when the 4th waits (15 quantized), and 1 left
    assert report.tier_bytes()["residual"] == LAYERS * 2 * KV_HEADS * 1 * HEAD_DIM * FP32
    assert model.config._attn_implementation == "sdpa"


# --- quanto: installed by hand ------------------------------------------------------------------------------


def test_quanto_memory_is_the_bytes_of_its_tensors(tiny, tmp_path):
    pytest.importorskip("optimum.quanto", reason="pip install --no-deps optimum-quanto==0.2.7 ninja")
    out = tmp_path / "run"
    assert compare(tiny, out, "--recipes", f"hf-quanto-4bit-r{RESIDUAL}", "--tasks", "ppl", "memory") == 0
    found = results(out)
    full, baseline = found["ppl", "full", None], found["ppl", f"hf-quanto-4bit-r{RESIDUAL}", None]
    assert baseline["ppl"] != full["ppl"] and baseline["ppl"] == pytest.approx(full["ppl"], rel=0.05)
    memory = found["memory", f"hf-quanto-4bit-r{RESIDUAL}", None]
    per_tensor = KV_HEADS * (TOKENS + DECODED - 6) * HEAD_DIM
    assert memory["kv_tier_bytes"]["codes"] == LAYERS * 2 * per_tensor // 2
    assert memory["kv_tier_bytes"]["scales"] == LAYERS * 2 * (per_tensor // HEAD_DIM) * 2 * FP32  # scale and shift
    assert memory["kv_tier_bytes"]["residual"] == LAYERS * 2 * KV_HEADS * 6 * HEAD_DIM * FP32


def test_measure_counts_a_shared_storage_once():
    class Layer:
        keys = torch.zeros(2, 3)
        values = keys[1:]  # a view of the same storage
        _quantized_keys = _quantized_values = None

    class Cache:
        layers = [Layer()]

        def get_seq_length(self):
            return 3

    assert measure(Cache()).live_kv_bytes == 6 * FP32


# --- the real model -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_hqq_4bit_perplexity_within_a_few_percent_of_full(tmp_path):
    pytest.importorskip("hqq", reason='the HQQ backend: pip install -e ".[quantized]"')
    out = tmp_path / "run"
    # 32 recent tokens at full precision (the default keeps 128): most of the 160 tokens are read quantized
    assert main(["compare", "--recipes", "hf-hqq-4bit-r32", "--tasks", "ppl", "--tokens", "160", "--out", str(out)]) == 0
    found = results(out)
    full, baseline = found["ppl", "full", None]["ppl"], found["ppl", "hf-hqq-4bit-r32", None]["ppl"]
    assert baseline != full and math.isclose(baseline, full, rel_tol=0.05), (full, baseline)

"""`kvpolicy bench` on a tiny random Llama: the batch chosen for a cap fits it, padded rows equal
the same prompts run alone, and a long stream's memory stays at the budget."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from tiny_models import tiny_model

from kvpolicy.commands.bench_cap import (
    Config,
    Run,
    _decode,
    _prefill,
    _prompts,
    parse_bytes,
    rows_holding_budget,
)
from kvpolicy.commands.bench_meter import PeakMeter, cache_bytes
from kvpolicy.commands.cli import main
from kvpolicy.errors import KVPolicyError
from kvpolicy.hf.session import attach
from kvpolicy.recipe import load_recipe, with_budget
from kvpolicy.recipe.budget import Budget


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2 GiB") == 2 * 2**30
    assert parse_bytes("800mb") == 800 * 10**6
    assert parse_bytes("4096") == 4096
    for bad in ("lots", "5 parsecs", "0MiB", "-1GiB"):
        with pytest.raises(KVPolicyError, match="memory size"):
            parse_bytes(bad)


def test_cli_rejects_bad_input(capsys):
    assert main(["bench", "--kv-memory", "half a gig"]) == 2
    assert "512MiB" in capsys.readouterr().err
    assert main(["bench", "--recipe", "h2o"]) == 2
    assert "--stream-tokens" in capsys.readouterr().err


def test_batch_under_the_cap_fits_and_rows_hold_their_budget(tiny, tmp_path):
    model, text = tiny
    cap = 3 * 2**20
    out = tmp_path / "bench"
    code = main([
        "bench", "--model", model, "--text-file", text, "--recipes", "full", "h2o", "--budget", "0.25",
        "--kv-memory", "3MiB", "--prompt-tokens", "160", "--new-tokens", "12", "--repeats", "2", "--threads", "1",
        "--out", str(out),
    ])
    assert code == 0
    rows = read(out / "bench.jsonl")
    at_cap = {row["config"]: row for row in rows if row["at_cap"]}
    assert set(at_cap) == {"plain", "full", "h2o"}
    for row in at_cap.values():
        assert row["max_batch"] >= 1
        assert row["peak_bytes"] <= cap, row  # measured, with the prompt held by one layer before it evicts
        assert row["final_bytes"] <= cap
        # the largest that fits: one more sequence would not
        assert (row["max_batch"] + 1) * row["bytes_per_sequence"] > cap
    assert at_cap["h2o"]["max_batch"] > 1.5 * at_cap["plain"]["max_batch"]
    assert at_cap["h2o"]["rows_holding_budget"] == f"{at_cap['h2o']['batch']}/{at_cap['h2o']['batch']}"
    assert at_cap["full"]["rows_holding_budget"] is None
    sizes = sorted(row["batch"] for row in rows if row["config"] == "h2o")
    assert sizes[0] == 1 and sizes[-1] == at_cap["h2o"]["max_batch"]
    assert all(len(row["decode_tok_s_rounds"]) == 2 for row in rows)
    assert (out / "throughput-vs-batch.png").stat().st_size > 0


def test_peak_meter_sees_the_layer_that_holds_the_whole_prompt():
    model = tiny_model("llama")
    recipe = with_budget(load_recipe("h2o"), Budget(tokens=16))
    session = attach(model, recipe)
    try:
        cache = session.new_cache()
        meter = PeakMeter(cache)
        with torch.inference_mode():
            model(input_ids=torch.randint(3, 60, (1, 120)), cache=cache, use_cache=True)
        peak = meter.stop()
        final = cache_bytes(cache)
        layer = cache.layers[0]
        kv_per_token = layer.store.keys.shape[1] * 2 * layer.store.keys.shape[-1] * layer.store.keys.element_size()
        assert peak >= final + (120 - 16 - 2) * kv_per_token  # one layer held all 120 tokens' K/V at once
        assert "update" not in layer.__dict__  # unwrapped
    finally:
        session.detach()


def test_padded_rows_give_the_tokens_of_the_prompts_run_alone(tiny):
    model_dir, text = tiny
    from kvpolicy.hf.models import load_model

    model, tokenizer = load_model(model_dir)
    text_ids = tokenizer(open(text).read(), return_tensors="pt")["input_ids"][0]
    session = attach(model, with_budget(load_recipe("h2o"), Budget(ratio=0.3)))
    config = Config("h2o", session)
    args = argparse.Namespace(prompt_tokens=90, spread=0.5)
    batched = Run(config, 3)
    _prefill(model, batched, text_ids, args, metered=False)
    _decode(model, batched, 10)
    assert rows_holding_budget(batched, 10) == (3, 3)
    assert len(set(batched.prompt_lengths)) == 3  # three lengths, left-padded
    tokens = torch.cat(batched.tokens, dim=1)

    ids, mask = _prompts(text_ids, 90, 0.5, 3)
    for row in range(3):
        prompt = ids[row, mask[row].bool()]
        alone = Run(config, 1)
        # the same prompt, unpadded: lay it out as a one-row batch of exactly its length
        alone_args = argparse.Namespace(prompt_tokens=prompt.numel(), spread=0.0)
        _prefill(model, alone, prompt, alone_args, metered=False)
        _decode(model, alone, 10)
        assert torch.equal(torch.cat(alone.tokens, dim=1)[0], tokens[row]), row
    session.detach()


def test_long_stream_memory_stays_at_the_budget(tiny, tmp_path):
    model, text = tiny
    out = tmp_path / "stream"
    code = main([
        "bench", "--model", model, "--text-file", text, "--recipe", "h2o", "--stream-tokens", "1400",
        "--stream-budget", "256", "--stream-chunk", "1", "--every", "100", "--threads", "1", "--out", str(out),
    ])
    assert code == 0
    rows = read(out / "bench.jsonl")
    summary = rows[-1]
    assert summary["mode"] == "stream-summary" and summary["samples_after_warmup"] >= 8
    assert summary["live_over_budget"] == 0.0
    assert 0 <= summary["allocated_over_budget"] <= 0.01  # budget + the next token + the scratch slot
    assert summary["allocated_spread"] == 0.0 and summary["flat"] is True
    assert (out / "stream-memory.png").stat().st_size > 0


def test_bench_engine_vllm_passes_its_options_to_the_capacity_benchmark(tmp_path):
    """`kvpolicy bench --engine vllm` relays its options to the benchmark the vLLM environment runs, which must
    read them back: the admission of the recipes (--preemption) included."""
    from kvpolicy.commands.bench_vllm import capacity_arguments
    from kvpolicy.commands.cli import build_parser
    from kvpolicy.integrations.vllm import capacity

    args = build_parser().parse_args(["bench", "--engine", "vllm", "--recipes", "full", "h2o", "--max-batch", "6",
                                      "--preemption", "never", "recompute", "--prefill-chunk", "128",
                                      "--evict-during-prefill", "--tensor-parallel-size", "2",
                                      "--shared-prefix-tokens", "600", "--prefix-caching"])
    args.max_batch_given = True
    (tmp_path / "config.json").write_text("{}")
    relayed = capacity.parse_args([*capacity_arguments(args), "--model", str(tmp_path)])
    assert relayed.preemption == ["never", "recompute"] and relayed.recipes == ["full", "h2o"]
    assert (relayed.requests, relayed.prefill_chunk, relayed.tensor_parallel_size) == (6, 128, 2)
    assert relayed.evict_during_prefill and relayed.prefix_caching and relayed.shared_prefix_tokens == 600
    assert capacity.parse_args(["--model", str(tmp_path)]).preemption == ["never"]  # kvpolicy's default admission


def test_capacity_prompts_share_the_prefix_asked_for(tmp_path):
    """`--shared-prefix-tokens N`: every prompt starts with the same N tokens and then differs, at the lengths the
    benchmark spreads (+-20% of --prompt-tokens)."""
    from kvpolicy.integrations.vllm import capacity

    (tmp_path / "config.json").write_text("{}")
    args = capacity.parse_args(["--model", str(tmp_path), "--requests", "4", "--prompt-tokens", "500",
                                "--shared-prefix-tokens", "300"])
    prompts = capacity.prompt_ids(lambda text: {"input_ids": list(range(200_000))}, args)
    assert [len(p) for p in prompts] == [400, 467, 533, 600]
    assert all(p[:300] == prompts[0][:300] for p in prompts)
    assert len({p[300] for p in prompts}) == 4  # each then its own text
    with pytest.raises(SystemExit):
        capacity.parse_args(["--model", str(tmp_path), "--prompt-tokens", "500", "--shared-prefix-tokens", "450"])

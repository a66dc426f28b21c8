"""`kvpolicy compare` on a tiny random model with a character-level tokenizer (no downloads)."""

from __future__ import annotations

import csv
import json
import math

import numpy
import pytest
import torch
from tiny_models import char_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvpolicy.commands.cli import main
from kvpolicy.tasks import TASKS, Context, Row
from kvpolicy.tasks.passkey import make_prompt

TOKENS, PROMPT = 64, 48
SIZES = ["--tokens", str(TOKENS), "--prompt-tokens", str(PROMPT)]


def compare(tiny, out, *extra: str) -> int:
    folder, text = tiny
    return main(["compare", "--model", folder, "--text-file", text, *SIZES, "--out", str(out), *extra])


def results(out) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sweep(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "run"
    assert compare(tiny, out, "--recipes", "window", "streaming", "h2o", "--budgets", "0.25", "0.5") == 0
    return out


def test_sweep_writes_results_csv_and_plots(sweep):
    from PIL import Image

    rows = results(sweep)
    tasks = {"ppl", "memory", "speed", "passkey", "fidelity"}
    assert len(rows) == 7 * len(tasks)  # full once + 3 recipes x 2 budgets, for every task
    assert {(r["recipe"], r["budget"]) for r in rows} == {("full", None)} | {
        (recipe, budget) for recipe in ("window", "streaming", "h2o") for budget in ("0.25", "0.5")
    }
    assert {r["task"] for r in rows} == tasks
    for row in rows:
        assert row["command"].startswith("kvpolicy compare") and row["seed"] == 0
        assert set(row["versions"]) >= {"kvpolicy", "torch", "transformers"}
    with (sweep / "results.csv").open() as file:
        assert len(list(csv.DictReader(file))) == len(rows)
    for name in ("quality", "memory", "speed"):
        image = Image.open(sweep / "plots" / f"{name}.png")
        image.load()
        assert image.size[0] > 300 and image.size[1] > 200
        assert len(numpy.unique(numpy.asarray(image.convert("L")))) > 10  # something was drawn


def test_ppl_of_full_equals_a_direct_computation(tiny, sweep):
    folder, text = tiny
    row = next(r for r in results(sweep) if r["task"] == "ppl" and r["recipe"] == "full")
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    ids = AutoTokenizer.from_pretrained(folder)(open(text).read(), add_special_tokens=False)["input_ids"][:TOKENS]
    ids = torch.tensor([ids])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    expected = math.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item())
    assert row["ppl"] == pytest.approx(expected, rel=1e-4)
    assert row["scored_tokens"] == TOKENS - 1


def test_chunked_ppl_equals_token_by_token_for_full(tiny, sweep):
    folder, text = tiny
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor(tokenizer(open(text).read(), add_special_tokens=False)["input_ids"])
    ctx = Context(model, tokenizer, ids, tokens=150, ppl_mode="chunked")  # 3 chunks, the last one partial
    token = next(r for r in results(sweep) if r["task"] == "ppl" and r["recipe"] == "full")
    chunked = TASKS["ppl"].run(ctx, [Row("full", None, "full")])[0]
    ctx.tokens = TOKENS
    assert TASKS["ppl"].run(ctx, [Row("full", None, "full")])[0]["ppl"] == pytest.approx(token["ppl"], rel=1e-5)
    ctx.ppl_mode = "token"
    ctx.tokens = 150
    assert chunked["ppl"] == pytest.approx(TASKS["ppl"].run(ctx, [Row("full", None, "full")])[0]["ppl"], rel=1e-4)


def test_memory_is_the_budget_and_bounded_rows_use_less(sweep):
    memory = {(r["recipe"], r["budget"]): r for r in results(sweep) if r["task"] == "memory"}
    per_token = 3 * 2 * 16 * 2 * 4  # layers x KV heads x head_dim x (K, V) x fp32 bytes
    assert memory[("h2o", "0.25")]["kv_live_bytes"] == math.ceil(0.25 * TOKENS) * per_token
    assert memory[("full", None)]["kv_live_bytes"] == (TOKENS + 16) * per_token  # prompt + 16 decoded
    assert memory[("window", "0.5")]["kv_allocated_bytes"] < memory[("full", None)]["kv_allocated_bytes"]
    assert all(r["peak_rss_bytes"] > 0 for r in memory.values())


def test_passkey_prompt_is_deterministic_and_the_key_is_where_it_says():
    tokenizer = char_tokenizer()
    first = make_prompt(tokenizer, 600, 0.3, "seed-a")
    assert first == make_prompt(tokenizer, 600, 0.3, "seed-a")
    assert make_prompt(tokenizer, 600, 0.3, "seed-b").key != first.key
    for depth in (0.0, 0.5, 1.0):
        prompt = make_prompt(tokenizer, 600, depth, "seed-a")
        assert prompt.key == first.key and len(prompt.key) == 5 and prompt.key.isdigit()
        assert prompt.text[prompt.char_index : prompt.char_index + 5] == prompt.key
        assert tokenizer.decode(prompt.input_ids[prompt.token_index : prompt.token_index + 5]) == prompt.key
        assert abs(len(prompt.input_ids) - 600) < 100
    at = {d: make_prompt(tokenizer, 2000, d, "s") for d in (0.1, 0.5, 0.9)}
    assert at[0.1].char_index < at[0.5].char_index < at[0.9].char_index
    assert at[0.9].char_index - at[0.1].char_index > 0.5 * len(at[0.5].text)  # 80% of the filler lies between


def test_passkey_key_position_with_the_real_tokenizer_and_chat_template():
    from kvpolicy.hf.models import _CACHE_NAME, default_cache_dir

    folder = default_cache_dir() / _CACHE_NAME
    if not (folder / "tokenizer_config.json").is_file():
        pytest.skip("the SmolLM2 cache is not built here")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = make_prompt(tokenizer, 400, 0.5, 7)
    assert prompt.text.startswith("<|im_start|>") and prompt.text.endswith("The pass key is")
    assert abs(len(prompt.input_ids) - 400) < 40
    assert tokenizer.decode(prompt.input_ids[prompt.token_index : prompt.token_index + 5]) == prompt.key


def test_resume_skips_finished_rows_and_force_recomputes(tiny, tmp_path, monkeypatch):
    out = tmp_path / "run"
    args = ["--recipes", "h2o", "--tasks", "ppl", "memory"]
    assert compare(tiny, out, *args, "--budgets", "0.5") == 0
    first = results(out)
    assert len(first) == 4
    calls: list[tuple[str, list[str]]] = []
    for name in ("ppl", "memory"):
        real = TASKS[name].run

        def counting(ctx, rows, name=name, real=real):
            calls.append((name, [row.label for row in rows]))
            return real(ctx, rows)

        monkeypatch.setattr(TASKS[name], "run", counting)
    assert compare(tiny, out, *args, "--budgets", "0.5") == 0
    assert calls == [] and results(out) == first  # nothing recomputed, nothing appended
    assert compare(tiny, out, *args, "--budgets", "0.5", "0.25") == 0
    assert calls == [("ppl", ["h2o@0.25"]), ("memory", ["h2o@0.25"])]
    assert results(out)[:4] == first and len(results(out)) == 6
    calls.clear()
    assert compare(tiny, out, *args, "--budgets", "0.25", "0.5", "--force") == 0
    # the full cache in a batch of its own: the bounded rows' storage stays as wide as their budgets
    assert calls == [("ppl", ["full"]), ("ppl", ["h2o@0.25", "h2o@0.5"]), ("memory", ["full"]),
                     ("memory", ["h2o@0.25", "h2o@0.5"])]
    assert len(results(out)) == 6


def test_json_output(tiny, tmp_path, capsys):
    assert compare(tiny, tmp_path / "run", "--recipes", "window", "--budgets", "8", "--tasks", "ppl", "--json") == 0
    printed = json.loads(capsys.readouterr().out)
    assert [(r["recipe"], r["budget"], r["budget_tokens"]) for r in printed] == [("full", None, None), ("window", "8", 8)]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--tasks", "ppl", "pplx"], "unknown task 'pplx'"),
        (["--recipes", "h2oo"], "not a built-in recipe"),
        (["--budgets", "abc"], "not a number"),
        (["--budgets", "1.5"], "ratio in (0, 1]"),
        (["--budgets", "0"], "ratio in (0, 1]"),
        (["--tokens", "2"], "argument --tokens: 2 is out of range"),
        (["--tokens", "100000"], "too short"),
    ],
)
def test_bad_input_exits_2(tiny, tmp_path, capsys, extra, message):
    assert compare(tiny, tmp_path / "run", *extra) == 2
    assert message in capsys.readouterr().err


def test_bad_model_text_or_out_exits_2(tiny, tmp_path, capsys):
    folder, text = tiny
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    short = tmp_path / "short.txt"
    short.write_text("just a few words")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (["--model", "smollm3"], "Unknown model"),
        (["--text-file", str(empty)], "is empty"),
        (["--text-file", str(short)], "too short"),
        (["--text-file", str(tmp_path / "missing.txt")], "does not exist"),
        (["--out", str(a_file)], "is an existing file"),
    ]
    for extra, message in cases:
        argv = ["compare", "--model", folder, "--text-file", text, *SIZES, "--out", str(tmp_path / "run"), *extra]
        assert main(argv) == 2, extra
        assert message in capsys.readouterr().err, extra


def test_fastgen_runs_once_and_is_measured_not_taken_for_the_full_cache(tiny, tmp_path):
    """FastGen has no recipe budget (it sizes each head itself): one row, measured like any evicting row."""
    out, recipe = tmp_path / "fastgen", tmp_path / "fastgen.yaml"
    recipe.write_text("kvpolicy: 1\nname: fastgen\npolicy: fastgen\nparams: {pattern: frequency+local}\n")
    assert compare(tiny, out, "--recipes", str(recipe), "h2o", "--budgets", "0.5", "--tasks", "fidelity", "memory",
                   "ppl", "--ppl-mode", "chunked") == 0
    rows = {(r["task"], r["recipe"]): r for r in results(out)}
    assert {(r["recipe"], r["budget"]) for r in rows.values()} == {("full", None), ("fastgen", None), ("h2o", "0.5")}
    fastgen, full = rows[("fidelity", "fastgen")], rows[("fidelity", "full")]
    assert fastgen["evicts"] and not full["evicts"]
    assert fastgen["kl"] > 0  # measured against the full cache, not copied from it
    assert rows[("memory", "fastgen")]["kv_live_bytes"] < rows[("memory", "full")]["kv_live_bytes"]
    assert rows[("ppl", "fastgen")]["kv_tokens"] < rows[("ppl", "full")]["kv_tokens"]

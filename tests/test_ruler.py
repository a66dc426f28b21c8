"""The RULER-style tasks: generators reproducible from their seed, answers in the prompt at the stated depth,
RULER's scoring, and the tasks in `kvpolicy compare` (several lengths, suites, bad input) on the tiny model."""

from __future__ import annotations

import json
import random

import pytest
from tiny_models import char_tokenizer

from kvpolicy.commands.cli import main
from kvpolicy.commands.compare import SUITE_NAMES
from kvpolicy.tasks.lengths import length_label
from kvpolicy.tasks.ruler import GENERATORS, RULER_TASKS, SUITES
from kvpolicy.tasks.ruler.haystack import NOISE, TextHaystack
from kvpolicy.tasks.ruler.prompt import insert_at_depths, join_items
from kvpolicy.tasks.ruler.scoring import all_found, clean, match_share
from kvpolicy.tasks.ruler.word_counts import zeta

TEXT = " ".join(
    f"Sentence number {i} tells of the {random.Random(i).choice(['red', 'old', 'quiet', 'busy'])} harbor and "
    f"its {random.Random(-i).choice(['boats', 'gulls', 'nets', 'docks'])}." for i in range(300))
LENGTH = 3000  # characters = tokens for the char tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def sample(tokenizer, name, index=1, count=5, seed=0, length=LENGTH, text=TEXT):
    return GENERATORS[name][0].sample(name, tokenizer, TextHaystack(text), length, index, count, seed)


@pytest.mark.parametrize("name", list(GENERATORS))
def test_generator_is_reproducible_from_its_seed(tokenizer, name):
    first = sample(tokenizer, name)
    assert first == sample(tokenizer, name)
    other = sample(tokenizer, name, seed=1)
    assert other.text != first.text and other.answers != first.answers
    assert sample(tokenizer, name, index=2).answers != first.answers
    assert 0.9 * LENGTH <= len(first.input_ids) <= LENGTH


@pytest.mark.parametrize("name", list(GENERATORS))
def test_answers_are_in_the_context_and_needles_at_their_depth(tokenizer, name):
    for index in range(5):
        made = sample(tokenizer, name, index=index)
        start, end = made.context_tokens
        context = tokenizer.decode(made.input_ids[start:end])
        for answer in made.answers:
            assert answer in context, (name, answer)
        assert context in made.text and made.text.index(context) > 0  # instructions before, question after
        after = made.text[made.text.index(context) + len(context):]
        assert "?" in after or "Question:" in after  # the question comes after the context, as in RULER
        if name.startswith("niah"):
            assert made.depth == pytest.approx((index + 0.5) / 5)
            queried = made.needles[[n.depth for n in made.needles].index(made.depth)]
            assert made.answers[0] in queried.text
        for needle in made.needles:
            assert made.text[needle.char_index:].startswith(needle.text)
            assert tokenizer.decode(made.input_ids[needle.token_index:]).startswith(needle.text)
            assert abs(made.token_depth(needle) - needle.depth) < 0.06, (name, needle)
        if name in ("cwe", "fwe"):
            assert made.depth is None and not made.needles


def test_niah_variants_hold_what_ruler_defines(tokenizer):
    single = sample(tokenizer, "niah_single_1")
    assert len(single.answers) == 1 and len(single.answers[0]) == 7 and single.answers[0].isdigit()
    assert NOISE in single.text and "What is the special magic number for" in single.text
    uuid = sample(tokenizer, "niah_single_3").answers[0]
    assert len(uuid) == 36 and uuid.count("-") == 4
    multikey = sample(tokenizer, "niah_multikey_1")
    assert len(multikey.needles) == 4 and len(multikey.answers) == 1
    assert len(sample(tokenizer, "niah_multivalue").answers) == 4
    multiquery = sample(tokenizer, "niah_multiquery")
    assert len(multiquery.answers) == 4 and ", and " in multiquery.text
    haystack_of_needles = sample(tokenizer, "niah_multikey_2")
    assert haystack_of_needles.text.count("One special magic number for") > 10
    vt = sample(tokenizer, "vt")
    assert len(vt.answers) == 5 and all(len(v) == 5 and v.isupper() for v in vt.answers)
    assert vt.text.count("VAR ") > 2 * 5  # the chain, and the one-shot example's
    cwe = sample(tokenizer, "cwe")
    listing = tokenizer.decode(cwe.input_ids[cwe.context_tokens[0]:cwe.context_tokens[1]])
    counts = {word: listing.split().count(word) for word in set(listing.split()) if not word[0].isdigit()}
    assert set(sorted(counts, key=counts.get, reverse=True)[:10]) == set(cwe.answers)
    assert min(counts[w] for w in cwe.answers) > max(c for w, c in counts.items() if w not in cwe.answers)
    fwe = sample(tokenizer, "fwe")
    coded = tokenizer.decode(fwe.input_ids[fwe.context_tokens[0]:fwe.context_tokens[1]]).split()
    ranked = sorted(set(coded) - {"...."}, key=coded.count, reverse=True)
    assert ranked[:3] == fwe.answers and coded.count("....") > coded.count(fwe.answers[0])


def test_the_chat_template_wraps_the_task_and_the_answer_prefix_follows(tokenizer):
    from kvpolicy.tasks.ruler.prompt import wrap

    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}<assistant>"
    assert wrap(tokenizer, "TASK", " The answer is") == "<user>TASK</s><assistant> The answer is"
    made = sample(tokenizer, "niah_single_1", length=900)
    assert made.text.startswith("<user>A special magic number") and made.text.endswith("mentioned in the text above is")


def test_insertion_and_joining():
    units = ["aaaa", "bbbb", "cccc", "dddd"]
    assert insert_at_depths(units, [("X", 0.0), ("Y", 0.5), ("Z", 1.0)], " ") == "X aaaa bbbb Y cccc dddd Z"
    assert join_items(["a"]) == "a" and join_items(["a", "b"]) == "a and b"
    assert join_items(["a", "b", "c"]) == "a, b, and c"
    assert zeta(2.0) == pytest.approx(3.14159265 ** 2 / 6, rel=1e-6)


def test_scoring_is_rulers_string_match_all():
    assert match_share(" 1234567.", ["1234567"]) == 1.0
    assert match_share("The numbers are 1111111 and 2222222", ["1111111", "2222222", "3333333", "4444444"]) == 0.5
    assert match_share("QUIET-HARBOR", ["quiet-harbor"]) == 1.0  # case is ignored
    assert match_share("123456", ["1234567"]) == 0.0  # a part of the item is not the item
    assert match_share("anything", []) == 0.0
    assert all_found("AB CD", ["ab", "cd"]) and not all_found("AB", ["ab", "cd"])
    assert clean("  a\x00b\tc  ") == "a\nb\nc"


def test_suites_and_names():
    assert set(SUITE_NAMES) == set(SUITES)
    assert SUITES["ruler"] == list(RULER_TASKS) and len(RULER_TASKS) == 11
    assert set(SUITES["ruler-small"]) < set(SUITES["ruler"])
    assert [length_label(n) for n in (400, 1000, 1024, 2000, 4096, 1500)] == ["400", "1K", "1K", "2K", "4K", "1.5K"]


# --- in kvpolicy compare, on the tiny random model -----------------------------------------------------------


def compare(tiny, out, *extra: str) -> int:
    folder, text = tiny
    return main(["compare", "--model", folder, "--text-file", text, "--out", str(out), *extra])


def test_ruler_tasks_in_a_sweep_at_two_lengths(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert compare(tiny, out, "--recipes", "h2o", "--budgets", "0.5", "--tasks", "niah_single_1", "vt",
                   "--prompt-tokens", "1600", "2000") == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {(r["task"], r["length"], r["recipe"]) for r in rows} == {
        (task, length, recipe) for task in ("niah_single_1", "vt") for length in (1600, 2000) for recipe in ("full", "h2o")}
    for row in rows:
        assert 0 <= row["score"] <= 1 and row["samples"] == 5 and len(row["items"]) == 5
        assert row["prompt_tokens_real"] <= row["length"] and row["settings"]["length"] == row["length"]
        if row["task"] == "niah_single_1":
            assert sorted(row["by_depth"]) == ["0.1", "0.3", "0.5", "0.7", "0.9"]
    printed = capsys.readouterr().out
    assert "s1 1.6K" in printed and "vt 2K" in printed  # a column per task and length
    assert (out / "plots" / "ruler.png").is_file()
    assert compare(tiny, out, "--recipes", "h2o", "--budgets", "0.5", "--tasks", "niah_single_1",
                   "--prompt-tokens", "2000") == 0
    assert "niah_single_1@2000: all 2 rows already in" in capsys.readouterr().out  # resumed per length


@pytest.mark.parametrize("extra,message", [
    (["--tasks", "niah_single"], "unknown task 'niah_single'"),
    (["--suite", "rulerx"], "argument --suite: invalid choice"),
    (["--tasks", "niah_single_1", "--prompt-tokens", "100"], "--prompt-tokens 100 is too short"),
    (["--tasks", "niah_single_1", "--prompt-tokens", "abc"], "argument --prompt-tokens"),
])
def test_bad_ruler_input_exits_2_with_one_line(tiny, tmp_path, capsys, extra, message):
    assert compare(tiny, tmp_path / "run", "--recipes", "full", *extra) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_smollm2_full_cache_finds_the_single_needle_at_1k_tokens():
    """Where SmolLM2-135M can do the tasks at all (docs/ruler.md): the single needle at 1K tokens, every depth.

    Chance is about 0 (a 7-digit number); the full cache found 5 of 5 when measured.
    """
    import torch

    from kvpolicy.hf.models import load_model
    from kvpolicy.tasks import Context, Row

    model, tokenizer = load_model("smollm2")
    ctx = Context(model, tokenizer, torch.zeros(1, dtype=torch.long), prompt_tokens=1000, text=TEXT)
    result = RULER_TASKS["niah_single_1"].run(ctx, [Row("full", None, "full")])[0]
    assert result["score"] >= 0.8, result["items"]
    assert result["prompt_tokens_real"] <= 1000 and len(result["by_depth"]) == 5

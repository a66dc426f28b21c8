"""The lm-evaluation-harness model type ``kvpolicy``: offline, on local task YAMLs over local JSON files.

On SmolLM2 (saved to a tmp folder): the ``full`` recipe gives the numbers of lm-eval's own ``hf`` model, an
evicting recipe different, plausible ones. On the tiny model: the batched scoring paths agree with one
request at a time, rolling log-likelihood with the full cache equals one plain forward pass, the command line
route works, and bad arguments fail with a clear error.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval", reason='lm-eval is not installed: pip install -e ".[lmeval]"')

from kvpolicy.errors import KVPolicyError  # noqa: E402

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

STORY = ("Read the note. The parcel for the blue house on Elm Street was brought on Tuesday by a courier named "
         "Dana, who rang twice, left it by the red door and waved to the neighbour's dog before driving away. ")
MULTIPLE_CHOICE = [
    {"question": STORY + "Question: Who brought the parcel? Answer:", "choices": [" Dana", " Sam", " the mailman"],
     "answer": 0},
    {"question": STORY + "Question: What colour was the door? Answer:", "choices": [" red", " green", " blue"],
     "answer": 0},
    {"question": "The capital of France is", "choices": [" Paris", " London", " a small green frog"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
]
GENERATION = [
    {"question": "Q: What is the capital of France?\nA:", "answer": " Paris"},
    {"question": STORY + "\nQ: On which day was the parcel brought?\nA:", "answer": " Tuesday"},
]


def write_tasks(folder) -> str:
    """Two lm-eval tasks over local JSON lines: kvp_local_mc (multiple choice), kvp_local_gen (generation)."""
    for name, docs in (("mc", MULTIPLE_CHOICE), ("gen", GENERATION)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: \"{{question}}\"\n"
    (folder / "kvp_local_mc.yaml").write_text(
        f"task: kvp_local_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (folder / "kvp_local_gen.yaml").write_text(
        f"task: kvp_local_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    return str(folder)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("lmeval-tasks"))


def evaluate(tasks: str, model: str, model_args: str) -> dict:
    # only the local tasks: indexing lm-eval's thousands of built-in task files takes ~14 s a call
    import lm_eval
    from lm_eval.tasks import TaskManager

    import kvpolicy.lmeval.model  # noqa: F401  (registers "kvpolicy")

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["kvp_local_mc", "kvp_local_gen"],
                                   task_manager=TaskManager(include_path=tasks, include_defaults=False),
                                   batch_size=4, log_samples=True)


def loglikelihoods(result: dict) -> list[list[float]]:
    return [[resp[0][0] for resp in doc["resps"]] for doc in result["samples"]["kvp_local_mc"]]


def generations(result: dict) -> list[str]:
    return [doc["filtered_resps"][0] for doc in result["samples"]["kvp_local_gen"]]


@pytest.mark.slow
def test_full_gives_the_hf_models_numbers_and_eviction_other_plausible_ones(tmp_path_factory, tasks):
    from kvpolicy.hf.models import load_model

    folder = tmp_path_factory.mktemp("smollm2")
    model, tokenizer = load_model("smollm2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    hf = evaluate(tasks, "hf", f"pretrained={folder},device=cpu,dtype=float32")
    full = evaluate(tasks, "kvpolicy", f"pretrained={folder},recipe=full")
    evicting = evaluate(tasks, "kvpolicy", f"pretrained={folder},recipe=streaming,budget=0.2")
    for mine, theirs in zip(loglikelihoods(full), loglikelihoods(hf), strict=True):
        assert mine == pytest.approx(theirs, abs=2e-3)
    assert full["results"]["kvp_local_mc"]["acc,none"] == hf["results"]["kvp_local_mc"]["acc,none"]
    assert generations(full) == generations(hf)
    lost = [abs(a - b) for doc_a, doc_b in zip(loglikelihoods(evicting), loglikelihoods(hf), strict=True)
            for a, b in zip(doc_a, doc_b, strict=True)]
    assert max(lost) > 0.05  # the 20% cache changes the scores of the long prompts
    assert all(math.isfinite(v) and v < 0 for doc in loglikelihoods(evicting) for v in doc)
    assert 0 <= evicting["results"]["kvp_local_mc"]["acc,none"] <= 1


# --- on the tiny model -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_lm(tiny):
    from kvpolicy.lmeval.model import KVPolicyLM

    folder, _ = tiny
    return lambda recipe, **kw: KVPolicyLM(pretrained=folder, recipe=recipe, **kw)


def test_batched_continuations_score_as_one_at_a_time(tiny_lm):
    lm = tiny_lm("h2o", budget="0.5")
    context = lm.tok_encode("the cache keeps a few tokens and drops the rest while")
    continuations = [lm.tok_encode(" the model"), lm.tok_encode(" it"), lm.tok_encode(" reads on and on")]
    together = lm.score_continuations(context, continuations)
    alone = [lm.score_continuations(context, [c])[0] for c in continuations]
    for (a, greedy_a), (b, greedy_b) in zip(together, alone, strict=True):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b
    full = tiny_lm("full").score_continuations(context, continuations)
    assert any(abs(a[0] - b[0]) > 1e-3 for a, b in zip(together, full, strict=True))


def test_rolling_with_the_full_cache_equals_one_forward_pass(tiny_lm):
    lm = tiny_lm("full", rolling_chunk=7)
    tokens = lm.tok_encode("the cache keeps a few tokens and drops the rest while the model reads on")
    with torch.no_grad(), pytest.warns(UserWarning, match="without a kvpolicy cache"):  # plain attention
        logits = lm.model(torch.tensor([tokens])).logits[0].float()
    expected = float(torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None]).sum())
    assert lm.stream_logprob(tokens[:1], tokens[1:]) == pytest.approx(expected, abs=1e-3)
    evicting = tiny_lm("window", budget="0.2", rolling_chunk=7)
    assert abs(evicting.stream_logprob(tokens[:1], tokens[1:]) - expected) > 1e-3


def test_bad_arguments_are_named(tiny_lm):
    from kvpolicy.recipe.budget import parse_budget

    assert parse_budget(0.2).ratio == 0.2 and parse_budget("512").tokens == 512
    for bad in ("abc", "0", "1.5", "-3"):
        with pytest.raises(KVPolicyError, match="budget '"):
            parse_budget(bad)
    with pytest.raises(KVPolicyError, match="not a built-in recipe"):
        tiny_lm("h2oo")
    with pytest.raises(KVPolicyError, match="dtype="):
        tiny_lm("full", dtype="float8")


def test_the_command_line_runs_a_local_task_offline(tiny, tasks, tmp_path):
    folder, _ = tiny
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "kvpolicy.lmeval", "run", "--model", "kvpolicy", "--model_args",
         f"pretrained={folder},recipe=h2o,budget=0.5", "--tasks", "kvp_local_mc", "--include_path", tasks,
         "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kvp_local_mc" in done.stdout and "acc" in done.stdout


def test_the_command_line_names_a_bad_recipe_in_one_line(tiny, tasks, capsys, monkeypatch):
    """The same entry point in this process (lm-eval's import is the slow part of a subprocess)."""
    from kvpolicy.lmeval.__main__ import main

    folder, _ = tiny
    monkeypatch.setattr(sys, "argv", ["kvpolicy.lmeval"])
    status = main(["run", "--model", "kvpolicy", "--model_args", f"pretrained={folder},recipe=h2oo",
                   "--tasks", "kvp_local_mc", "--include_path", tasks])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and last.startswith("kvpolicy: error:") and "h2oo" in last, last


@pytest.mark.parametrize("model_args,named", [("pretrained=x,recipe=h2oo", "h2oo"), ("recipe=h2o,budget=1.5", "budget"),
                                              ("recipe=h2o,dtype=int8", "dtype")])
def test_bad_model_args_fail_before_lm_eval_starts(monkeypatch, capsys, model_args, named):
    """A bad recipe, budget or dtype is reported before lm-eval indexes its tasks (~15 s) or loads a model."""
    import lm_eval.__main__

    from kvpolicy.lmeval.__main__ import main

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: pytest.fail("lm-eval started"))
    monkeypatch.setattr(sys, "argv", ["kvpolicy.lmeval"])
    status = main(["run", "--model", "kvpolicy", "--model_args", model_args, "--tasks", "kvp_local_mc"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and last.startswith("kvpolicy: error:") and named in last, last


def test_the_next_sentence_task_is_real_text_reproducible_and_answerable(tmp_path):
    """kvp_next_sentence: the true continuation is among four distinct choices, the same for the same seed."""
    from pydoc_data.topics import topics

    from kvpolicy.lmeval.local_task import documents, main, sentences

    text = "\n\n".join(topics[key] for key in sorted(topics))
    pool = sentences(text)
    docs = documents(text, 12, 300, seed=3)
    assert docs == documents(text, 12, 300, seed=3) and docs != documents(text, 12, 300, seed=4)
    for doc in docs:
        truth = doc["choices"][doc["answer"]].strip()
        assert len(set(doc["choices"])) == 4 and 250 <= len(doc["passage"].split()) <= 400
        # the true choice is the sentence that follows the passage in the text
        assert any(pool[i] == truth and doc["passage"].endswith(pool[i - 1]) for i in range(1, len(pool)))
    assert main(["--out", str(tmp_path), "--docs", "5"]) == 0
    config = (tmp_path / "kvp_next_sentence.yaml").read_text()
    assert "output_type: multiple_choice" in config and str(tmp_path / "kvp_next_sentence.jsonl") in config
    assert len((tmp_path / "kvp_next_sentence.jsonl").read_text().splitlines()) == 5

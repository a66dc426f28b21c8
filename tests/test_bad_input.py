"""Hostile and careless input (issue #16): one clear line and exit status 2, or a correct result; never a traceback,
a silent wrong answer or a lost result.

Through the installed CLI (a subprocess each, run a few at a time) and through the Python API. The recipe-parsing
items of the issue (encodings, nesting, aliases, huge numbers in recipes, duplicate keys) live with the recipe tests.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import types
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import uniform_plan
from tiny_models import padded_batch, tiny_model

from kvpolicy import hookimpl
from kvpolicy.commands.cli import main
from kvpolicy.commands.output_files import OutputLock
from kvpolicy.errors import KVPolicyError
from kvpolicy.hf import attention as attention_module
from kvpolicy.hf.session import attach, attach_rows
from kvpolicy.policies.base import Policy
from kvpolicy.recipe.budget import BY_POLICY, Budget, parse_budget
from kvpolicy.recipe.plan import HeadPlan, LayerPlan, Plan
from kvpolicy.recipe.schema import MAX_TOKENS
from kvpolicy.registry import Registry

CLI = str(Path(sys.executable).with_name("kvpolicy"))
TIMEOUT = 120  # seconds for one CLI run on a busy 2-core machine; each takes a few


def run_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    started = time.perf_counter()
    result = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=TIMEOUT,
                            env={**os.environ, **(env or {})})
    result.seconds = time.perf_counter() - started
    return result


def assert_one_line_error(result: subprocess.CompletedProcess, *expected: str) -> None:
    """Exit status 2, one line on stderr that starts with 'kvpolicy: error:' and holds every ``expected``."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("kvpolicy: error: "), result.stderr
    for text in expected:
        assert text in lines[0], (text, lines[0])


# --- every number a user types --------------------------------------------------------------------------

NUMBER_CASES = [
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens: 0 is out of range"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "-5"], "--max-new-tokens: -5 is out of range"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "many"], "'many' is not a whole number"),
    (["generate", "--prompt", "hi", "--budget", "inf"], "budget 'inf'"),
    (["generate", "--prompt", "hi", "--budget", "1e30"], "budget '1e30'"),
    (["generate", "--prompt", "hi", "--budget", "nan"], "budget 'nan'"),
    (["validate", "h2o", "--layers", "-3"], "--layers: -3 is out of range"),
    (["validate", "h2o", "--layers", "0"], "--layers: 0 is out of range"),
    (["validate", "h2o", "--kv-heads", "0"], "--kv-heads: 0 is out of range"),
    (["validate", "h2o", "--layers", "100000"], "from 1 to 1024"),
    (["compare", "--tokens", "2"], "--tokens: 2 is out of range"),
    (["compare", "--prompt-tokens", "-1"], "--prompt-tokens: -1"),
    (["compare", "--trials", "0"], "--trials: 0"),
    (["compare", "--threads", "0"], "--threads: 0"),
    (["compare", "--budgets", "0.2", "inf"], "budget 'inf'"),
    (["profile", "--prompt", "x", "--out", "x.yaml", "--tokens", "0"], "--tokens: 0"),
    (["profile", "--prompt", "x", "--out", "x.yaml", "--threads", "-2"], "--threads: -2"),
    (["profile", "--prompt", "x", "--out", "x.yaml", "--threshold", "nan"], "--threshold: nan"),
    (["bench", "--prompt-tokens", "99999999999999999999"], "--prompt-tokens"),
    (["bench", "--new-tokens", "0"], "--new-tokens 0"),
    (["bench", "--spread", "inf"], "--spread: inf"),
    (["bench", "--kv-memory", "0"], "must be above zero"),
    (["compare", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["bench", "--prefill-chunk", "256"], "options of --engine vllm"),
    (["bench", "--evict-during-prefill"], "options of --engine vllm"),
    (["bench", "--tensor-parallel-size", "2"], "options of --engine vllm"),
    (["bench", "--compiled"], "options of --engine vllm"),
    (["bench", "--preemption", "recompute"], "options of --engine vllm"),
    (["bench", "--prefix-caching"], "options of --engine vllm"),
    (["bench", "--engine", "vllm", "--tensor-parallel-size", "0"], "--tensor-parallel-size 0: must be at least 1"),
    (["bench", "--engine", "vllm", "--prefill-chunk", "0"], "--prefill-chunk 0: must be at least 1"),
]


def with_out(args: list[str], folder: Path) -> list[str]:
    return args + (["--out", str(folder / "o")] if args[0] in ("compare", "bench") else [])


@pytest.mark.parametrize("args,expected", NUMBER_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_every_number_on_the_command_line_is_checked(args, expected, tmp_path, capsys):
    """Each bad number: exit 2 and one line naming the argument and the range, before any model loads."""
    assert main(with_out(args, tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvpolicy: error: ") and expected in err[0], err


def test_bad_numbers_through_the_installed_cli(tmp_path):
    """One case per command through the installed `kvpolicy` (a process of its own): exit 2, one line, in seconds."""
    cases = [NUMBER_CASES[i] for i in (0, 3, 6, 10, 17, 20)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda case: run_cli(with_out(case[0], tmp_path)), cases))
    for (args, expected), result in zip(cases, results, strict=True):
        assert_one_line_error(result, expected)
        assert result.seconds < 60, (args, result.seconds)


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e30", str(MAX_TOKENS + 1), "-3", "0", "1.5", "x", ""])
def test_parse_budget_refuses_what_no_cache_can_hold(text):
    with pytest.raises(KVPolicyError, match="give a ratio in"):
        parse_budget(text)


def test_parse_budget_accepts_the_bounds():
    assert parse_budget(str(MAX_TOKENS)).tokens == MAX_TOKENS
    assert parse_budget("1").tokens == 1 and parse_budget("1.0").ratio == 1.0 and parse_budget("5.0").tokens == 5


def test_model_folders_that_cannot_be_read_are_one_line(tiny, tmp_path, capsys):
    """Every file a command reads: a broken config.json, a folder without weights, a config with -3 layers."""
    broken, empty, negative = tmp_path / "broken", tmp_path / "no-weights", tmp_path / "negative"
    for folder in (broken, empty, negative):
        folder.mkdir()
    (broken / "config.json").write_text("{")
    (empty / "config.json").write_text(Path(tiny[0], "config.json").read_text())
    config = json.loads(Path(tiny[0], "config.json").read_text())
    (negative / "config.json").write_text(json.dumps({**config, "num_hidden_layers": -3}))
    cases = [
        (["validate", "h2o", "--model", str(broken)], "is not a valid JSON file"),
        (["generate", "--model", str(empty), "--prompt", "hi"], "no file named model.safetensors"),
        (["validate", "h2o", "--model", str(negative)], "num_hidden_layers = -3"),
        (["generate", "--model", tiny[0], "--prompt-file", str(tmp_path)], "does not exist (or is not a file)"),
    ]
    for args, expected in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], (args, err)
    assert_one_line_error(run_cli(cases[0][0]), f"cannot load the model in {str(broken)!r}", "Hugging Face folder")


def test_new_cache_refuses_a_prompt_length_that_is_not_one():
    model = tiny_model("llama")
    session = attach(model, uniform_plan(model, "h2o", Budget(ratio=0.5)))
    for bad in (0, -5, 2**40, 3.5, True):
        with pytest.raises(KVPolicyError, match="prompt_tokens"):
            session.new_cache(prompt_tokens=bad)
    session.detach()


# --- an attached model without a kvpolicy cache -----------------------------------------------------------


def sliding_window_mistral() -> torch.nn.Module:
    from tiny_models import COMMON
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2, sliding_window=5)
    return MistralForCausalLM(config).eval()


@pytest.mark.parametrize("arch", ["llama", "opt", "mistral-window"])
def test_attached_model_without_a_policy_cache_is_plain_transformers(arch, monkeypatch):
    """model(**inputs), use_cache=False and model.generate without cache=: what the model gives under SDPA (left-padded
    batch and a sliding window included), with one warning."""
    model = sliding_window_mistral() if arch == "mistral-window" else tiny_model(arch)
    ids, mask = padded_batch()
    real = mask.bool()
    model.set_attn_implementation("sdpa")
    generate = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        expected_tokens = model.generate(**generate)
    session = attach(model, uniform_plan(model, "h2o", Budget(tokens=4)))
    monkeypatch.setattr(attention_module, "_warned_no_cache", False)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        plain = model(input_ids=ids, attention_mask=mask).logits
        uncached = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        tokens = model.generate(**generate)
    session.detach()
    torch.testing.assert_close(plain[real], expected[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(uncached[real], expected[real], atol=1e-5, rtol=1e-5)
    assert torch.equal(tokens, expected_tokens)
    notes = [w for w in caught if "without a kvpolicy cache" in str(w.message)]
    assert len(notes) == 1


def test_session_generate_without_cache_gives_the_full_cache_tokens():
    model = tiny_model("llama")
    ids, mask = padded_batch()
    generate = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    full = attach(model, uniform_plan(model, "full"))
    expected = full.generate(**generate)
    for policy in ("full", "h2o"):
        session = attach(model, uniform_plan(model, policy, Budget(tokens=4)))
        with pytest.warns(UserWarning, match="use_cache=False"):
            tokens = session.generate(**generate, use_cache=False)
        assert torch.equal(tokens, expected), policy
        assert session.last_cache is None  # no cache ran: no stale report to read
    evicted = session.generate(**generate)  # and the session still evicts when asked normally
    assert int(session.last_cache.layers[0].valid.sum(dim=2).max()) <= 4 and not torch.equal(evicted, expected)
    session.detach()


# --- detached and superseded sessions -----------------------------------------------------------------


def test_detached_or_superseded_sessions_refuse_to_generate():
    model = tiny_model("llama")
    ids, mask = padded_batch()
    generate = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    plan = uniform_plan(model, "h2o", Budget(tokens=5))
    alone = attach(model, plan)
    alone.detach()
    first = attach(model, plan)
    second = attach(model, uniform_plan(model, "window", Budget(tokens=5)))
    first.generate(**generate)  # several sessions attached at once each keep their own recipe (kvpolicy bench)
    assert int(first.last_cache.layers[0].valid.sum(dim=2).max()) <= 5
    second.detach()  # hands the model back: every session on it is detached
    for session in (alone, first, second):
        with pytest.raises(KVPolicyError, match="detached"):
            session.generate(**generate)
        with pytest.raises(KVPolicyError, match="detached"):
            session.new_cache()
    assert model.config._attn_implementation == "sdpa"
    again = attach(model, plan)  # re-attaching gives a working session; detaching an old one again changes nothing
    first.detach()
    again.generate(**generate)
    assert int(again.last_cache.layers[0].valid.sum(dim=2).max()) <= 5
    cache = again.new_cache()
    model.set_attn_implementation("sdpa")  # switched by hand: the session and its cache refuse
    with pytest.raises(KVPolicyError, match="'sdpa' attention"):
        again.generate(**generate)
    with pytest.raises(KVPolicyError, match="'sdpa' attention"):
        model(input_ids=ids, attention_mask=mask, cache=cache)
    rows = attach_rows(model, [plan, uniform_plan(model, "window", Budget(tokens=3))])
    rows.generate(input_ids=ids[:2], attention_mask=mask[:2], max_new_tokens=3, do_sample=False, pad_token_id=0)
    rows.detach()
    with pytest.raises(KVPolicyError, match="detached"):
        rows.generate(**generate)


def test_detach_restores_the_attention_from_before_the_first_attach():
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    first = attach(model, "h2o")
    attach(model, "window")
    first.detach()
    assert model.config._attn_implementation == "eager"


# --- plugins: every hook a plugin implements --------------------------------------------------------------


class _Base(Policy):
    def score(self, state, view):
        return view.positions.float()


class ScoreRaises(_Base):
    hook = 'score'
    name = "score_raises"

    def score(self, state, view):
        raise RuntimeError("score exploded")


class ObserveRaises(_Base):
    hook = 'observe'
    name = "observe_raises"
    needs = frozenset({"colsum"})

    def observe(self, state, stats):
        raise ZeroDivisionError("observe exploded")


class ProfileRaises(_Base):
    hook = 'profile'
    name = "profile_raises"
    profile_needs = frozenset({"colsum"})

    def profile(self, state, stats, view):
        raise IndexError("profile exploded")


class BudgetsRaise(_Base):
    hook = 'budgets'
    name = "budgets_raise"
    dynamic_budget = True

    def budgets(self, state, view):
        raise KeyError("budgets exploded")


class AllocateRaises(_Base):
    hook = 'allocate'
    name = "allocate_raises"
    allocates = True

    def allocate(self, state, view, cells):
        raise ValueError("allocate exploded")


class InitRaises(_Base):
    hook = '__init__'
    name = "init_raises"

    def __init__(self, params=None):
        raise AttributeError("init exploded")


class PrepareRaises(_Base):
    hook = 'prepare'
    name = "prepare_raises"

    def prepare(self, model=None, tokenizer=None):
        raise OSError("prepare exploded")


HOOKED = [ScoreRaises, ObserveRaises, ProfileRaises, BudgetsRaise, AllocateRaises, InitRaises, PrepareRaises]


@pytest.fixture(scope="module")
def hook_registry():
    module = types.ModuleType("kvpolicy_test_hooks")

    @hookimpl
    def kvpolicy_register_policies():
        return HOOKED

    module.kvpolicy_register_policies = kvpolicy_register_policies
    registry = Registry(load_entry_points=False)
    registry.add_plugin(module, "test-hooks")
    assert not registry.broken
    return registry


@pytest.mark.parametrize("policy", HOOKED, ids=lambda p: p.name)
def test_a_policy_hook_that_raises_is_named(policy, hook_registry):
    model = tiny_model("llama")
    ids, mask = padded_batch()
    budget = BY_POLICY if policy.dynamic_budget else Budget(tokens=4)
    plan = Plan("hooks", [LayerPlan([HeadPlan(policy.name, policy.Params(), budget)] * 2) for _ in range(3)])
    with pytest.raises(KVPolicyError, match=rf"policy '{policy.name}' \(from .*\) failed in {policy.hook}: .*exploded"):
        session = attach(model, plan, registry=hook_registry)
        try:
            session.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
        finally:
            session.detach()


def test_a_plugin_that_fails_midway_leaves_no_policy_behind():
    module = types.ModuleType("kvpolicy_test_halfway")

    @hookimpl
    def kvpolicy_register_policies():
        return [ScoreRaises, "not a policy"]

    module.kvpolicy_register_policies = kvpolicy_register_policies
    registry = Registry(load_entry_points=False)
    registry.add_plugin(module, "halfway")
    assert "not a kvpolicy.Policy subclass" in registry.broken["halfway"]
    assert "score_raises" not in registry.policies


PLUGINS = {
    "kvp_test_exiter.py": "import sys\nsys.exit(3)\n",
    "kvp_test_slow.py": "import time\ntime.sleep(2.3)\n",
    "kvp_test_halfway.py": textwrap.dedent("""
        from kvpolicy import Policy, hookimpl

        class Good(Policy):
            name = "halfway_good"

        @hookimpl
        def kvpolicy_register_policies():
            return [Good, 42]
    """),
}


def install_plugins(site: Path, modules: dict[str, str]) -> dict[str, str]:
    """A distribution with ``modules`` as entry points of the "kvpolicy" group, found through PYTHONPATH."""
    site.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (site / name).write_text(source)
    info = site / "kvp_test_plugins-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvp-test-plugins\nVersion: 0.1\n")
    points = "".join(f"{Path(name).stem.removeprefix('kvp_test_')} = {Path(name).stem}\n" for name in modules)
    (info / "entry_points.txt").write_text(f"[kvpolicy]\n{points}")
    return {"PYTHONPATH": str(site)}


def test_plugins_that_exit_hang_or_fail_midway_are_named_and_the_rest_works(tmp_path):
    result = run_cli(["policies"], env=install_plugins(tmp_path / "site", PLUGINS))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "h2o" in result.stdout
    assert "broken plugin exiter: import failed: it called sys.exit(3)" in result.stdout
    assert "broken plugin halfway: registration failed" in result.stdout and "halfway_good" not in result.stdout
    notes = result.stderr.strip().splitlines()
    assert len(notes) == 1 and "plugin 'slow'" in notes[0] and "to import" in notes[0], result.stderr


RAISING_PLUGIN = textwrap.dedent("""
    from dataclasses import dataclass
    from kvpolicy import Policy, hookimpl

    class Raiser(Policy):
        name = "raiser"

        def score(self, state, view):
            raise RuntimeError("score exploded")

    @dataclass
    class BadParams:
        x: int = 1

        def validate(self):
            raise RuntimeError("validate exploded")

    class BadValidate(Policy):
        name = "bad_validate"
        Params = BadParams

    @hookimpl
    def kvpolicy_register_policies():
        return [Raiser, BadValidate]
""")


def test_a_plugin_policy_that_raises_is_named_by_the_cli(tiny, tmp_path):
    env = install_plugins(tmp_path / "site", {"kvp_test_raiser.py": RAISING_PLUGIN})
    recipe = tmp_path / "raiser.yaml"
    recipe.write_text("kvpolicy: 1\npolicy: raiser\nbudget: {tokens: 4}\n")
    result = run_cli(["generate", "--model", tiny[0], "--recipe", str(recipe), "--prompt", "a prompt of many tokens",
                      "--max-new-tokens", "2", "--no-chat"], env=env)
    assert_one_line_error(result, "policy 'raiser' (from kvp_test_raiser) failed in score: RuntimeError: score exploded")


def test_params_validate_that_raises_something_else_is_named(tmp_path):
    env = install_plugins(tmp_path / "site", {"kvp_test_raiser.py": RAISING_PLUGIN})
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("kvpolicy: 1\npolicy: bad_validate\nbudget: {tokens: 4}\n")
    assert_one_line_error(run_cli(["validate", str(recipe)], env=env), "bad_validate", "validate exploded")


# --- compare's results file -----------------------------------------------------------------------------

TOKENS, PROMPT = 64, 48
SWEEP = ["--tokens", str(TOKENS), "--prompt-tokens", str(PROMPT), "--recipes", "window", "h2o", "--budgets", "0.25",
         "0.5", "--tasks", "ppl", "fidelity", "passkey"]


def compare_args(tiny, out: Path, *extra: str) -> list[str]:
    return ["compare", "--model", tiny[0], "--text-file", tiny[1], *SWEEP, "--out", str(out), *extra]


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text(encoding="utf-8").splitlines()]


def csv_without(path: Path, *columns: str) -> list[dict]:
    with path.open(newline="", encoding="utf-8") as file:
        return [{k: v for k, v in row.items() if k not in columns} for row in csv.DictReader(file)]


@pytest.fixture(scope="module")
def clean_run(tiny, tmp_path_factory):
    """A clean sweep (in-process): the folder it ran in, its results file (bytes) and its CSV."""
    out = tmp_path_factory.mktemp("clean") / "run"
    assert main(compare_args(tiny, out)) == 0
    return out, (out / "results.jsonl").read_bytes(), csv_without(out / "results.csv", "created")


def test_resume_over_a_cut_short_line_a_bad_byte_and_a_missing_field(tiny, clean_run, tmp_path, capsys):
    _, results, _ = clean_run
    out = tmp_path / "run"
    out.mkdir()
    lines = results.splitlines(keepends=True)
    assert len(lines) == 15  # 5 rows x 3 tasks
    broken = dict(json.loads(lines[3]))
    del broken["task"]
    lines[3] = json.dumps(broken).encode() + b"\n"  # a missing field
    lines[5] = lines[5][:40] + b"\xff\xfe" + lines[5][40:]  # a bad byte
    lines[-1] = lines[-1][: len(lines[-1]) // 2]  # cut short, no newline: a run killed mid-write
    (out / "results.jsonl").write_bytes(b"".join(lines))
    capsys.readouterr()
    assert main(compare_args(tiny, out)) == 0
    err = capsys.readouterr().err
    assert "3 unreadable line(s)" in err and "results.jsonl.unreadable" in err
    again = rows_of(out)
    assert sorted(r["key"] for r in again) == sorted(json.loads(line)["key"] for line in results.splitlines())
    assert len((out / "results.jsonl.unreadable").read_bytes().splitlines()) == 3


def test_a_results_file_that_is_a_folder_or_unwritable_is_one_line(tiny, tmp_path):
    out = tmp_path / "run"
    (out / "results.jsonl").mkdir(parents=True)
    result = run_cli(["compare", "--tasks", "ppl", "--out", str(out)])  # fails before the model loads
    assert_one_line_error(result, "results.jsonl' is a folder", "choose another --out")
    assert not (out / ".kvpolicy.lock").exists()


def test_a_second_run_into_one_out_is_refused_and_a_stale_lock_taken_over(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    lock = out / ".kvpolicy.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(f"{holder.pid} {os.uname().nodename} 2026-01-01T00:00:00 kvpolicy compare\n")
        result = run_cli(["compare", "--tasks", "ppl", "--out", str(out)])
        assert_one_line_error(result, f"in use by another kvpolicy compare (pid {holder.pid}", "choose another --out")
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock is stale, taken over, and released at the end
    assert main(compare_args(tiny, out, "--tasks", "ppl", "--recipes", "window", "--budgets", "0.5")) == 0
    assert not lock.exists() and len(rows_of(out)) == 2
    with OutputLock(out, "test"):  # held by a live process: a second taker is refused, naming it
        second = subprocess.run([sys.executable, "-c", "from pathlib import Path\n"
                                 "from kvpolicy.commands.output_files import OutputLock\n"
                                 f"with OutputLock(Path({str(out)!r})): pass"],
                                capture_output=True, text=True, timeout=TIMEOUT)
        assert second.returncode == 1 and f"in use by another test (pid {os.getpid()}" in second.stderr
    assert not lock.exists()


def test_compare_interrupted_at_random_points_resumes_to_the_clean_result(tiny, clean_run, tmp_path):
    """SIGINT, SIGTERM and SIGKILL at random moments (loading, mid-sweep), then a resume: every finished row once,
    the results file readable after every interruption, the CSV equal to a clean run's (but for timestamps)."""
    source, results, clean_csv = clean_run
    if source.exists():  # the same --out as the clean run, so that the command recorded in each row matches
        source.rename(source.with_name("clean-moved"))
    clean_keys = sorted(json.loads(line)["key"] for line in results.splitlines())
    rng = random.Random(16)
    args = compare_args(tiny, source)
    # each signal once mid-run, and SIGKILL also while loading (every attempt is a ~10 s process start)
    attempts = [(signal.SIGKILL, "loading"), (signal.SIGTERM, "write"), (signal.SIGINT, "sweep"),
                (signal.SIGKILL, "write")]
    results_file = source / "results.jsonl"
    progress = []
    for sig, moment in attempts:
        before = results_file.read_bytes() if results_file.exists() else b""
        process = subprocess.Popen([CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            if moment == "loading":  # torch and the model are loading
                time.sleep(rng.uniform(0.5, 2.0))
            elif moment == "sweep":  # the sweep has started once its header is out
                while process.poll() is None and "kvpolicy compare" not in (process.stdout.readline() or "x"):
                    pass
                time.sleep(rng.uniform(0.0, 0.3))
            else:  # right after the run wrote a task's rows
                while process.poll() is None and (results_file.read_bytes() if results_file.exists() else b"") == before:
                    time.sleep(0.01)
                time.sleep(rng.uniform(0.0, 0.05))
            if process.poll() is None:
                process.send_signal(sig)
            process.communicate(timeout=TIMEOUT)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        done = [r["key"] for r in rows_of(source)] if results_file.exists() else []  # every line readable
        assert len(done) == len(set(done)) and set(done) <= set(clean_keys), sig
        progress.append(len(done))
    assert progress[0] < len(clean_keys) and progress == sorted(progress), progress  # no finished row is lost
    final = run_cli(args)
    assert final.returncode == 0, final.stderr[-2000:]
    assert sorted(r["key"] for r in rows_of(source)) == clean_keys
    assert csv_without(source / "results.csv", "created") == clean_csv
    assert not (source / ".kvpolicy.lock").exists()


def test_write_atomically_keeps_the_old_file_when_interrupted(tmp_path, monkeypatch):
    from kvpolicy.commands import output_files

    path = tmp_path / "results.jsonl"
    output_files.write_atomically(path, "old\n")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(output_files.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        output_files.write_atomically(path, "new\n")
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["results.jsonl"]


def test_csv_of_rows_with_different_fields_is_whole(tmp_path):
    from kvpolicy.commands.output_files import write_csv

    write_csv(tmp_path / "r.csv", [{"a": 1}, {"b": [1, 2]}])
    assert list(csv.reader(io.StringIO((tmp_path / "r.csv").read_text()))) == [["a", "b"], ["1", ""], ["", "[1, 2]"]]

"""``--device`` and ``--dtype`` on every command that runs a model, and models named by Hub id (no downloads here)."""

from __future__ import annotations

import json

import pytest
import torch

from kvpolicy.commands.cli import main
from kvpolicy.errors import KVPolicyError
from kvpolicy.hf.models import load_model, looks_like_hub_id

# every command that loads a model, with the least arguments it needs
COMMANDS = {
    "generate": ["generate", "--prompt", "hi"],
    "compare": ["compare"],
    "bench": ["bench"],
    "profile": ["profile", "--prompt", "hi", "--out", "never-written.yaml"],
}


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("kvpolicy: error: ") and "\n" not in err, err
    assert "Traceback" not in captured.err
    return err


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_dtype_lists_the_valid_ones(capsys, command):
    err = one_line_error(capsys, [*COMMANDS[command], "--dtype", "float8"])
    assert "unknown dtype 'float8'" in err and "float32, bfloat16, float16" in err


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_machine_without_it_says_so_and_what_to_use(capsys, command):
    err = one_line_error(capsys, [*COMMANDS[command], "--device", "cuda"])
    assert "no CUDA device" in err and "use --device cpu" in err


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_on_a_machine_without_it_says_so(capsys):
    err = one_line_error(capsys, [*COMMANDS["bench"], "--device", "mps"])
    assert "MPS" in err and "use --device cpu" in err


def test_a_device_that_is_no_device(capsys):
    assert "unknown device 'gpu0'" in one_line_error(capsys, [*COMMANDS["generate"], "--device", "gpu0"])


def test_dtype_spellings(capsys, tiny, tmp_path):
    from kvpolicy.commands.common import parse_dtype

    assert [parse_dtype(s) for s in ("bf16", "FP16", "half", "fp32", "float32")] == [
        "bfloat16", "float16", "float16", "float32", "float32"]


def test_hub_ids_and_paths_are_told_apart():
    assert looks_like_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and looks_like_hub_id("gpt2")
    for path in ("./model", "/models/x", "~/m", "a/b/c", "has space", ""):
        assert not looks_like_hub_id(path), path


def test_a_hub_id_absent_from_the_local_cache_offline_is_one_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty local cache
    with pytest.raises(KVPolicyError) as info:
        load_model("kvpolicy-tests/no-such-model-2f9c")
    message = str(info.value)
    assert "kvpolicy-tests/no-such-model-2f9c" in message and "HF_HUB_OFFLINE" in message
    assert "local Hugging Face cache" in message and "smollm2" in message
    err = one_line_error(capsys, ["generate", "--model", "kvpolicy-tests/no-such-model-2f9c", "--prompt", "hi"])
    assert "HF_HUB_OFFLINE" in err
    err = one_line_error(capsys, ["validate", "h2o", "--model", "kvpolicy-tests/no-such-model-2f9c"])
    assert "HF_HUB_OFFLINE" in err


def test_generate_in_bfloat16_on_cpu(tiny, capsys):
    model, _ = tiny
    assert main(["generate", "--model", model, "--prompt", "the cache keeps", "--max-new-tokens", "6",
                 "--recipe", "h2o", "--budget", "4", "--dtype", "bf16", "--device", "cpu"]) == 0
    assert "(bfloat16, cpu)" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_bench_in_half_precision_on_cpu(tiny, tmp_path, dtype):
    model, text = tiny
    out = tmp_path / "bench"
    assert main(["bench", "--model", model, "--text-file", text, "--recipes", "h2o", "streaming", "--budget", "0.25",
                 "--kv-memory", "1MiB", "--prompt-tokens", "48", "--new-tokens", "4", "--repeats", "1",
                 "--max-batch", "4", "--threads", "1", "--dtype", dtype, "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert {row["config"] for row in rows} >= {"plain", "h2o", "streaming"}, rows
    assert all(row["meta"]["args"]["dtype"] == dtype for row in rows)
    assert all(row["decode_tok_s"] > 0 for row in rows)


def test_compare_in_bfloat16_on_cpu_names_its_dtype(tiny, tmp_path):
    model, text = tiny
    out = tmp_path / "cmp"
    assert main(["compare", "--model", model, "--text-file", text, "--tokens", "48", "--prompt-tokens", "32",
                 "--recipes", "h2o", "--budgets", "0.25", "--tasks", "ppl", "fidelity", "--dtype", "bf16",
                 "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert rows and all(row["model"].endswith("(bfloat16, cpu)") for row in rows)
    assert all("--dtype bfloat16" in row["command"] for row in rows)
    ppl = {row["recipe"]: row["ppl"] for row in rows if row["task"] == "ppl"}
    assert all(value == value and 1 < value < 1e4 for value in ppl.values()), ppl  # finite, not NaN

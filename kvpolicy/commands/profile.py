"""``kvpolicy profile``: FastGen's profiling pass on a prompt, written out as a recipe with one policy per head.

`profile_model` attaches a run-time `fastgen` recipe, runs the prompt through the model
once, and reads each (layer, KV head)'s chosen pattern, its recovery and the tokens it kept.
`Profile.recipe_text` writes a normal recipe: ``policy: fastgen`` with the most common
pattern as a fixed ``pattern:`` param and the token sets the profile used (so attaching it
needs no tokenizer and no profiling), ``heads:`` rules giving every other head its own
pattern, and ``policy: full`` for heads that need the whole cache. `kvpolicy validate`
reads it like any recipe.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cache.memory_report import human_bytes
from ..errors import KVPolicyError
from ..policies.fastgen import FastGenParams, parse_pattern, pattern_name
from ..recipe import load_recipe
from .output_files import write_atomically

PARAMS_RECORDED = ("local_ratio", "frequency_ratio", "sinks")  # what a fixed pattern still reads


@dataclass
class Profile:
    """The patterns FastGen chose on one prompt, per [layer][KV head], and what they kept."""

    params: FastGenParams
    prompt_tokens: int
    patterns: list[list[str]]
    recovery: list[list[float]]
    kept: list[list[int]]  # tokens each head kept after the prompt
    special_ids: list[int]
    punct_ids: list[int]
    bytes_per_token: int  # K + V bytes of one token in one KV head
    source: str = "<prompt>"
    model: str = "<model>"
    command: str = ""  # the command that made it, for the recipe's header

    @property
    def heads(self) -> int:
        return sum(len(row) for row in self.patterns)

    def saving(self) -> float:
        """Share of the prompt's KV cache the patterns free: 1 - kept / (heads x prompt tokens)."""
        return 1.0 - sum(map(sum, self.kept)) / (self.heads * self.prompt_tokens)

    def counts(self) -> Counter:
        return Counter(pattern for row in self.patterns for pattern in row)

    def summary(self) -> str:
        """Per layer: each KV head's pattern and recovery, kept share; then the pattern counts and the saving."""
        lines = [f"FastGen profile of {self.model} on {self.source} ({self.prompt_tokens} tokens): threshold "
                 f"{self.params.threshold:g} ({self.params.recovery}, gqa {self.params.gqa}), local_ratio "
                 f"{self.params.local_ratio:g}, frequency_ratio {self.params.frequency_ratio:g}",
                 f"{'layer':>5}  {'kept':>6}  patterns per KV head (recovery)"]
        for index, (row, recovery, kept) in enumerate(zip(self.patterns, self.recovery, self.kept, strict=True)):
            share = sum(kept) / (len(kept) * self.prompt_tokens)
            heads = " | ".join(f"{pattern} ({r:.3f})" for pattern, r in zip(row, recovery, strict=True))
            lines.append(f"{index:>5}  {share:>6.1%}  {heads}")
        counts = ", ".join(f"{pattern} {n}" for pattern, n in self.counts().most_common())
        full = self.heads * self.prompt_tokens * self.bytes_per_token
        kept = sum(map(sum, self.kept)) * self.bytes_per_token
        lines += [f"heads per pattern: {counts}",
                  f"expected KV saving at the prompt: {self.saving():.1%} ({_mib(full)} -> {_mib(kept)} of K/V); "
                  "local and frequency parts grow with the sequence, so the share stays close while decoding"]
        return "\n".join(lines)

    def recipe_text(self, name: str = "fastgen-profiled", description: str | None = None) -> str:
        """The profile as a YAML recipe (schema 1): one policy per head, token sets included."""
        counts = self.counts()
        evicting = [(n, p) for p, n in counts.most_common() if p != "full"]
        default = evicting[0][1] if evicting else None
        description = description or (
            f"FastGen patterns profiled by kvpolicy profile on {self.source} ({self.prompt_tokens} tokens) at "
            f"threshold {self.params.threshold:g}: {self.saving():.0%} of the prompt's KV freed")
        lines = [
            *([f"# {self.command}"] if self.command else []),
            f"# Written by `kvpolicy profile` for {self.model}: {self.source}, {self.prompt_tokens} tokens,",
            f"# threshold {self.params.threshold:g} (recovery {self.params.recovery}, gqa {self.params.gqa}), "
            f"local_ratio {self.params.local_ratio:g}, frequency_ratio {self.params.frequency_ratio:g}.",
            f"# Heads per pattern: {', '.join(f'{p} {n}' for p, n in counts.most_common())}; "
            f"expected KV saving at the prompt {self.saving():.1%}.",
            "kvpolicy: 1",
            f"name: {_quoted(name)}",
            f"description: {_quoted(description)}",
        ]
        if default is None:  # every head keeps everything
            lines.append("policy: full")
            return "\n".join(lines) + "\n"
        lines += ["policy: fastgen", "params:", f"  pattern: {default}"]
        lines += [f"  {key}: {getattr(self.params, key)!r}" for key in PARAMS_RECORDED]
        lines += [f"  special_tokens: {_flow(self.special_ids)}", f"  punct_tokens: {_flow(self.punct_ids)}"]
        rules = []
        for layers, heads, pattern in _runs(self.patterns, default):
            change = "policy: full" if pattern == "full" else f"params: {{pattern: {pattern}}}"
            rules.append(f"  - {{layers: {_quoted(layers)}, heads: [{', '.join(map(str, heads))}], {change}}}")
        if rules:
            lines += ["heads:", *rules]
        return "\n".join(lines) + "\n"

    def write(self, path: str | Path, name: str | None = None) -> Path:
        """Write the recipe, then read it back and check that it gives every head its profiled pattern."""
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise KVPolicyError(f"cannot create the folder of --out {str(path)!r}: {error.strerror or error}") from None
        write_atomically(path, self.recipe_text(name or path.stem))  # an interrupted run leaves no half recipe
        plan = load_recipe(path).resolve(len(self.patterns), len(self.patterns[0]))
        if recipe_patterns(plan) != self.patterns:
            raise KVPolicyError(f"{path}: the written recipe does not reproduce the profile (a kvpolicy bug)")
        return path


def recipe_patterns(plan: Any) -> list[list[str]]:
    """The FastGen pattern each (layer, KV head) of a resolved plan follows ("full" for the full policy)."""
    out = []
    for layer in plan.layers:
        row = []
        for head in layer.heads:
            if head.policy == "full":
                row.append("full")
            elif head.policy == "fastgen" and head.params.pattern is not None:
                row.append(pattern_name(parse_pattern(head.params.pattern)))
            else:
                row.append(f"<{head.policy}>")
        out.append(row)
    return out


def profile_model(model: Any, tokenizer: Any, input_ids: torch.Tensor, *, source: str = "<prompt>",
                  model_name: str = "<model>", **params: Any) -> Profile:
    """Profile ``model`` on one prompt (``input_ids`` [T] or [1, T]) with FastGen ``params`` (threshold=..., ...)."""
    from ..hf.session import attach

    if "pattern" in params:
        raise KVPolicyError("profiling chooses the patterns: do not give `pattern`")
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    if ids.shape[0] != 1 or ids.shape[1] < 2:
        raise KVPolicyError(f"profile one prompt of at least 2 tokens, got input_ids of shape {tuple(input_ids.shape)}")
    session = attach(model, runtime_recipe(**params), tokenizer=tokenizer)
    try:
        cache = session.new_cache()
        with torch.inference_mode():
            model(input_ids=ids.to(next(model.parameters()).device), use_cache=True, **_cache_kwarg(model, cache))
    finally:
        session.detach()
    policy = next(p for p in session._policies.values() if p.name == "fastgen")
    patterns, recovery, kept = [], [], []
    for layer in cache.layers:
        group = next(g for g in layer.policies.groups if g.policy.name == "fastgen")
        patterns.append(layer.cell_labels()[0])
        recovery.append(layer.group_state(group)["recovery"][0].tolist())
        kept.append(layer.valid[0].sum(dim=1).tolist())
    first = cache.layers[0]
    per_token = first.bytes_per_token()
    return Profile(policy.params, ids.shape[1], patterns, recovery, kept, list(getattr(policy, "special_ids", [])),
                   list(getattr(policy, "punct_ids", [])), per_token, source, model_name)


def runtime_recipe(**params: Any) -> Any:
    """A validated recipe running `fastgen` with ``params`` on every head (raises RecipeError on bad params)."""
    return load_recipe({"kvpolicy": 1, "name": "fastgen-profile", "policy": "fastgen", "params": dict(params)})


def _cache_kwarg(model: Any, cache: Any) -> dict[str, Any]:
    from ..hf.session import cache_keyword

    return {cache_keyword(model): cache}


def _runs(patterns: list[list[str]], default: str) -> list[tuple[str, list[int], str]]:
    """(layer span, heads, pattern) rules for every head whose pattern is not ``default``; equal consecutive
    layers share one rule."""
    per_layer = []
    for row in patterns:
        groups: dict[str, list[int]] = {}
        for head, pattern in enumerate(row):
            if pattern != default:
                groups.setdefault(pattern, []).append(head)
        per_layer.append(sorted((tuple(heads), pattern) for pattern, heads in groups.items()))
    rules, start = [], 0
    for index in range(1, len(per_layer) + 1):
        if index == len(per_layer) or per_layer[index] != per_layer[start]:
            span = f"{start}" if index - 1 == start else f"{start}-{index - 1}"
            rules += [(span, list(heads), pattern) for heads, pattern in per_layer[start]]
            start = index
    return rules


def _flow(ids: list[int], width: int = 100) -> str:
    """A YAML flow list of ints, wrapped (continuation lines indented under the key)."""
    lines, line = [], "["
    for index, value in enumerate(ids):
        piece = f"{value}" + (", " if index < len(ids) - 1 else "")
        if len(line) + len(piece) > width:
            lines.append(line.rstrip())
            line = "    "
        line += piece
    return "\n".join([*lines, line + "]"])


def _quoted(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _mib(size: int) -> str:
    return human_bytes(size)


def params_from_args(args: Any) -> dict[str, Any]:
    """FastGen params given on the command line (None: the policy's default)."""
    fields = {f.name for f in dataclasses.fields(FastGenParams)}
    return {key: value for key, value in vars(args).items() if key in fields and value is not None}

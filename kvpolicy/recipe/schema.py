"""The recipe schema, declared once: every key with its kind, default and meaning.

The validator (`kvpolicy.recipe`, `kvpolicy.recipe.budget`) reads the names and defaults from here, and
`kvpolicy.commands.docgen` all of it, for the recipe reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 1

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
REQUIRED = "(required)"  # the default of a key that has none


@dataclass(frozen=True)
class Key:
    """One recipe key: the validator reads its name and default from here, the docs all of it."""

    name: str
    kind: str  # what the value is, in words
    default: Any  # what the validator uses when the key is absent (or REQUIRED)
    doc: str
    default_doc: str = ""  # the default in words, when it is not a plain value


SELECTOR = 'an index (3, "-1"), a range ("0-1", "2-"), a list ("0,2,5-7" or [0, 2]) or "all"'
#: Layer budget schedules (the ``schedule`` budget key) and what each does with a mean budget b.
SCHEDULE_DOCS = {
    "uniform": "every layer gets b",
    "pyramid": "falls linearly with depth, from 2b - b/beta at the lowest layer to b/beta at the top (PyramidKV)",
    "funnel": "the mirror of pyramid: rises with depth (Scissorhands: later layers need more)",
}
SCHEDULES = tuple(SCHEDULE_DOCS)

#: The recipe schema (version SCHEMA_VERSION): top-level keys, layer/head rule keys, budget keys.
TOP_LEVEL = (
    Key("kvpolicy", "integer", REQUIRED, f"schema version; this kvpolicy reads {SCHEMA_VERSION}"),
    Key("name", "string", None, "the recipe's name in plans, tables and plots", "the file name without .yaml"),
    Key("description", "string", "", "one line shown by `kvpolicy recipes` and `kvpolicy validate`"),
    Key("budget", "budget mapping", None, "tokens each (layer, KV head) keeps; see the budget keys",
        "none: unbounded (only `full` may run without a budget)"),
    Key("policy", "policy name", "full", "the policy of every layer and KV head that no rule changes"),
    Key("params", "mapping", {}, "parameters of `policy` (see the policy's parameters); omitted ones take "
        "their defaults"),
    Key("backend", f"one of {', '.join(BACKEND_NAMES)}", "auto", "attention backend for statistics: `auto` picks "
        "triton on CUDA and torch elsewhere; $KVPOLICY_BACKEND overrides it"),
    Key("layers", "list of layer rules", [], "per-layer changes, applied in order (later rules win)"),
    Key("heads", "list of head rules", [], "per-KV-head changes, applied after every layer rule"),
)
_RULE_POLICY = Key("policy", "policy name", None, "switch these cells to another policy (its params start from "
                   "its defaults)", "keep the current policy")
_RULE_PARAMS = Key("params", "mapping", None, "parameters, over the current ones when the policy is unchanged, "
                   "over the new policy's defaults when `policy` switches it", "keep the current params")
_RULE_BUDGET = Key("budget", "budget mapping", None, "a budget of their own for these cells; may give only a "
                   "schedule, which then spreads the top-level amount over the rule's layers",
                   "keep the current budget")
RULES = {
    "layers": (
        Key("layers", "layer selector", REQUIRED, f"the layers the rule applies to: {SELECTOR}"),
        _RULE_POLICY, _RULE_PARAMS, _RULE_BUDGET,
    ),
    "heads": (
        Key("layers", "layer selector", "all", f"the layers: {SELECTOR}"),
        Key("heads", "KV head selector", REQUIRED, f"the KV heads of those layers: {SELECTOR}"),
        _RULE_POLICY, _RULE_PARAMS, _RULE_BUDGET,
    ),
}
BUDGET = (
    Key("ratio", "number in (0, 1]", None, "share of each row's prompt (its real tokens) to keep; give exactly "
        "one of ratio, tokens and memory", "required: one of ratio, tokens, memory"),
    Key("tokens", "integer >= 1", None, "tokens to keep; give exactly one of ratio, tokens and memory",
        "required: one of ratio, tokens, memory"),
    Key("memory", "number in (0, 1]", None, "share of the bytes a 16-bit cache of each row's prompt would take, "
        "per (layer, KV head), counting keys, values, quantization scales and every per-token byte the cache "
        "keeps; spent over `tiers` (one 16-bit tier when none are given); give exactly one of ratio, tokens "
        "and memory", "required: one of ratio, tokens, memory"),
    Key("tiers", "list of tier mappings", None, "precision tiers, best first: the policy's best-ranked tokens go "
        "to the first tier, the next to the lower ones, the rest is evicted; see the tier keys",
        "none: tokens kept at the model's dtype (a memory budget: one 16-bit tier)"),
    Key("threshold", "number > 0", None, "keep only the tokens whose score is at least this many times the mean "
        "score of the head's other unpinned tokens, up to the amount (ratio or tokens), so the tokens kept follow "
        "the input; the cache scores at every step", "none: keep the amount"),
    Key("slack", "integer >= 0", 0, "tokens a head may go over budget before one compaction drops them all "
        "(amortized eviction: fewer compactions, up to `slack` tokens more memory)"),
    Key("align", "integer >= 0", 0, "a row over budget also compacts when its next token starts a later block of "
        "`align` positions than its last compaction did, so that the tokens between two compactions never straddle "
        "two blocks (kvpolicy's vLLM integration compacts so with its block size: set it to reproduce vLLM's "
        "answers here)", "0: off"),
    Key("schedule", f"one of {', '.join(SCHEDULES)}", "uniform", "how the budget is spread over the layers "
        "that use it; the mean layer budget stays the budget"),
    Key("beta", "number >= 1", 20.0, "steepness of pyramid and funnel: the smallest layer budget is "
        "budget/beta"),
    Key("per_layer", "list of positive numbers", None, "one multiplier per layer that uses this budget, in "
        "depth order, averaging 1; excludes `schedule`"),
)
TIER = (
    Key("bits", "one of 16, 8, 4, 2", REQUIRED, "16: 16-bit floats (even when the model computes in fp32); 8, 4, 2: "
        "integer codes, keys per channel and values per token; each tier has fewer bits than the one before, the "
        "first has 16 (sinks and the recent window stay at full precision)"),
    Key("share", "number in (0, 1)", None, "share of the budget for this tier: of its bytes under `memory`, of its "
        "tokens under `ratio` or `tokens`; give share or tokens on every tier but the last",
        "the last tier: what is left"),
    Key("tokens", "integer >= 1", None, "a fixed number of tokens for this tier (e.g. a recent window kept at 16 "
        "bits while everything older is quantized)", "the last tier: what is left"),
    Key("group", "power of two >= 8 dividing the head size", 32, "channels that share one scale and zero point in "
        "this tier's quantized values, and keys quantized per token (KIVI and KVQuant: 32 to 128); a group wider than the "
        "head is the whole head"),
    Key("keys", "channel, cell or token", "channel", "how this tier's keys are scaled: `channel`, a range per channel "
        "over each block of 32 slots of the tier (KIVI: outlier channels get their own scale; 8 bytes a token at head "
        "size 64); `cell`, one range per channel and (row, KV head) that widens as tokens arrive (no per-token bytes, "
        "wider steps); `token`, a scale per token and group, like values (8 bytes a token per 32 channels)"),
)
TOP_KEYS = tuple(key.name for key in TOP_LEVEL)
TIER_KEYS = tuple(key.name for key in TIER)
RULE_KEYS = {kind: tuple(key.name for key in keys) for kind, keys in RULES.items()}
BUDGET_KEYS = tuple(key.name for key in BUDGET)
DEFAULTS = ({("top", k.name): k.default for k in TOP_LEVEL} | {("budget", k.name): k.default for k in BUDGET}
            | {("tier", k.name): k.default for k in TIER})

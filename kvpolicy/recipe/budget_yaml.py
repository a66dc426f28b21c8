"""A recipe's ``budget:`` mapping read into a `Budget`: its amount, slack, precision tiers and layer schedule.

Every error names the file, line and key path, the problem and the fix (`checks.recipe_error`).
"""

from __future__ import annotations

from typing import Any

from ..errors import did_you_mean
from .budget import Budget, Schedule, Tier
from .checks import check_keys, line_of, number_hint, quote, recipe_error, type_ok
from .schema import BUDGET_KEYS, DEFAULTS, KEY_AXES, MAX_TOKENS, SCHEDULES, TIER_BITS, TIER_KEYS


def read_schedule(raw: Any, path: str, file: str) -> Schedule | None:
    if not any(k in raw for k in ("schedule", "beta", "per_layer")):
        return None
    kind, line = raw.get("schedule", DEFAULTS["budget", "schedule"]), line_of(raw)
    if kind not in SCHEDULES:
        raise recipe_error(file, line_of(raw, "schedule"), f"{path}.schedule", f"unknown schedule {quote(kind)}"
                           f"{did_you_mean(str(kind), SCHEDULES)}", f"Use one of: {', '.join(SCHEDULES)}, or per_layer: [...]")
    beta = raw.get("beta", DEFAULTS["budget", "beta"])
    if "beta" in raw and kind not in ("pyramid", "funnel"):
        raise recipe_error(file, line_of(raw, "beta"), f"{path}.beta", f"beta only applies to schedule pyramid or funnel, "
                           f"not {kind}", "E.g. budget: {ratio: 0.2, schedule: pyramid, beta: 20}")
    if not (type_ok(beta, float) and beta >= 1):
        raise recipe_error(file, line_of(raw, "beta"), f"{path}.beta", f"must be a number >= 1, got {quote(beta)}",
                           number_hint(beta) or "The top layer gets budget/beta and the bottom one 2*budget - budget/beta (PyramidKV: 20)")
    per_layer = raw.get("per_layer")
    if per_layer is not None:
        where = (file, line_of(raw, "per_layer"), f"{path}.per_layer")
        if kind != "uniform":
            raise recipe_error(*where, f"per_layer and schedule: {kind} exclude each other", "Give one of them")
        if not (isinstance(per_layer, list) and per_layer and all(type_ok(m, float) and m > 0 for m in per_layer)):
            raise recipe_error(*where, f"expected a list of positive multipliers, got {quote(per_layer)}",
                               "E.g. per_layer: [1.5, 1.0, 0.5]: layer budgets as multiples of the budget, averaging 1")
        average = sum(per_layer) / len(per_layer)
        if abs(average - 1.0) > 1e-6:
            raise recipe_error(*where, f"the multipliers average {average:.6g}, not 1",
                               "They scale the budget per layer, so the mean layer budget stays the recipe's budget")
        per_layer = tuple(float(m) for m in per_layer)
    return Schedule(kind, float(beta), per_layer, path, line)


def read_tiers(raw: Any, path: str, file: str, line: int | None, amount: str | None) -> tuple[Tier, ...]:
    """The ``tiers`` list of a budget whose amount is ``amount`` ("memory", "ratio", "tokens" or None: unbounded)."""
    example = "E.g. tiers: [{bits: 16, share: 0.25}, {bits: 4}]"
    if not (isinstance(raw, list) and raw):
        raise recipe_error(file, line, path, f"expected a list of tiers, got {quote(raw)}", example)
    tiers = []
    for index, entry in enumerate(raw):
        where = f"{path}[{index}]"
        check_keys(entry, TIER_KEYS, f"{where}.", file, line)
        entry_line = line_of(entry)
        bits = entry.get("bits")
        if bits not in TIER_BITS or isinstance(bits, bool):
            raise recipe_error(file, line_of(entry, "bits") or entry_line, f"{where}.bits",
                               f"must be one of {', '.join(map(str, TIER_BITS))}, got {quote(bits)}", example)
        if index == 0 and bits != 16:
            raise recipe_error(file, line_of(entry, "bits"), f"{where}.bits", f"the first tier must keep 16 bits, not {bits}",
                               "Sinks and the recent window stay at full precision: start with {bits: 16, share: ...}")
        if index and bits >= tiers[-1].bits:
            raise recipe_error(file, line_of(entry, "bits"), f"{where}.bits", f"{bits} bits after a tier of "
                               f"{tiers[-1].bits}", "List tiers best first, each with fewer bits than the one before")
        share, tokens, group = entry.get("share"), entry.get("tokens"), entry.get("group", DEFAULTS["tier", "group"])
        last = index == len(raw) - 1
        if share is not None and tokens is not None:
            raise recipe_error(file, entry_line, where, "give share or tokens, not both")
        if not last and share is None and tokens is None:
            raise recipe_error(file, entry_line, where, "every tier but the last needs a size",
                               "Give share: (a part of the budget) or tokens: N; the last tier takes what is left")
        if share is not None and not (type_ok(share, float) and 0 < share < 1):
            raise recipe_error(file, line_of(entry, "share"), f"{where}.share", f"must be a number in (0, 1), got "
                               f"{quote(share)}", number_hint(share) or "A share of the budget, e.g. 0.25")
        if share is not None and amount is None:
            raise recipe_error(file, line_of(entry, "share"), f"{where}.share", "a share needs a budget to share",
                               "Give the budget an amount (memory, ratio or tokens), or give this tier tokens: N")
        if tokens is not None and not (type_ok(tokens, int) and 1 <= tokens <= MAX_TOKENS):
            raise recipe_error(file, line_of(entry, "tokens"), f"{where}.tokens", f"must be an integer from 1 to "
                               f"{MAX_TOKENS:,}, got {quote(tokens)}", number_hint(tokens))
        if not (type_ok(group, int) and group >= 8 and group & (group - 1) == 0):
            raise recipe_error(file, line_of(entry, "group"), f"{where}.group", f"must be a power of two >= 8, got "
                               f"{quote(group)}", "Channels sharing one scale in quantized values, e.g. 32")
        keys = entry.get("keys", DEFAULTS["tier", "keys"])
        if keys not in KEY_AXES:
            raise recipe_error(file, line_of(entry, "keys"), f"{where}.keys", f"unknown key scaling {quote(keys)}"
                               f"{did_you_mean(str(keys), KEY_AXES)}", f"Use one of: {', '.join(KEY_AXES)}")
        tiers.append(Tier(int(bits), None if share is None else float(share), tokens, int(group), keys))
    shares = sum(t.share or 0.0 for t in tiers)
    if shares >= 1:
        raise recipe_error(file, line, path, f"the tiers' shares add up to {shares:g}",
                           "They must leave part of the budget to the last tier: keep their sum below 1")
    return tuple(tiers)


def read_budget(raw: Any, path: str, file: str, line: int | None, rule: bool = False) -> Budget:
    """The `Budget` that a ``budget:`` mapping at ``path`` gives, its schedule included.

    A rule's budget without an amount (only a schedule and/or tiers) takes the top-level amount,
    and one without ``slack`` (``align``) the top-level one (`Budget.inherits`, applied by `Budget.over`).
    A budget may give only ``tiers``: tokens kept at chosen precisions, none evicted by the
    budget (for policies that never evict).
    """
    check_keys(raw, BUDGET_KEYS, f"{path}.", file, line)
    schedule = read_schedule(raw, path, file)
    given = [k for k in ("ratio", "tokens", "memory") if k in raw]
    slack = raw.get("slack", DEFAULTS["budget", "slack"])
    if not (type_ok(slack, int) and 0 <= slack <= MAX_TOKENS):
        raise recipe_error(file, line_of(raw, "slack"), f"{path}.slack",
                           f"must be an integer from 0 to {MAX_TOKENS:,}, got {quote(slack)}", number_hint(slack))
    align = raw.get("align", DEFAULTS["budget", "align"])
    if not (type_ok(align, int) and 0 <= align <= MAX_TOKENS):
        raise recipe_error(file, line_of(raw, "align"), f"{path}.align",
                           f"must be an integer from 0 to {MAX_TOKENS:,} (0: off), got {quote(align)}",
                           number_hint(align) or "A block size in tokens, e.g. align: 32")
    tiers = () if "tiers" not in raw else read_tiers(raw["tiers"], f"{path}.tiers", file, line_of(raw, "tiers"),
                                                      given[0] if len(given) == 1 else None)
    inherits = frozenset(key for key in ("slack", "align") if rule and key not in raw)
    if "threshold" in raw and not given:
        raise recipe_error(file, line_of(raw, "threshold"), f"{path}.threshold", "a threshold needs a cap",
                           "Give the most tokens to keep beside it: budget: {ratio: 0.3, threshold: 1.0}")
    if (rule and not given and schedule is not None) or (not given and tiers and schedule is None):
        if rule:
            inherits |= {"amount"}
        return Budget(slack=slack, align=align, tiers=tiers, schedule=schedule, inherits=inherits, source=path)
    if len(given) != 1:
        problem = "give exactly one of ratio/tokens/memory" + (f", not {' and '.join(given)}" if given else "")
        raise recipe_error(file, line_of(raw), path, problem,
                           "E.g. budget: {ratio: 0.2}, budget: {tokens: 512} or budget: {memory: 0.2}")
    ratio, tokens, memory = raw.get("ratio"), raw.get("tokens"), raw.get("memory")
    if ratio is not None and not (type_ok(ratio, float) and 0 < ratio <= 1):
        raise recipe_error(file, line_of(raw, "ratio"), f"{path}.ratio", f"must be a number in (0, 1], got {quote(ratio)}",
                           number_hint(ratio) or "A ratio is the share of the prompt to keep, e.g. 0.2; for a count use tokens: N")
    if memory is not None and not (type_ok(memory, float) and 0 < memory <= 1):
        raise recipe_error(file, line_of(raw, "memory"), f"{path}.memory", f"must be a number in (0, 1], got "
                           f"{quote(memory)}", number_hint(memory) or "The share of a 16-bit cache's bytes to spend, e.g. 0.2")
    if tokens is not None and not (type_ok(tokens, int) and 1 <= tokens <= MAX_TOKENS):
        raise recipe_error(file, line_of(raw, "tokens"), f"{path}.tokens",
                           f"must be an integer from 1 to {MAX_TOKENS:,}, got {quote(tokens)}",
                           number_hint(tokens) or "A budget in tokens counts the tokens each KV head keeps")
    threshold = raw.get("threshold")
    if threshold is not None:
        where = (file, line_of(raw, "threshold"), f"{path}.threshold")
        if not (type_ok(threshold, float) and threshold > 0):
            raise recipe_error(*where, f"must be a number > 0, got {quote(threshold)}", number_hint(threshold)
                               or "Keep the tokens scoring at least this many times the mean, e.g. 1.0")
        if memory is not None or tiers:
            raise recipe_error(*where, "a threshold keeps a number of tokens that follows the input, which precision "
                               "tiers and memory budgets cannot size", "Give the cap as ratio: or tokens:, without tiers")
        threshold = float(threshold)
    return Budget(tokens=tokens, ratio=None if ratio is None else float(ratio), slack=slack, align=align,
                  memory=None if memory is None else float(memory), tiers=tiers, threshold=threshold,
                  schedule=schedule, inherits=inherits, source=path)

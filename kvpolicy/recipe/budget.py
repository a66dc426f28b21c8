"""The budget: how many tokens a (layer, KV head) keeps, as one object from the recipe's YAML to a layer's limits.

Its way through the code: a recipe's ``budget:`` mapping is read into a `Budget` (`budget_yaml.read_budget`; the
command line, lm-eval and vLLM give a bare number, read by `parse_budget`); resolving the recipe
(`resolve.resolve_layers`) gives every (layer, KV head) its own `Budget`, with a rule's missing parts taken from
the top-level budget (`Budget.over`) and a schedule spread over the layers (`Schedule`); a cache layer turns its
heads' budgets into a ``[batch, kv_heads]`` tensor of token limits once it knows the prompt's length
(`kvpolicy.cache.budgets.CellBudgets.set_limits`, through `Budget.limits_for`), and eviction keeps each cell's
top-scoring ``limit`` tokens (`kvpolicy.storage.base.top_kept`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..errors import KVPolicyError
from .checks import recipe_error
from .schema import DEFAULTS, MAX_TOKENS

#: Tokens a budget without an amount stands for (nothing evicted), far from int64's end so sums cannot overflow.
UNBOUNDED_TOKENS = torch.iinfo(torch.int64).max // 4


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
    ``align``: a row over budget also compacts when its next token lies in a later block of ``align``
    positions than its last compaction did (0: off), so that what arrives between two compactions
    never straddles two blocks; kvpolicy's vLLM integration compacts so with its block size.
    ``by_policy``: the policy sets the budget itself at every eviction (``dynamic_budget``
    policies such as FastGen); a recipe's budget does not apply.

    As read from a recipe, a budget also says how it is spread over layers (``schedule``; None once
    spread, and in every resolved plan), which of its parts a rule takes from the top-level budget
    (``inherits``: "amount", "slack", "align"; empty once resolved) and the YAML path it was read from
    (``source``: its schedule spreads over the layers whose heads share that source).
    """

    tokens: int | None = None
    ratio: float | None = None
    slack: int = 0
    by_policy: bool = False
    memory: float | None = None
    tiers: tuple[Tier, ...] = ()
    threshold: float | None = None  # keep only tokens scoring >= threshold x the mean, up to the amount
    align: int = 0  # after the fields above, so that their positions stay as they were
    schedule: Schedule | None = None
    inherits: frozenset[str] = field(default=frozenset(), compare=False)
    source: str = field(default="budget", compare=False)

    @property
    def tiered(self) -> bool:
        """Kept at chosen precisions (a tiered store) rather than at the model's dtype."""
        return bool(self.tiers) or self.memory is not None

    @property
    def precision_tiers(self) -> tuple[Tier, ...]:
        """The tiers this budget spends its amount on (a memory budget without tiers: one 16-bit tier)."""
        return self.tiers or ((Tier(16),) if self.memory is not None else ())

    def limits_for(self, prompt_tokens: torch.Tensor) -> torch.Tensor:
        """Tokens kept per batch row ([B] int64) for rows whose prompts hold ``prompt_tokens`` real tokens: a
        ratio rounds up, to at least one token; no amount keeps `UNBOUNDED_TOKENS`."""
        if self.tokens is not None:
            return torch.full_like(prompt_tokens, self.tokens)
        if self.ratio is not None:
            return torch.clamp(torch.ceil(prompt_tokens.double() * self.ratio).long(), min=1)
        return torch.full_like(prompt_tokens, UNBOUNDED_TOKENS)

    def limit_for(self, prompt_tokens: int | None) -> int | None:
        """`limits_for` of one prompt; None while a ratio budget waits for the prompt's length."""
        if self.tokens is None and prompt_tokens is None:
            return None
        return int(self.limits_for(torch.tensor([prompt_tokens or 0]))[0])

    def over(self, top: Budget) -> Budget:
        """This rule's budget with what it `inherits` taken from the recipe's top-level budget ``top``."""
        if not self.inherits:
            return self
        slack = top.slack if "slack" in self.inherits else self.slack
        align = top.align if "align" in self.inherits else self.align
        if "amount" in self.inherits:  # only a schedule and/or tiers: the top level's amount
            return dataclasses.replace(top, slack=slack, align=align, tiers=self.tiers or top.tiers,
                                       schedule=self.schedule, inherits=frozenset(), source=self.source)
        return dataclasses.replace(self, slack=slack, align=align, inherits=frozenset())

    def amount_only(self) -> Budget:
        """The amount alone (tokens, ratio or memory, and tiers): slack, schedule and source dropped."""
        return Budget(tokens=self.tokens, ratio=self.ratio, by_policy=self.by_policy, memory=self.memory,
                      tiers=self.tiers, threshold=self.threshold)

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
        if self.threshold is not None:
            text = f"tokens scoring >= {self.threshold:g}x the mean, at most {text}"
        text += f" (+{self.slack} slack)" if self.slack else ""
        text += f" (compactions aligned to blocks of {self.align})" if self.align else ""
        return text + (f" in tiers {' + '.join(t.describe() for t in self.tiers)}" if self.tiers else "")

    @property
    def is_limited(self) -> bool:
        """True if the budget gives an amount (``tokens``, ``ratio`` or ``memory``); False for UNBOUNDED and BY_POLICY."""
        return self.tokens is not None or self.ratio is not None or self.memory is not None


UNBOUNDED = Budget()
BY_POLICY = Budget(by_policy=True)


@dataclass(frozen=True)
class Schedule:
    """How a budget is spread over the layers that use it; the mean over those layers is the budget.

    ``pyramid`` (PyramidKV, Cai et al. 2024): falls linearly with depth, from 2b - b/beta at
    the lowest layer to b/beta at the top. ``funnel``: the mirror, rising with depth (as
    Scissorhands suggests: later layers need more). ``per_layer``: one multiplier per layer,
    averaging to 1. Token budgets are rounded so that their sum is exact; ratio budgets are
    scaled (each layer then rounds its own count up, so the mean may exceed b by < 1 token).
    """

    kind: str = DEFAULTS["budget", "schedule"]
    beta: float = DEFAULTS["budget", "beta"]
    per_layer: tuple[float, ...] | None = None
    path: str = "budget"
    line: int | None = None

    def multipliers(self, count: int, file: str) -> list[float]:
        if self.per_layer is not None:
            if len(self.per_layer) != count:
                raise recipe_error(file, self.line, f"{self.path}.per_layer",
                                   f"{len(self.per_layer)} multipliers for {count} layers that use this budget",
                                   "Give one multiplier per such layer, in depth order")
            return list(self.per_layer)
        if self.kind == "uniform" or count == 1:
            return [1.0] * count
        top, bottom = 1.0 / self.beta, 2.0 - 1.0 / self.beta
        falling = [bottom - (bottom - top) * index / (count - 1) for index in range(count)]
        return falling if self.kind == "pyramid" else falling[::-1]

    def describe(self) -> str:
        if self.per_layer is not None:
            return "per_layer multipliers"
        return self.kind if self.kind == "uniform" else f"{self.kind} (beta={self.beta:g})"


def scale_budget(budget: Budget, multipliers: list[float]) -> list[Budget]:
    """``budget`` times each multiplier; token counts by largest remainder (ties: the lower layer), summing exactly."""
    budget = dataclasses.replace(budget, schedule=None)
    if budget.memory is not None:
        return [dataclasses.replace(budget, memory=budget.memory * m) for m in multipliers]
    if budget.tokens is None:
        return [dataclasses.replace(budget, ratio=budget.ratio * m) for m in multipliers]
    exact = [budget.tokens * m for m in multipliers]
    tokens = [int(x) for x in exact]
    for index in sorted(range(len(exact)), key=lambda i: round(tokens[i] - exact[i], 9))[: round(sum(exact)) - sum(tokens)]:
        tokens[index] += 1
    for index in range(len(tokens)):
        while tokens[index] < 1:  # keep at least one token: take it from the largest layer
            tokens[index] += 1
            tokens[max(range(len(tokens)), key=tokens.__getitem__)] -= 1
    return [dataclasses.replace(budget, tokens=t) for t in tokens]


def budget_amount(budget: Budget) -> float:
    return next(a for a in (budget.tokens, budget.ratio, budget.memory, 0.0) if a is not None)


def parse_budget(value: str | int | float, where: str = "budget") -> Budget:
    """A budget given as one number (the command line, lm-eval's ``budget=``, vLLM's entry): a ratio of the prompt
    in (0, 1] (``0.2``, "0.2", "1.0") or a whole number of tokens (``512``, "512", "5.0"); else a KVPolicyError
    that names ``where``."""
    text = str(value).strip()
    fix = f"give a ratio in (0, 1] (e.g. 0.2) or a whole number of tokens from 1 to {MAX_TOKENS} (e.g. 512)"
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise KVPolicyError(f"{where} {value!r}: {fix}")
    try:
        number = float(text)
    except ValueError:
        raise KVPolicyError(f"{where} {text!r} is not a number: {fix}") from None
    whole = isinstance(value, int) or text.isdigit()  # "1" is one token, "1.0" the whole prompt
    if 0 < number <= 1 and not whole:
        return Budget(ratio=number)
    if 1 <= number <= MAX_TOKENS and number == int(number):  # false for inf and nan
        return Budget(tokens=int(number))
    raise KVPolicyError(f"{where} {text!r}: {fix}")



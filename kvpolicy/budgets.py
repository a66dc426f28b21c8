"""`CellBudgets`: how many tokens each cell (batch row, KV head) of one layer may keep, and how storage is sized.

Budgets come from the recipe (`plan.Budget`: tokens, or a ratio of the prompt resolved at the
first forward pass), except for two kinds of policy: ``allocates`` policies (AdaKV) split a
row's budget among their heads once, at the row's first eviction; ``dynamic_budget`` policies
(FastGen) set their cells' budgets at every eviction.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .errors import KVPolicyError
from .plan import Budget, LayerPlan, Tier
from .policies.base import TokenView
from .policy_calls import PolicyGroup, call_policy, checked
from .storage.base import headroom
from .storage.tier_formats import TierCosts

StateOf = Callable[[PolicyGroup], dict[str, torch.Tensor]]


class CellBudgets:
    def __init__(self, row_plans: list[LayerPlan], groups: list[PolicyGroup], prompt_tokens: int | None):
        self.row_plans = row_plans
        self.prompt_tokens = prompt_tokens
        self.allocating = [g for g in groups if g.policy.allocates]
        self.dynamic = [g for g in groups if g.policy.dynamic_budget]
        self.dynamic_cells = torch.stack([g.cells for g in self.dynamic]).any(dim=0) if self.dynamic else None
        self.limited_cells = torch.tensor([[h.budget.is_limited for h in row.heads] for row in row_plans])
        if self.dynamic_cells is not None:
            self.limited_cells |= self.dynamic_cells
        self.any_limited = bool(self.limited_cells.any())
        self.recipe_slack = max((h.budget.slack for row in row_plans for h in row.heads), default=0)
        self.slack = self.recipe_slack
        self.tiers = layer_tiers(row_plans)
        self.tier_costs: TierCosts | None = None  # set by the layer once its tiered store knows its shapes
        self.reset()

    def reset(self) -> None:
        self.limits: torch.Tensor | None = None  # [B, Hkv] int64, resolved at the first forward pass
        self.slack = self.recipe_slack  # a tiered layer may narrow it when its tiers are sized (`waiting_room`)
        self.uniform_limit: int | None = None  # one limit for every cell, once known (the dense decode fast path)
        self.allocated: torch.Tensor | None = None  # [B, Hkv] bool: cells whose limits an allocating policy fixed
        self._allocation_done = False
        self.tier_sizes: torch.Tensor | None = None  # [T, B, Hkv] tokens per precision tier (tiered layers)

    @property
    def last_unbounded(self) -> bool:
        """The last precision tier keeps every token the others do not (a tiered cache that evicts nothing)."""
        return bool(self.tiers) and not self.any_limited

    @property
    def view_limits(self) -> torch.Tensor | None:
        """The budget policies see (``TokenView.budget``): the 16-bit tier's size on a tiered layer, so that what a
        policy pins (sinks, H2O's recent window) stays at full precision; else the limits."""
        return self.tier_sizes[0] if self.tier_sizes is not None else self.limits

    @property
    def budgets_grow(self) -> bool:
        return self.dynamic_cells is not None

    def resolve(self, tokens_seen: torch.Tensor, first_call_tokens: int) -> None:
        """Limits per cell from each row's first forward pass (``tokens_seen`` real tokens), or ``prompt_tokens``."""
        batch, device = tokens_seen.shape[0], tokens_seen.device
        if self.prompt_tokens is not None:
            prompt = torch.full((batch,), self.prompt_tokens, dtype=torch.long, device=device)
        else:
            prompt = tokens_seen
            if first_call_tokens == 1 and any(h.budget.ratio is not None for row in self.row_plans for h in row.heads):
                raise KVPolicyError(
                    "a ratio budget is resolved from the prompt, but the first forward pass had one token; "
                    "pass the prompt length: session.new_cache(prompt_tokens=N), or use a budget in tokens"
                )
        if len(self.row_plans) not in (1, batch):
            raise KVPolicyError(f"the cache was made for {len(self.row_plans)} batch rows but the batch has {batch}")
        limits = [
            [h.budget.resolve(prompt[b : b + 1])[0] for h in self.row_plans[b if len(self.row_plans) > 1 else 0].heads]
            for b in range(batch)
        ]
        self.limits = torch.tensor(limits, dtype=torch.long, device=device)
        if self.tiers:
            self._resolve_tiers(prompt)
            return
        if self.allocating:
            self.allocated = torch.zeros_like(self.limits, dtype=torch.bool)
        elif not self.dynamic:  # budgets that change at every eviction have no one limit
            self._note_uniform()

    def _resolve_tiers(self, prompt: torch.Tensor) -> None:
        """Tokens per precision tier of every cell, from its budget (tokens, or bytes under a memory budget)."""
        if self.tier_costs is None:
            raise KVPolicyError("a tiered layer's budgets were resolved before its store gave the tiers' costs")
        rows = self.row_plans
        cells = [(h.budget, int(prompt[b])) for b in range(prompt.shape[0]) for h in rows[b if len(rows) > 1 else 0].heads]
        self.slack = waiting_room(cells, self.tier_costs, self.recipe_slack)
        sizes = torch.tensor([tier_sizes(budget, tokens, self.tier_costs, self.slack) for budget, tokens in cells],
                             dtype=torch.long, device=prompt.device)  # [B * Hkv, T], rows first
        self.tier_sizes = sizes.view(prompt.shape[0], -1, len(self.tiers)).permute(2, 0, 1).contiguous()
        total = self.tier_sizes.sum(dim=0)
        self.limits = torch.where(self.limited_cells.to(prompt.device), total, self.limits)

    def _note_uniform(self) -> None:
        if bool(self.limited_cells.all()) and int(self.limits.min()) == int(self.limits.max()):
            self.uniform_limit = int(self.limits.max())

    def set_by_policies(self, state_of: StateOf, view: TokenView) -> None:
        """Limits of the cells whose policies set them (FastGen), asked again at every eviction."""
        limits = self.limits
        for group in self.dynamic:
            given = call_policy(group.policy, "budgets", group.policy.budgets, state_of(group), view)
            given = checked(group.policy, "returned budgets", given, limits.shape, "batch, kv_heads")
            limits = torch.where(group.cells.to(limits.device), given.to(limits).clamp(min=0), limits)
        self.limits = limits

    def allocation_pending(self) -> bool:
        """An allocating policy has cells whose limits are not fixed yet (a sync; only asked while pending)."""
        if self.allocated is None or self._allocation_done:
            return False
        owned = torch.stack([g.cells.to(self.allocated.device).expand_as(self.allocated) for g in self.allocating])
        self._allocation_done = bool((self.allocated | ~owned.any(dim=0)).all())
        return not self._allocation_done

    def allocate(self, state_of: StateOf, view: TokenView, count: torch.Tensor) -> None:
        """Let allocating policies set the limits of rows at their first eviction; fixed afterwards."""
        unlimited = ~self.limited_cells.to(count.device)
        over = (count - torch.where(unlimited, count, self.limits)) > self.slack
        limits = self.limits
        for group in self.allocating:
            cells = group.cells.to(count.device).expand_as(over)
            rows = (over & cells).any(dim=1) & (cells & ~self.allocated).any(dim=1)
            if not bool(rows.any()):
                continue
            chosen = cells & rows[:, None]
            given = call_policy(group.policy, "allocate", group.policy.allocate, state_of(group), view, chosen)
            given = checked(group.policy, "allocated budgets", given, chosen.shape, "batch, kv_heads")
            limits = torch.where(chosen, given.to(limits).clamp(min=0), limits)
            self.allocated |= chosen
        self.limits = limits
        if not self.allocation_pending() and not self.dynamic:
            self._note_uniform()  # an even split: the dense decode fast path applies again

    def effective(self, count: torch.Tensor) -> torch.Tensor:
        """[B, Hkv]: the limit of each cell, its own count where it has none."""
        return torch.where(self.limited_cells.to(count.device), self.limits, count)

    # --- sizing storage (the `storage.base.Sizing` protocol) -------------------------------------------
    def segment_sizes(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows [B, Hkv] for cells holding ``tokens``: limit + slack + 1 (the next token), or amortized growth."""
        limited = self.limited_cells.to(tokens.device).expand_as(tokens)
        grow = tokens + headroom(tokens, False)
        size = torch.maximum(self.limits, tokens) + self.slack + 1
        if self.dynamic_cells is not None:  # budgets that grow with the sequence: a little headroom
            size = torch.where(self.dynamic_cells.to(tokens.device), size + headroom(size, True), size)
        return torch.where(limited, size, grow)

    def grown_segments(self, needed: torch.Tensor) -> torch.Tensor:
        """Rows [B, Hkv] for segments that must hold ``needed`` tokens during a pass."""
        limited = self.limited_cells.to(needed.device).expand_as(needed)
        grown = torch.where(limited, needed, needed + headroom(needed, False))
        if self.dynamic_cells is not None:
            grown = torch.where(self.dynamic_cells.to(needed.device), needed + headroom(needed, True), grown)
        return grown


#: Tokens a tier may hold when nothing bounds it (a tiered cache that evicts nothing).
UNBOUNDED_TOKENS = torch.iinfo(torch.int64).max // 4


def layer_tiers(row_plans: list[LayerPlan]) -> tuple[Tier, ...]:
    """The precision tiers of a layer: the same bits and groups in every cell (sizes may differ), or none."""
    kinds = {tuple((t.bits, t.group, t.keys) for t in h.budget.precision_tiers) for row in row_plans for h in row.heads}
    if len(kinds) > 1:
        raise KVPolicyError(
            f"the KV heads of one layer keep different precision tiers ({' vs '.join(sorted(map(str, kinds)))}); a layer "
            "stores its tiers once for all its heads: give per-head rules the same tiers (bits, group, keys), sizes may differ"
        )
    tiers = next(h.budget.precision_tiers for row in row_plans for h in row.heads)
    return tiers


#: On a tiered layer whose 16-bit tier is a share of the budget, the tokens waiting there between evictions (the
#: slack) are at most this part of what the tier would hold with none waiting: a slack sized for long prompts
#: (h2o-mixed's 16 at 4K tokens) must not crowd the 16-bit tier out on a short one (300 tokens at 20%: ~29 tokens).
MAX_WAITING_SHARE = 8


def waiting_room(cells: list[tuple[Budget, int]], costs: TierCosts, slack: int) -> int:
    """The slack a tiered layer runs with: the recipe's, at most 1/`MAX_WAITING_SHARE` of the smallest 16-bit tier
    among its cells (``(budget, prompt tokens)``) whose 16-bit tier pays for its waiting tokens."""
    paying = [(b, p) for b, p in cells if b.is_limited and b.precision_tiers[0].tokens is None]
    if not slack or not paying:
        return slack
    room = min(tier_sizes(b, p, costs, 0)[0] + 1 for b, p in paying)  # the tier with nothing but the next token waiting
    return min(slack, room // MAX_WAITING_SHARE)


def tier_sizes(budget: Budget, prompt: int, costs: TierCosts, slack: int) -> list[int]:
    """Tokens each tier of one cell keeps under ``budget`` for a ``prompt``-token prompt.

    Token budgets: a tier's ``share`` of the tokens, or its ``tokens``; the last tier the rest.
    Memory budgets: the cell's bytes are ``memory`` x prompt x a 16-bit token's K/V; a tier's
    share of them buys tokens at that tier's cost, and the 16-bit tier also pays for the tokens
    that wait in it between evictions (``slack`` and the next one), so that the bytes held after
    every pass stay within the budget.
    """
    tiers = budget.precision_tiers
    if not budget.is_limited:
        return [t.tokens if t.tokens is not None else UNBOUNDED_TOKENS for t in tiers]
    if budget.memory is None:
        total = int(budget.resolve(torch.tensor([prompt]))[0])
        sizes = [t.tokens if t.tokens is not None else int(t.share * total) if t.share is not None else 0 for t in tiers]
        sizes[-1] = max(total - sum(sizes[:-1]), 0)
        return sizes
    money = math.floor(budget.memory * prompt * costs.reference_token) - costs.cell
    waiting = slack + 1  # tokens that wait in the 16-bit tier between evictions
    sizes = [t.tokens if t.tokens is not None else int(t.share * money) // c if t.share is not None else 0
             for t, c in zip(tiers, costs.token, strict=True)]
    if tiers[0].tokens is None:
        sizes[0] -= waiting  # a share (or the whole budget) of 16-bit bytes pays for the waiting tokens too
    upper = sum(n * c for n, c in zip(sizes[:-1], costs.token, strict=False)) + waiting * costs.token[0]
    if len(tiers) == 1:
        sizes[0] = money // costs.token[0] - waiting
    else:
        sizes[-1] = (money - upper) // costs.token[-1]
    if sizes[0] < 1 or min(sizes) < 0:
        raise KVPolicyError(
            f"budget {budget.describe()}: for a {prompt}-token prompt each KV head gets {max(money, 0):,} bytes, too few "
            f"for the tiers ({', '.join(f'{t.bits}-bit: {c} bytes a token' for t, c in zip(tiers, costs.token, strict=True))}"
            f", {costs.cell} bytes a head, {waiting} tokens waiting at 16 bits): raise memory, or lower the tiers' shares"
        )
    return sizes

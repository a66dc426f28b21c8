"""`CellBudgets`: how many tokens each cell (batch row, KV head) of one layer may keep.

Budgets come from the plan (`kvpolicy.recipe.budget.Budget`: tokens, a ratio of the prompt or a
share of its bytes), turned into a ``[batch, kv_heads]`` limits tensor at one moment, the layer's
first attention call, once the prompt's real length is known (`set_limits`). Two kinds of policy
change them later: ``allocates`` policies (AdaKV, D2O) set a row's budgets once, at the row's
first eviction or, when the policy answers not yet, a later one; ``dynamic_budget`` policies (FastGen) set their cells' budgets at every
eviction. A store sizes its storage from them (the `storage.base.Sizing` protocol); a tiered
layer's limits are its tiers' sizes (`storage.tier_sizing`), priced by its store (`price_tiers`).
"""

from __future__ import annotations

import torch

from ..errors import KVPolicyError
from ..policies.base import TokenView
from ..recipe.plan import LayerPlan
from ..storage.base import headroom
from ..storage.tier_formats import TierCosts
from ..storage.tier_sizing import layer_tiers, tier_sizes, waiting_room
from .policy_group import PolicyGroup, StateOf, call_policy, checked


class CellBudgets:
    def __init__(self, rows: list[LayerPlan], groups: list[PolicyGroup], prompt_tokens: int | None):
        self.rows = rows
        self.prompt_tokens = prompt_tokens
        self.allocating = [g for g in groups if g.policy.allocates]
        self.dynamic = [g for g in groups if g.policy.dynamic_budget]
        self.dynamic_cells = torch.stack([g.cells for g in self.dynamic]).any(dim=0) if self.dynamic else None
        self.limited_cells = torch.tensor([[h.budget.is_limited for h in row.heads] for row in rows])
        if self.dynamic_cells is not None:
            self.limited_cells |= self.dynamic_cells
        self.any_limited = bool(self.limited_cells.any())
        # [B or 1, Hkv]: a threshold budget's factor (0: none); those cells keep what scores above it, up to the limit
        self.thresholds = torch.tensor([[h.budget.threshold or 0.0 for h in row.heads] for row in rows])
        self.thresholded = bool(self.thresholds.any())
        self.recipe_slack = max([h.budget.slack for row in rows for h in row.heads]
                                + [g.policy.lag for g in groups if g.policy.evicts])
        self.slack = self.recipe_slack
        # a row over budget also evicts when its next token lies in a later block of `align` positions than its last
        # eviction did (`Budget.align`; 0: off); none with a policy's lag, which sets when evictions come itself
        lagged = any(g.policy.lag for g in groups if g.policy.evicts)
        self.align = 0 if lagged else max(h.budget.align for row in rows for h in row.heads)
        self.tiers = layer_tiers([h.budget for row in rows for h in row.heads])
        self.tier_costs: TierCosts | None = None  # `price_tiers`: set once a tiered store knows its shapes
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

    def price_tiers(self, costs: TierCosts) -> None:
        """What a token and a cell cost in each precision tier (from the tiered store): memory budgets buy tokens."""
        self.tier_costs = costs

    def set_limits(self, tokens_seen: torch.Tensor, first_call_tokens: int) -> None:
        """Limits per cell from each row's first forward pass (``tokens_seen`` real tokens), or ``prompt_tokens``."""
        batch, device = tokens_seen.shape[0], tokens_seen.device
        if self.prompt_tokens is not None:
            prompt = torch.full((batch,), self.prompt_tokens, dtype=torch.long, device=device)
        else:
            prompt = tokens_seen
            if first_call_tokens == 1 and any(h.budget.ratio is not None for row in self.rows for h in row.heads):
                raise KVPolicyError(
                    "a ratio budget is resolved from the prompt, but the first forward pass had one token; "
                    "pass the prompt length: session.new_cache(prompt_tokens=N), or use a budget in tokens"
                )
        if len(self.rows) not in (1, batch):
            raise KVPolicyError(f"the cache was made for {len(self.rows)} batch rows but the batch has {batch}")
        limits = [
            [h.budget.limits_for(prompt[b : b + 1])[0] for h in self.rows[b if len(self.rows) > 1 else 0].heads]
            for b in range(batch)
        ]
        self.limits = torch.tensor(limits, dtype=torch.long, device=device)
        if self.tiers:
            self._resolve_tiers(prompt)
            return
        if self.allocating:
            self.allocated = torch.zeros_like(self.limits, dtype=torch.bool)
        elif not self.dynamic and not self.thresholded:  # budgets that change at every eviction have no one limit
            self._note_uniform()

    def _resolve_tiers(self, prompt: torch.Tensor) -> None:
        """Tokens per precision tier of every cell, from its budget (tokens, or bytes under a memory budget)."""
        if self.tier_costs is None:
            raise KVPolicyError("a tiered layer's budgets were resolved before its store gave the tiers' costs")
        rows = self.rows
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
        """Let allocating policies set the limits of rows at their first eviction (or a later one, if a policy
        answers not yet); fixed afterwards."""
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
            if given is None:  # not yet: the recipe's budgets for now
                continue
            given = checked(group.policy, "allocated budgets", given, chosen.shape, "batch, kv_heads")
            limits = torch.where(chosen, given.to(limits).clamp(min=0), limits)
            self.allocated |= chosen
        self.limits = limits
        if not self.allocation_pending() and not self.dynamic:
            self._note_uniform()  # an even split: the dense decode fast path applies again

    def under_threshold(self, limits: torch.Tensor, scores: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """[B, Hkv]: the limits of threshold cells lowered to the tokens that clear their threshold: pinned ones
        (+inf) and those scoring at least threshold x the cell's finite scores spread evenly over the ``seen`` [B]
        tokens of its row. Over the tokens seen, not the ones kept: a mean over the kept ones would rise at each
        eviction and evict again, down to nothing."""
        factor = self.thresholds.to(scores.device).expand_as(limits)
        finite = torch.isfinite(scores)
        mean = torch.where(finite, scores, 0.0).sum(dim=2) / seen[:, None].clamp(min=1)
        clears = (scores == torch.inf) | (finite & (scores >= (factor * mean)[..., None]))
        return torch.where(factor > 0, torch.minimum(limits, clears.sum(dim=2)), limits)

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

"""How a tiered layer splits each cell's budget among its precision tiers, at the bytes its store prices them.

A tier's size in tokens follows from the budget (`kvpolicy.recipe.budget.Budget`: a share of its
tokens, or of its bytes under a ``memory`` budget) and from what a token costs in each tier
(`tier_formats.TierCosts`, given by the store). The cache layer's budgets call these when their
limits are set (`kvpolicy.cache.budgets.CellBudgets`).
"""

from __future__ import annotations

import math

from ..errors import KVPolicyError
from ..recipe.budget import UNBOUNDED_TOKENS, Budget, Tier
from .tier_formats import TierCosts


def layer_tiers(budgets: list[Budget]) -> tuple[Tier, ...]:
    """The precision tiers of a layer whose cells have ``budgets``: the same bits and groups in every cell (sizes
    may differ), or none."""
    kinds = {tuple((t.bits, t.group, t.keys) for t in b.precision_tiers) for b in budgets}
    if len(kinds) > 1:
        raise KVPolicyError(
            f"the KV heads of one layer keep different precision tiers ({' vs '.join(sorted(map(str, kinds)))}); a layer "
            "stores its tiers once for all its heads: give per-head rules the same tiers (bits, group, keys), sizes may differ"
        )
    return budgets[0].precision_tiers


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
        total = budget.limit_for(prompt)
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

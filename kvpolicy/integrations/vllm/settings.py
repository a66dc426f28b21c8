"""What a vLLM user asks for (`additional_config={"kvpolicy": {...}}`) and what a paged engine can run of it.

This module imports no vLLM: the same checks run in the tests of the main environment, and every refusal is
one line naming the recipe key and what to use instead (vLLM shows it as the engine's start-up error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...cache.policy_group import LayerPolicies, make_policies
from ...errors import KVPolicyError
from ...policies.base import Policy
from ...recipe import load_recipe, with_budget
from ...recipe.budget import Budget, parse_budget
from ...recipe.plan import LayerPlan, Plan
from ...recipe.schema import MAX_TOKENS
from ...recipe.selectors import spans_text
from ...registry import Registry, get_registry
from .paged import defers_statistics

CONFIG_KEY = "kvpolicy"
#: with prefix caching, policies that read statistics keep their state every this many prompt tokens (rounded up to
#: blocks): a snapshot at P tokens holds P values per KV head and layer, so keeping one every block would grow as
#: the square of a prompt's length (a 1,500-token prompt: ~19% of its K/V in fp32 for SmolLM2; every 256: ~2.4%)
SNAPSHOT_TOKENS = 256
SETTING_KEYS = ("recipe", "budget", "slack", "evict_during_prefill", "preemption")
#: ``never``: a request is admitted only when it can reach its most blocks beside the running ones, so vLLM never
#: preempts one and an answer does not depend on load; ``recompute``: vLLM's own admission (more requests at once),
#: a preempted request recomputed from its tokens and evicted anew, its answer then possibly not its answer alone
PREEMPTION = ("never", "recompute")
PREFIX = f"vLLM additional_config[{CONFIG_KEY!r}]"
BUDGET_KEY = f"{PREFIX}['budget']"


@dataclass(frozen=True)
class Settings:
    """The user's entry: a recipe (built-in name, YAML path or mapping), optionally its budget and slack replaced."""

    recipe: str | dict
    budget: float | int | None = None  # replaces the recipe's: a share of the prompt (0, 1], or tokens (`parse_budget`)
    #: tokens a request may hold over its budget before one eviction; None: the recipe's, raised to a block's worth
    slack: int | None = None
    #: a ratio budget resolves from the prompt's length when the request arrives, so a long prompt evicts between the
    #: chunks of vLLM's chunked prefill (as a token budget does) instead of holding all of its blocks until it is in
    evict_during_prefill: bool = False
    preemption: str = "never"  # one of PREEMPTION


def read_settings(additional_config: Any) -> Settings | None:
    """The kvpolicy entry of vLLM's ``additional_config``; None when there is none (vLLM then runs stock)."""
    if not isinstance(additional_config, dict) or CONFIG_KEY not in additional_config:
        return None
    raw = additional_config[CONFIG_KEY]
    if isinstance(raw, str):  # the short form: {"kvpolicy": "h2o"}
        raw = {"recipe": raw}
    if not isinstance(raw, dict):
        raise KVPolicyError(f"{PREFIX} must be a mapping such as {{\"recipe\": \"h2o\"}}, got {raw!r}")
    unknown = sorted(set(raw) - set(SETTING_KEYS))
    if unknown:
        raise KVPolicyError(f"{PREFIX}: unknown key {unknown[0]!r}; the keys are {', '.join(SETTING_KEYS)}")
    recipe = raw.get("recipe")
    if not isinstance(recipe, (str, dict)) or not recipe:
        raise KVPolicyError(f"{PREFIX}['recipe'] must name a built-in recipe, a YAML file or hold a recipe mapping, "
                            f"got {recipe!r}")
    budget = raw.get("budget")
    if budget is not None:
        parse_budget(budget, BUDGET_KEY)  # refused here, in one line, rather than when the engine starts
    slack = raw.get("slack")
    if slack is not None and not (type(slack) is int and 0 <= slack <= MAX_TOKENS):
        raise KVPolicyError(f"{PREFIX}['slack'] must be a whole number of tokens >= 0, got {slack!r}")
    during_prefill = raw.get("evict_during_prefill", False)
    if type(during_prefill) is not bool:
        raise KVPolicyError(f"{PREFIX}['evict_during_prefill'] must be true or false, got {during_prefill!r}")
    preemption = raw.get("preemption", "never")
    if preemption not in PREEMPTION:
        raise KVPolicyError(f"{PREFIX}['preemption'] must be 'never' (requests admitted only when none will need "
                            "preempting: answers independent of load) or 'recompute' (vLLM's own admission), got "
                            f"{preemption!r}")
    return Settings(recipe=recipe, budget=budget, slack=slack, evict_during_prefill=during_prefill,
                    preemption=preemption)


@dataclass
class PagedLayer:
    """One decoder layer as a paged engine runs it: its policies over the KV heads and its budget rule."""

    policies: LayerPolicies
    rule: int  # index into PagedPlan.rules


@dataclass
class PagedPlan:
    """A recipe resolved for one model, in the shape a paged engine needs: every layer bounded, one budget per layer."""

    plan: Plan
    layers: list[PagedLayer]
    rules: tuple[Budget, ...]  # the distinct layer budgets, their amounts alone
    slack: int
    evict_during_prefill: bool = False  # `Settings.evict_during_prefill`
    align: int = 0  # a request over budget also evicts when its step starts a later block (`Budget.align`)
    step_tokens: int | None = None  # the most tokens vLLM's scheduler runs in one step (a prompt chunk's bound)
    preemption: str = "never"  # `Settings.preemption`
    # over all the model's KV heads, not this rank's: what the scheduler sees must be the same on every rank
    recipe_reads_statistics: bool = False
    recipe_sums_statistics: bool = True  # every layer that reads statistics reads sums over queries

    @property
    def needs_statistics(self) -> bool:
        """Whether any layer's policies read attention statistics (a score pass then runs beside the kernel)."""
        return any(layer.policies.needs for layer in self.layers)

    @property
    def defers_statistics(self) -> bool:
        """Whether any layer stores its decode queries for a later pass (`deferred`, `paged.defers_statistics`)."""
        return any(defers_statistics(layer.policies) for layer in self.layers)

    @property
    def prefix_cacheable(self) -> bool:
        """Whether requests may share prompt blocks through vLLM's prefix cache: every layer that reads statistics
        reads sums over queries (`Policy.additive`), so a cached prompt's state can be kept at a point and added to."""
        return self.recipe_sums_statistics

    def snapshot_tokens(self, block_size: int) -> int:
        """With prefix caching: every how many prompt tokens the worker keeps the statistics' state (a cache hit
        is cut to a multiple of it), or 0 where no layer reads statistics (a hit may end at any block). The same on
        every tensor-parallel rank: vLLM's scheduler, which cuts the hits, runs one KV cache spec for all of them."""
        if not self.recipe_reads_statistics:
            return 0
        return -(-SNAPSHOT_TOKENS // block_size) * block_size

    def scheduler_view(self, block_size: int) -> dict[str, Any]:
        """What vLLM's scheduler is told of the recipe (`KVPolicySpec.from_spec`'s arguments). It depends on the
        whole recipe, never on a rank's heads: vLLM refuses ranks whose KV cache specs differ."""
        return {"rules": self.rules, "slack": self.slack, "align": self.align,
                "evict_during_prefill": self.evict_during_prefill,
                "step_tokens": self.step_tokens, "reserve": self.preemption == "never",
                "hit_tokens": self.snapshot_tokens(block_size)}

    @property
    def observes_decode_steps(self) -> bool:
        """Whether some layer still reads each decode step's own statistics (a pass every step)."""
        return any(layer.policies.needs and not defers_statistics(layer.policies) for layer in self.layers)

    def describe(self) -> str:
        budgets = ", ".join(rule.describe() for rule in self.rules)
        during = ", evicting during prefill" if self.evict_during_prefill else ""
        aligned = f", evictions aligned to blocks of {self.align}" if self.align else ""
        return f"{self.plan.name}: {len(self.layers)} layers, budgets {budgets}, slack {self.slack}{aligned}{during}"


def paged_plan(settings: Settings, num_layers: int, num_kv_heads: int, block_size: int,
               registry: Registry | None = None, heads: range | None = None) -> PagedPlan | None:
    """Resolve the recipe for the model (``num_kv_heads``: all of them); None if it evicts nothing (``full``): vLLM
    then runs stock. ``heads``: the KV heads this process holds (a tensor-parallel rank's), all by default; every
    rank resolves the same recipe over all heads and runs the policies of its own.

    Raises KVPolicyError, in one line, for what paged blocks cannot hold: budgets that differ between the KV heads
    of a layer (a block holds every head of its layer), layers without a budget beside bounded ones (a block
    holds every layer), policies that set budgets themselves or re-rotate keys.
    """
    registry = registry or get_registry()
    recipe = load_recipe(settings.recipe, registry)
    if settings.budget is not None:
        recipe = with_budget(recipe, parse_budget(settings.budget, BUDGET_KEY))  # keeps the recipe's slack and tiers
    plan = recipe.resolve(num_layers, num_kv_heads)
    where = f"recipe {plan.name!r} ({plan.source})"
    # no model or tokenizer here: the policies that would need them are refused before they prepare
    policies = make_policies([plan], registry, check=lambda policy, layer: _check_policy(policy, where, layer))
    for index, layer in enumerate(plan.layers):
        for head in layer.heads:
            if head.budget.threshold is not None:
                raise KVPolicyError(
                    f"{where}: budget.threshold (layer {index}): a threshold keeps a number of tokens per KV head that "
                    "follows the input, but a vLLM KV block holds every head of a layer at one count; give the budget "
                    "as ratio: or tokens: alone, or run the recipe with transformers")
            if head.budget.tiered:
                raise KVPolicyError(
                    f"{where}: budget.{'memory' if head.budget.memory is not None else 'tiers'} (layer {index}): "
                    "precision tiers and budgets in bytes do not run in vLLM yet (its KV blocks hold every token at "
                    "the model's dtype); give the budget in tokens or as a ratio, or run the recipe with transformers")
    bounded = [any(h.budget.is_limited and policies[h.policy_key].evicts for h in layer.heads) for layer in plan.layers]
    if not any(bounded):
        return None
    if not all(bounded):
        free = [index for index, flag in enumerate(bounded) if not flag]
        raise KVPolicyError(
            f"{where}: layer(s) {spans_text(free)} keep every token while the others evict; in vLLM a KV block holds "
            "every layer, so no block could be freed. Give every layer a budget (budget: or layers: rules), "
            "or serve without kvpolicy")
    if heads is not None and (heads.step != 1 or not 0 <= heads.start < heads.stop <= num_kv_heads):
        raise ValueError(f"heads must be a run of the model's {num_kv_heads} KV heads, got {heads}")
    rules: list[Budget] = []
    layers: list[PagedLayer] = []
    for index, layer in enumerate(plan.layers):
        budgets = {(h.budget.tokens, h.budget.ratio) for h in layer.heads}
        if len(budgets) > 1:
            raise KVPolicyError(
                f"{where}: the KV heads of layer {index} have different budgets ({_budget_list(layer.heads)}); a vLLM "
                "KV block holds every head of a layer, so a paged engine keeps one budget per layer. Use one budget "
                "per layer (no `heads:` rules with their own budget)")
        rule = layer.heads[0].budget.amount_only()
        if rule not in rules:
            rules.append(rule)
        held = LayerPlan(layer.heads[heads.start:heads.stop]) if heads is not None else layer
        layers.append(PagedLayer(policies=LayerPolicies.of_rows([held], policies), rule=rules.index(rule)))
    whole = [LayerPolicies.of_rows([layer], policies) for layer in plan.layers]
    readers = [layer for layer in whole if layer.needs]
    recipe_slack = max(h.budget.slack for layer in plan.layers for h in layer.heads)
    lag = max([policy.lag for policy in policies.values() if policy.evicts], default=0)  # the policy's own rhythm
    # a block's worth of slack: each eviction then frees a whole block, and a decode step evicts once per block
    slack = max(settings.slack if settings.slack is not None else max(recipe_slack, block_size - 1), lag)
    # and evictions aligned to blocks: the tokens since the last one then lie in one block, not two (a decoding
    # request holds a block less); a policy's lag sets when evictions come itself
    recipe_align = max(h.budget.align for layer in plan.layers for h in layer.heads)
    align = 0 if lag else recipe_align or block_size
    return PagedPlan(plan=plan, layers=layers, rules=tuple(rules), slack=slack, align=align,
                     evict_during_prefill=settings.evict_during_prefill, preemption=settings.preemption,
                     recipe_reads_statistics=bool(readers),
                     recipe_sums_statistics=all(defers_statistics(layer) for layer in readers))


def _check_policy(policy: Policy, where: str, layer: int) -> None:
    name = policy.name
    if policy.merges:
        raise KVPolicyError(
            f"{where}: policy {name!r} (layer {layer}) merges evicted tokens into kept ones, which vLLM's paged cache "
            "does not do (its blocks are only kept or freed); run it on transformers, or use h2o")
    if policy.probe_needs:
        raise KVPolicyError(
            f"{where}: policy {name!r} (layer {layer}) scores the prompt by a probe, extra forward passes run after "
            "it, which vLLM's scheduler does not run; run it on transformers, or use snapkv or h2o")
    if "query_moments" in policy.needs or policy.reads_kv:
        raise KVPolicyError(
            f"{where}: policy {name!r} (layer {layer}) scores tokens from the cached keys and the queries' moments, "
            "which the vLLM plugin does not hand a policy yet; run it on transformers, or use snapkv or h2o")
    if policy.allocates:
        raise KVPolicyError(
            f"{where}: policy {name!r} (layer {layer}) splits each layer's budget among its KV heads, but a vLLM KV "
            "block holds every head of a layer; use a policy with one budget per layer (h2o, snapkv, tova)")
    if policy.dynamic_budget or policy.profile_needs:
        raise KVPolicyError(
            f"{where}: policy {name!r} (layer {layer}) sets each KV head's budget itself, but a vLLM KV block holds "
            "every head of a layer; use a policy with one budget per layer (h2o, snapkv, tova)")
    if policy.in_cache_positions:
        raise KVPolicyError(
            f"{where}: policy {name!r} (layer {layer}) has params.positions: in_cache, which re-rotates cached keys at "
            "every step; vLLM keeps keys at their original positions: use positions: original")
    if policy.needs_token_ids:
        raise KVPolicyError(f"{where}: policy {name!r} (layer {layer}) reads token ids, which the vLLM integration "
                            "does not keep per slot; use a policy that scores by attention or position")
    if policy.drops_early:
        raise KVPolicyError(f"{where}: policy {name!r} (layer {layer}) drops tokens below the budget, so the heads "
                            "of a layer would hold different counts; a paged engine needs one count per layer")


def _budget_list(heads: list) -> str:
    return ", ".join(sorted({h.budget.describe() for h in heads}))

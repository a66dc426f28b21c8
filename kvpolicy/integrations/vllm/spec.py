"""The scheduler side: a KV cache spec that carries the recipe's layer budgets, and a manager that frees blocks.

vLLM's scheduler never sees attention; it sees how many tokens each request has processed whenever it schedules
it. That is all `schedule.RequestSchedule` needs to know when the worker evicts, so the manager runs the same
rule and returns the emptied blocks to the pool (as vLLM's sliding-window managers do with blocks that left
their window), one step after the eviction that emptied them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from .schedule import BudgetRule, RequestSchedule


@dataclass(frozen=True, kw_only=True)
class KVPolicySpec(FullAttentionSpec):
    """Full attention whose requests keep ``rules`` budgets (tokens, ratio) per layer, plus ``slack`` tokens."""

    kvpolicy_rules: tuple[tuple[int | None, float | None], ...] = ()
    kvpolicy_slack: int = 0
    kvpolicy_evict_during_prefill: bool = False

    @classmethod
    def from_spec(cls, spec: FullAttentionSpec, rules: tuple[BudgetRule, ...], slack: int,
                  evict_during_prefill: bool = False) -> KVPolicySpec:
        given = {f.name: getattr(spec, f.name) for f in fields(FullAttentionSpec) if f.init}
        return cls(**given, kvpolicy_rules=tuple((r.tokens, r.ratio) for r in rules), kvpolicy_slack=slack,
                   kvpolicy_evict_during_prefill=evict_during_prefill)

    @classmethod
    def merge(cls, specs: list[KVPolicySpec]) -> KVPolicySpec:
        policies = {(s.kvpolicy_rules, s.kvpolicy_slack, s.kvpolicy_evict_during_prefill) for s in specs}
        if len(policies) != 1:
            raise ValueError(f"kvpolicy: the layers of one KV cache group disagree on their budgets: {policies}")
        base = FullAttentionSpec.merge(specs)
        rules, slack, during_prefill = policies.pop()
        return cls.from_spec(base, tuple(BudgetRule(*rule) for rule in rules), slack, during_prefill)

    def rules(self) -> tuple[BudgetRule, ...]:
        return tuple(BudgetRule(*rule) for rule in self.kvpolicy_rules)


class KVPolicyManager(FullAttentionManager):
    """Frees the blocks a request's evictions emptied (`RequestSchedule.empty_blocks`), replaced by the null block."""

    def __init__(self, kv_cache_spec: KVPolicySpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.rules = kv_cache_spec.rules()
        self.slack = kv_cache_spec.kvpolicy_slack
        self.evict_during_prefill = kv_cache_spec.kvpolicy_evict_during_prefill
        self.schedules: dict[str, RequestSchedule] = {}

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        schedule = self.schedules.get(request_id)
        if schedule is None:
            schedule = self.schedules[request_id] = RequestSchedule(self.rules, self.slack, self.block_size,
                                                                    self.evict_during_prefill)
        # blocks emptied at earlier step starts only: the step about to run may still read the ones it empties
        lo, hi = schedule.empty_blocks()
        if self.evict_during_prefill and num_prompt_tokens is None:
            raise RuntimeError("kvpolicy: evict_during_prefill needs the prompt's length from vLLM's scheduler "
                               "(remove_skipped_blocks(..., num_prompt_tokens)); this vLLM does not pass it")
        prompt = num_prompt_tokens if num_prompt_tokens is not None else processed_computed_tokens + 1
        schedule.start_step(processed_computed_tokens, prefilling=processed_computed_tokens < prompt,
                            prompt_tokens=num_prompt_tokens)
        self._remove_blocks_in_range(request_id, lo, hi)

    def free(self, request_id: str) -> None:
        self.schedules.pop(request_id, None)
        super().free(request_id)

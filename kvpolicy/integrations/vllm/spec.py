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

from ...recipe.budget import Budget
from .schedule import RequestSchedule, peak_blocks


@dataclass(frozen=True, kw_only=True)
class KVPolicySpec(FullAttentionSpec):
    """Full attention whose requests keep ``rules`` budgets (tokens, ratio) per layer, plus ``slack`` tokens."""

    kvpolicy_rules: tuple[tuple[int | None, float | None], ...] = ()
    kvpolicy_slack: int = 0
    kvpolicy_evict_during_prefill: bool = False
    kvpolicy_step_tokens: int | None = None

    @classmethod
    def from_spec(cls, spec: FullAttentionSpec, rules: tuple[Budget, ...], slack: int,
                  evict_during_prefill: bool = False, step_tokens: int | None = None) -> KVPolicySpec:
        given = {f.name: getattr(spec, f.name) for f in fields(FullAttentionSpec) if f.init}
        return cls(**given, kvpolicy_rules=tuple((r.tokens, r.ratio) for r in rules), kvpolicy_slack=slack,
                   kvpolicy_evict_during_prefill=evict_during_prefill, kvpolicy_step_tokens=step_tokens)

    @classmethod
    def merge(cls, specs: list[KVPolicySpec]) -> KVPolicySpec:
        policies = {(s.kvpolicy_rules, s.kvpolicy_slack, s.kvpolicy_evict_during_prefill, s.kvpolicy_step_tokens)
                    for s in specs}
        if len(policies) != 1:
            raise ValueError(f"kvpolicy: the layers of one KV cache group disagree on their budgets: {policies}")
        base = FullAttentionSpec.merge(specs)
        rules, slack, during_prefill, step_tokens = policies.pop()
        return cls.from_spec(base, tuple(Budget(*rule) for rule in rules), slack, during_prefill, step_tokens)

    def rules(self) -> tuple[Budget, ...]:
        return tuple(Budget(*rule) for rule in self.kvpolicy_rules)


class KVPolicyManager(FullAttentionManager):
    """Frees the blocks a request's evictions emptied (`RequestSchedule.empty_blocks`), replaced by the null block, at
    the start of the step whose eviction empties them."""

    def __init__(self, kv_cache_spec: KVPolicySpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.rules = kv_cache_spec.rules()
        self.slack = kv_cache_spec.kvpolicy_slack
        self.evict_during_prefill = kv_cache_spec.kvpolicy_evict_during_prefill
        self.step_tokens = kv_cache_spec.kvpolicy_step_tokens
        self.schedules: dict[str, RequestSchedule] = {}

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, apply_admission_cap: bool = False,
                                   **kwargs) -> int:
        # vLLM admits a request when its whole prompt fits (scheduler_reserve_full_isl); one that evicts during
        # prefill never holds its whole prompt: cap what it must find free at its peak (`schedule.peak_blocks`), as
        # vLLM caps a sliding-window request's
        if not (apply_admission_cap and self.evict_during_prefill and self.step_tokens):
            return super().get_num_blocks_to_allocate(request_id, num_tokens, *args,
                                                      apply_admission_cap=apply_admission_cap, **kwargs)
        saved = self.max_admission_blocks_per_request
        self.max_admission_blocks_per_request = peak_blocks(self.rules, self.slack, self.block_size, num_tokens,
                                                            self.step_tokens)
        try:
            return super().get_num_blocks_to_allocate(request_id, num_tokens, *args, apply_admission_cap=True,
                                                      **kwargs)
        finally:
            self.max_admission_blocks_per_request = saved

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        schedule = self.schedules.get(request_id)
        if schedule is None:
            schedule = self.schedules[request_id] = RequestSchedule(self.rules, self.slack, self.block_size,
                                                                    self.evict_during_prefill)
        if self.evict_during_prefill and num_prompt_tokens is None:
            raise RuntimeError("kvpolicy: evict_during_prefill needs the prompt's length from vLLM's scheduler "
                               "(remove_skipped_blocks(..., num_prompt_tokens)); this vLLM does not pass it")
        prompt = num_prompt_tokens if num_prompt_tokens is not None else processed_computed_tokens + 1
        schedule.start_step(processed_computed_tokens, prefilling=processed_computed_tokens < prompt,
                            prompt_tokens=num_prompt_tokens)
        # the blocks this step's eviction empties too: its compaction reads them in each layer before any token of
        # the step is written there (the worker remembers where they were), so another request may take them now
        lo, hi = schedule.empty_blocks()
        self._remove_blocks_in_range(request_id, lo, hi)

    def free(self, request_id: str) -> None:
        self.schedules.pop(request_id, None)
        super().free(request_id)

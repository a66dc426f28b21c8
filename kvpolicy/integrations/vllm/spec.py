"""The scheduler side: a KV cache spec that carries the recipe's layer budgets, and a manager that frees blocks.

vLLM's scheduler never sees attention; it sees how many tokens each request has processed whenever it schedules
it. That is all `schedule.RequestSchedule` needs to know when the worker evicts, so the manager runs the same
rule and returns the emptied blocks to the pool (as vLLM's sliding-window managers do with blocks that left
their window), one step after the eviction that emptied them.

It also decides admission so that vLLM never has to preempt a request: vLLM recomputes a preempted request as one
prefill of its prompt and output, which rebuilds the policy's state differently (which tokens each head kept,
H2O's sums, K/V once computed over an evicted cache), so its answer would depend on what else the server ran. A
request whose blocks are bounded (`schedule.most_blocks`) is admitted only when its bound is free beside what the
running requests may still take up to theirs (TensorRT-LLM's guaranteed-no-evict scheduling, cheap here because
evicting requests' bounds are small). ``preemption: recompute`` in the entry turns this off.

With vLLM's prefix caching on, a prefix-cache block is never written: only the blocks a request filled before its
first eviction are hashed (the same bytes as a full cache's), the arena blocks an eviction is about to overwrite
hand their hashes to copies first, and a request that hits the cache gets copies of the hit blocks as its own.
The copies are vLLM's own (``kv_cache_block_copies``, run by the worker before the step's forward pass); what
evictions free goes back to vLLM's pool as cached free blocks, which its LRU reclaims under memory pressure.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, fields

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ...recipe.budget import Budget
from .schedule import RequestSchedule, decoding_blocks, most_blocks

logger = logging.getLogger("vllm.kvpolicy")


@dataclass(frozen=True, kw_only=True)
class KVPolicySpec(FullAttentionSpec):
    """Full attention whose requests keep ``rules`` budgets (tokens, ratio) per layer, plus ``slack`` tokens."""

    kvpolicy_rules: tuple[tuple[int | None, float | None], ...] = ()
    kvpolicy_slack: int = 0
    kvpolicy_align: int = 0
    kvpolicy_evict_during_prefill: bool = False
    kvpolicy_step_tokens: int | None = None
    kvpolicy_reserve: bool = True  # admit a request only when it and the running ones can reach their bounds
    # prefix-cache hits are cut to a multiple of this many tokens, and only prompt blocks are cached (0: any block,
    # up to the first eviction): where the worker keeps the statistics' state (`PagedPlan.snapshot_tokens`)
    kvpolicy_hit_tokens: int = 0

    @classmethod
    def from_spec(cls, spec: FullAttentionSpec, rules: tuple[Budget, ...], slack: int,
                  evict_during_prefill: bool = False, step_tokens: int | None = None,
                  reserve: bool = True, hit_tokens: int = 0, align: int = 0) -> KVPolicySpec:
        given = {f.name: getattr(spec, f.name) for f in fields(FullAttentionSpec) if f.init}
        return cls(**given, kvpolicy_rules=tuple((r.tokens, r.ratio) for r in rules), kvpolicy_slack=slack,
                   kvpolicy_align=align, kvpolicy_evict_during_prefill=evict_during_prefill, kvpolicy_step_tokens=step_tokens,
                   kvpolicy_reserve=reserve, kvpolicy_hit_tokens=hit_tokens)

    @classmethod
    def merge(cls, specs: list[KVPolicySpec]) -> KVPolicySpec:
        policies = {(s.kvpolicy_rules, s.kvpolicy_slack, s.kvpolicy_evict_during_prefill, s.kvpolicy_step_tokens,
                     s.kvpolicy_reserve, s.kvpolicy_hit_tokens, s.kvpolicy_align) for s in specs}
        if len(policies) != 1:
            raise ValueError(f"kvpolicy: the layers of one KV cache group disagree on their budgets: {policies}")
        base = FullAttentionSpec.merge(specs)
        rules, slack, during_prefill, step_tokens, reserve, hit_tokens, align = policies.pop()
        return cls.from_spec(base, tuple(Budget(*rule) for rule in rules), slack, during_prefill, step_tokens,
                             reserve, hit_tokens, align)

    def rules(self) -> tuple[Budget, ...]:
        return tuple(Budget(*rule) for rule in self.kvpolicy_rules)


class KVPolicyManager(FullAttentionManager):
    """Frees the blocks a request's evictions emptied (`RequestSchedule.empty_blocks`), replaced by the null block, at
    the start of the step whose eviction empties them; admits a request only when its bound is free beside what the
    running ones may still take (unless ``reserve`` is off)."""

    def __init__(self, kv_cache_spec: KVPolicySpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.rules = kv_cache_spec.rules()
        self.slack = kv_cache_spec.kvpolicy_slack
        self.align = kv_cache_spec.kvpolicy_align
        self.evict_during_prefill = kv_cache_spec.kvpolicy_evict_during_prefill
        self.step_tokens = kv_cache_spec.kvpolicy_step_tokens
        self.reserve = kv_cache_spec.kvpolicy_reserve
        self.hit_tokens = kv_cache_spec.kvpolicy_hit_tokens
        self.schedules: dict[str, RequestSchedule] = {}
        self.bounds: dict[str, int] = {}  # each request's `most_blocks`, from its sizes (`note_request`)
        self.decode_bounds: dict[str, int] = {}  # the same once its prompt is in: one token a step
        self.overruns = 0  # allocations past a request's bound: a bug in `most_blocks` (vLLM may then preempt)
        # prefix caching: the step start of each request's first eviction (no block past it is hashed), the blocks
        # hashed or handed hashes this step (their bytes arrive in this step's forward pass, after vLLM's block
        # copies: no hit may copy them before the next step), and those evictions freed this step (this step's
        # compaction still reads them: never a copy's destination)
        self.first_evicted: dict[str, int] = {}
        self.fresh: set[int] = set()
        self.freed_now: set[int] = set()
        self.hit_now: set[str] = set()  # requests admitted this step with copies of hit blocks (held for a step)
        self.uncached = 0  # arena blocks whose prefix entry was dropped, no block being free to copy them to
        _note_requests_at_allocation()

    def note_request(self, request_id: str, prompt_tokens: int, total_tokens: int) -> None:
        if request_id not in self.bounds:
            self.bounds[request_id] = most_blocks(self.rules, self.slack, self.block_size, prompt_tokens,
                                                  total_tokens, self.step_tokens, self.evict_during_prefill, self.align)
            self.decode_bounds[request_id] = decoding_blocks(self.rules, self.slack, self.block_size, prompt_tokens,
                                                             total_tokens, self.align)

    def held(self, request_id: str) -> int:
        return sum(1 for block in self.req_to_blocks.get(request_id, ()) if not block.is_null)

    def holds_any(self, request_id: str) -> bool:
        return any(not block.is_null for block in self.req_to_blocks.get(request_id, ()))

    def still_to_take(self, but: str) -> int:
        """Blocks the requests holding some (all but ``but``) may still take before they reach their bounds."""
        total = 0
        for request_id, bound in self.bounds.items():
            held = self.held(request_id) if request_id != but else 0
            if held:
                # a decoding request only grows to its decode bound, far below its prefill's peak
                schedule = self.schedules.get(request_id)
                if schedule is not None and schedule.decoding:
                    bound = self.decode_bounds[request_id]
                total += max(bound - held, 0)
        return total

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, apply_admission_cap: bool = False,
                                   **kwargs) -> int:
        needed = super().get_num_blocks_to_allocate(request_id, num_tokens, *args,
                                                    apply_admission_cap=apply_admission_cap, **kwargs)
        bound = self.bounds.get(request_id)
        if bound is None or self.holds_any(request_id):  # running: its growth was reserved when it was admitted
            return needed
        hits = args[0] if args else kwargs.get("new_computed_blocks", ())
        if any(block.block_id in self.fresh for block in hits):
            return self.block_pool.num_gpu_blocks + 1  # its copies would run before those bytes exist: next step
        copies = 0
        evictable = sum(1 for block in hits if block.ref_cnt == 0 and not block.is_null)  # leave the free queue
        if hits:
            # a copy of each hit block (`add_local_computed_blocks`), never into a block this step's compaction
            # still reads: those free now do not count
            quarantined = sum(1 for block_id in self.freed_now if self.block_pool.blocks[block_id].ref_cnt == 0)
            copies = len(hits) + quarantined
            needed += copies
        if self.reserve:
            # what must be free to admit it: its bound, which may be less than the whole prompt vLLM asks for
            # (`apply_admission_cap`) when it evicts during prefill, or its copies and a block, and what the running
            # ones may still take; the hit blocks that sat free are held until their copies have run
            own = max(bound, copies + 1) + evictable if apply_admission_cap else max(needed, bound + evictable)
            return own + self.still_to_take(but=request_id)
        # vLLM admits a request when its whole prompt fits (scheduler_reserve_full_isl); one that evicts during
        # prefill never holds it all: cap it at its bound, as vLLM caps a sliding-window request's
        return max(min(needed, bound), copies + evictable) if apply_admission_cap else needed

    def allocate_new_blocks(self, request_id: str, *args, **kwargs) -> list:
        blocks = super().allocate_new_blocks(request_id, *args, **kwargs)
        bound = self.bounds.get(request_id)
        held = self.held(request_id) if self.reserve and bound is not None else None
        # (a hit's first step holds every hit block's copy, which its admission counted, above its bound)
        if held is not None and held > bound and request_id not in self.hit_now:
            self.overruns += 1
            if self.overruns == 1:
                logger.warning("kvpolicy: request %s holds %d KV blocks, more than the %d it was admitted for; "
                               "vLLM may have to preempt it (please report this)", request_id, held, bound)
        return blocks

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        schedule = self.schedules.get(request_id)
        if schedule is None:
            schedule = self.schedules[request_id] = RequestSchedule(self.rules, self.slack, self.block_size,
                                                                    self.evict_during_prefill, align=self.align)
        if self.evict_during_prefill and num_prompt_tokens is None:
            raise RuntimeError("kvpolicy: evict_during_prefill needs the prompt's length from vLLM's scheduler "
                               "(remove_skipped_blocks(..., num_prompt_tokens)); this vLLM does not pass it")
        prompt = num_prompt_tokens if num_prompt_tokens is not None else processed_computed_tokens + 1
        decision = schedule.start_step(processed_computed_tokens, prefilling=processed_computed_tokens < prompt,
                                       prompt_tokens=num_prompt_tokens)
        if self.enable_caching:
            for rule, evicts in enumerate(decision):
                if evicts:
                    self.first_evicted.setdefault(request_id, processed_computed_tokens)
                    self._copy_to_cache(request_id, schedule.arena(rule))
        self._free_empty_blocks(request_id, schedule)

    def _free_empty_blocks(self, request_id: str, schedule: RequestSchedule) -> None:
        # the blocks this step's eviction empties too: its compaction reads them in each layer before any token of
        # the step is written there (the worker remembers where they were), so another request may take them now
        lo, hi = schedule.empty_blocks()
        blocks = self.req_to_blocks.get(request_id, ())
        self.freed_now.update(block.block_id for block in blocks[lo:hi] if not block.is_null)
        self._remove_blocks_in_range(request_id, lo, hi)

    def _copy_to_cache(self, request_id: str, arena: int) -> None:
        """Before an eviction overwrites a request's first ``arena`` blocks, give the prefix cache copies of those
        still hashed (vLLM copies them before the step's forward pass; the copies are cached free once it ran)."""
        hashed = [block for block in self.req_to_blocks.get(request_id, ())[:arena]
                  if not block.is_null and block.block_hash is not None]
        if not hashed:
            return
        spare = self.block_pool.get_num_free_blocks() - (self.still_to_take(but="") if self.reserve else 0)
        copies = self._clean_blocks(len(hashed)) if spare >= len(hashed) else None
        if copies is None:  # the running requests' growth comes first: these prefixes are not kept
            self.block_pool.evict_blocks({block.block_id for block in hashed})
            self.uncached += len(hashed)
            return
        for source, copy in zip(hashed, copies, strict=True):
            self.block_pool.move_block_hashes(source, copy)
            source.ref_cnt += 1  # both ends are held until the copy has run (vLLM's retained copy endpoints)
            self._pending_cow_copies.append((source, copy))
            self.fresh.add(copy.block_id)

    def _clean_blocks(self, count: int) -> list | None:
        """``count`` free blocks that this step's compaction does not read (None: not that many)."""
        taken, set_aside = [], []
        while len(taken) < count and self.block_pool.get_num_free_blocks():
            block = self.block_pool.get_new_blocks(1)[0]
            (set_aside if block.block_id in self.freed_now else taken).append(block)
        if set_aside:
            self.block_pool.free_blocks(set_aside)
        if len(taken) < count:
            self.block_pool.free_blocks(taken)
            return None
        return taken

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks, num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        """A prefix-cache hit: the request gets copies of the hit blocks as its own (its evictions will write its
        first blocks). What its first step's eviction empties is freed at its next step: the worker learns a new
        request's blocks from its table after this call, and its compaction reads them."""
        super().add_local_computed_blocks(request_id, new_computed_blocks, num_local_computed_tokens,
                                          num_external_computed_tokens)
        hits = [(index, block) for index, block in enumerate(self.req_to_blocks[request_id]) if not block.is_null]
        copies = self._clean_blocks(len(hits)) if hits else []
        if copies is None:  # admission counted a copy per hit block: a bug
            raise RuntimeError(f"kvpolicy: no free blocks to copy request {request_id}'s {len(hits)} prefix-cache "
                               "hit blocks into (please report this)")
        for (index, source), copy in zip(hits, copies, strict=True):
            self._apply_cow(request_id, index, source, copy)  # the hit's touch holds the source until it has run
            if self._record_new_block_ids:
                self.new_block_ids.append(copy.block_id)
        if hits:
            self.hit_now.add(request_id)

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        """Hash only blocks filled before the request's first eviction: later ones hold compacted tokens, or tokens
        computed over an evicted cache."""
        first = self.first_evicted.get(request.request_id)
        if first is not None:
            num_tokens = min(num_tokens, first)
        if self.hit_tokens:  # the worker keeps the statistics' state within prompts only
            num_tokens = min(num_tokens, request.num_prompt_tokens)
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, num_tokens, *args, **kwargs)
        blocks = self.req_to_blocks.get(request.request_id, ())
        self.fresh.update(block.block_id for block in blocks[before:self.num_cached_block.get(request.request_id, 0)]
                          if not block.is_null)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length: int, kv_cache_group_ids, block_pool, kv_cache_spec,
                               *args, **kwargs):
        """vLLM's longest hit, cut to a multiple of `KVPolicySpec.kvpolicy_hit_tokens` where the worker keeps the
        statistics' state."""
        every = getattr(kv_cache_spec, "kvpolicy_hit_tokens", 0)
        if every:
            max_length = max_length // every * every
        blocks, length = super().find_longest_cache_hit(block_hashes, max_length, kv_cache_group_ids, block_pool,
                                                        kv_cache_spec, *args, **kwargs)
        if every and length % every:
            length = length // every * every
            keep = length // kv_cache_spec.block_size
            blocks = tuple(group[:keep] for group in blocks)
        return blocks, length

    def new_step_starts(self) -> None:
        super().new_step_starts()
        self.fresh.clear()
        self.freed_now.clear()
        self.hit_now.clear()

    def free(self, request_id: str) -> None:
        self.first_evicted.pop(request_id, None)
        self.schedules.pop(request_id, None)
        self.bounds.pop(request_id, None)
        self.decode_bounds.pop(request_id, None)
        super().free(request_id)


def _note_requests_at_allocation() -> None:
    """Wrap vLLM's ``KVCacheManager.allocate_slots`` so that kvpolicy's managers learn each request's prompt length
    and ``max_tokens`` (their own methods see request ids only). Idempotent."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    original = KVCacheManager.allocate_slots
    if getattr(original, "_kvpolicy", False):
        return

    @functools.wraps(original)
    def allocate_slots(self, request, *args, **kwargs):
        total = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        for manager in self.coordinator.single_type_managers:
            if isinstance(manager, KVPolicyManager):
                manager.note_request(request.request_id, request.num_prompt_tokens, total)
        return original(self, request, *args, **kwargs)

    allocate_slots._kvpolicy = True
    KVCacheManager.allocate_slots = allocate_slots

"""What kvpolicy adds to a vLLM attention backend, for any of them (CPU, FlashAttention, Triton): two mixins, one
for the backend's metadata builder and one for its layer implementation. vLLM's own classes do the rest.

- `CompactBuilder`, per step: runs each request's schedule (`schedule.RequestSchedule`, the same rule as the
  scheduler's manager), lists for each layer budget which requests evict now, and has the stock builder build its
  own metadata over the compact layout (`RequestSchedule.compact`): each request's blocks in the order its kernel
  reads them, the tokens it holds as its sequence length, and where the step's tokens go.
- `CompactImpl`, per layer: compacts the requests that evict, writes the step's tokens with the backend's own
  write, runs the backend's own kernel, and, where the layer's policies read attention statistics, a score pass
  (`paged.PagedPolicies`). A subclass says where its backend's cache tensor keeps keys and values (`cache_views`).

No vLLM import here: the backends that mix these in (`backend.py`, `gpu_backend.py`) bring vLLM's classes.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import KVPolicyError
from .deferred import WINDOW, QueryWindows, stored_observation
from .engine import engine_from_config
from .paged import CompactRows, PagedLayerCache, PagedPolicies, slot_rows
from .schedule import RequestSchedule
from .settings import PagedLayer

Observation = tuple[CompactRows, torch.Tensor, torch.Tensor]  # rows, query index [R, q], query positions [R, q]


@dataclass
class StoredQueries:
    """The decode queries a rule's layers store instead of observing them at once (`deferred`), and the passes that
    read stored ones: before the step's eviction (over the layout as it was), and where a window fills (as it is)."""

    step_rows: torch.Tensor  # [n] the step's decode tokens (rows of the step's query tensor)
    entries: torch.Tensor  # [n] where each goes in the layer's query buffer
    buffer_rows: int  # rows the buffer must hold (`QueryWindows.capacity`)
    before: Observation | None  # query index into the buffer
    after: Observation | None


@dataclass
class RuleStep:
    """What the layers of one budget rule do in one step."""

    kernel: Any  # the backend's own metadata over the compact layout: its kernel computes the outputs
    slots: torch.Tensor  # [N] where each new token goes in the compact layout
    evict: tuple[CompactRows, torch.Tensor, torch.Tensor] | None  # rows as they were, budget, tokens seen
    decode: Observation | None  # the step's one-token requests, observed together
    prompts: list[Observation]  # each longer chunk, observed alone
    stored: StoredQueries | None  # for layers whose policies batch decode statistics (`PagedPolicies.defers`)
    metadata: tuple[torch.Tensor, torch.Tensor] | None = None  # `paged.slot_rows` of the step's tokens, made once


@dataclass
class StepPlan:
    rules: list[RuleStep]
    positions: torch.Tensor  # [N] position of each new token


@dataclass
class _Request:
    row: int
    key: int  # the physical id of its first block: names the request while it runs
    start: int
    end: int
    schedule: RequestSchedule
    table: list[int]  # its block table row this step
    before: list[tuple[list[int], int]]  # per rule: (physical blocks, length) before the step's eviction
    after: list[tuple[list[int], int, int]]  # and with the step's tokens in
    decision: tuple[bool, ...]


#: the prompt length of each row of the batch whose metadata is being built (`share_prompt_lengths`)
PROMPT_TOKENS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("kvpolicy_prompt_tokens",
                                                                                   default=None)


def share_prompt_lengths() -> None:
    """Let the metadata builder read each request's prompt length, which vLLM's attention metadata does not carry
    (its model runner computes ``is_prefilling`` from it and drops it): the runner's metadata step runs with its
    input batch's prompt lengths in `PROMPT_TOKENS`. Needed by ``evict_during_prefill`` only; idempotent."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU runner inherits the method

    original = GPUModelRunner._build_attention_metadata
    if getattr(original, "_kvpolicy", False):
        return

    @functools.wraps(original)
    def build(self, *args, **kwargs):
        token = PROMPT_TOKENS.set(self.input_batch.num_prompt_tokens_cpu_tensor)
        try:
            return original(self, *args, **kwargs)
        finally:
            PROMPT_TOKENS.reset(token)

    build._kvpolicy = True
    GPUModelRunner._build_attention_metadata = build


class CompactBuilder:
    """Mixed in before a vLLM metadata builder: ``class Builder(CompactBuilder, CPUAttentionMetadataBuilder)``. The
    metadata it returns is the stock builder's, with the step's plan as its ``kvpolicy`` attribute (None: a dummy
    run, or no recipe)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.engine = engine_from_config(vllm_config)
        if self.engine.active and self.engine.plan.evict_during_prefill:
            share_prompt_lengths()
        # a request's schedule, by the physical id of its first block (the arena's: held until the request ends)
        self.schedules: dict[int, RequestSchedule] = {}
        # and its block table row at its last step: the scheduler frees the blocks a step's eviction empties at the
        # start of that step, so the compaction finds them there, not in the step's table
        self.last_tables: dict[int, list[int]] = {}
        # the decode queries stored for the layers whose policies batch their statistics (`deferred`)
        plan = self.engine.plan if self.engine.active else None
        self.windows = QueryWindows(len(plan.rules)) if plan is not None and plan.defers_statistics else None
        # and whether some layer still observes each decode step (policies that read a step's own attention)
        self.observes_decode = plan is not None and plan.observes_decode_steps

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        step = self._plan_step(common_prefix_len, common_attn_metadata, fast_build) if self.engine.active else None
        if step is None:  # no recipe, or a dummy run: stock metadata, and the layers keep nothing
            metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        else:
            metadata = copy.copy(step.rules[0].kernel)
        metadata.kvpolicy = step
        return metadata

    def _plan_step(self, common_prefix_len, common, fast_build) -> StepPlan | None:
        plan, block_size = self.engine.plan, self.kv_cache_spec.block_size
        starts = common.query_start_loc_cpu.tolist()
        ends = common.seq_lens.cpu().tolist()
        table = common.block_table_tensor.cpu()
        prefilling = common.is_prefilling.cpu().tolist() if common.is_prefilling is not None else None
        prompt_tokens = self._prompt_tokens(common.num_reqs) if plan.evict_during_prefill else None
        requests = []
        for row in range(common.num_reqs):
            count = starts[row + 1] - starts[row]
            first_block = int(table[row, 0])
            if count == 0 or first_block == 0:  # a dummy run (profiling, warm-up): nothing to keep
                return None
            if plan.evict_during_prefill and prompt_tokens is None:  # the scheduler evicts early: so must we
                raise KVPolicyError("kvpolicy: evict_during_prefill needs each request's prompt length, which this "
                                    "vLLM's model runner did not share; serve without evict_during_prefill")
            end = ends[row]
            start = end - count
            schedule = self.schedules.get(first_block)
            if start == 0 or schedule is None:
                if start != 0:
                    raise KVPolicyError(f"kvpolicy: a request reached the worker at token {start} with no schedule; "
                                        "this integration needs every step of a request on one worker")
                schedule = self.schedules[first_block] = RequestSchedule(plan.rules, plan.slack, block_size,
                                                                         plan.evict_during_prefill)
                if self.windows is not None:  # a new request, or one recomputed: nothing stored counts
                    self.windows.forget(first_block)
            row_table = table[row].tolist()
            last_table = row_table if start == 0 else self.last_tables.get(first_block, row_table)
            before = [_physical(last_table, schedule.compact(rule, start)) for rule in range(len(plan.rules))]
            decision = schedule.start_step(start, prefilling[row] if prefilling is not None else False,
                                           prompt_tokens[row] if prompt_tokens is not None else None)
            after = [schedule.compact(rule, end) for rule in range(len(plan.rules))]
            self.last_tables[first_block] = row_table
            requests.append(_Request(row, first_block, start, end, schedule, row_table, before, after, decision))
        if self.windows is not None:
            self.windows.forget_ended({r.key for r in requests}, {block for r in requests for block in r.table})
        device = common.block_table_tensor.device
        positions = torch.cat([torch.arange(r.start, r.end) for r in requests]).to(device)
        # the statistics: decode steps together (one query each), each prompt chunk alone (long, of any length)
        decoding = [r for r in requests if r.end - r.start == 1]
        prompts = [r for r in requests if r.end - r.start > 1]
        decode_queries = _queries(decoding, starts, device) if self.observes_decode and decoding else None
        prompt_queries = [_queries([r], starts, device) for r in prompts] if plan.needs_statistics else []
        rules = []
        for rule in range(len(plan.rules)):
            evicting = [r for r in requests if r.decision[rule]]
            evict = None
            if evicting:
                rows = CompactRows.of([r.before[rule] for r in evicting], block_size, device)
                budget = torch.tensor([r.schedule.states[rule].budget for r in evicting], device=device)
                evict = (rows, budget, torch.tensor([r.start for r in evicting], device=device))
            layouts = {r.row: _physical(r.table, r.after[rule]) for r in requests}
            decode = None
            if decode_queries is not None:
                decode = (CompactRows.of([layouts[r.row] for r in decoding], block_size, device), *decode_queries)
            observe_prompts = [(CompactRows.of([layouts[r.row]], block_size, device), *query)
                               for r, query in zip(prompts, prompt_queries, strict=False)]
            stored = self._stored(rule, requests, layouts, starts, device) if self.windows is not None else None
            slots = torch.cat([_slots(layouts[r.row][0], r.after[rule][2], r.start, r.end, block_size)
                               for r in requests]).to(device)
            kernel = super().build(common_prefix_len, _compact(common, requests, layouts, slots), fast_build)
            rules.append(RuleStep(kernel, slots, evict, decode, observe_prompts, stored))
        return StepPlan(rules, positions)

    def _stored(self, rule: int, requests: list[_Request], layouts: dict, starts: list[int], device: torch.device
                ) -> StoredQueries:
        """Which decode queries a rule's deferring layers store this step, and which stored ones they read."""
        block_size = self.kv_cache_spec.block_size
        plan = self.windows.plan(rule, [(r.key, r.start, r.end, r.decision[rule]) for r in requests])
        return StoredQueries(
            torch.tensor([starts[requests[i].row] for i, _ in plan.stores], dtype=torch.long, device=device),
            torch.tensor([entry for _, entry in plan.stores], dtype=torch.long, device=device), self.windows.capacity,
            stored_observation([(requests[i].before[rule], flush) for i, flush in plan.before], block_size, device),
            stored_observation([(layouts[requests[i].row], flush) for i, flush in plan.after], block_size, device))

    @staticmethod
    def _prompt_tokens(rows: int) -> list[int] | None:
        shared = PROMPT_TOKENS.get()
        if shared is None:  # a dummy run (profiling, warm-up) outside the runner's metadata step; real steps have it
            return None
        return shared[:rows].tolist()


def _compact(common, requests: list[_Request], layouts: dict, slots: torch.Tensor):
    """vLLM's common metadata over the compact layout: each request's blocks in the order its kernel reads them, the
    tokens it holds as its sequence length, the step's tokens at their compact slots."""
    count = max(len(layouts[r.row][0]) for r in requests)
    table = torch.zeros(len(requests), count, dtype=common.block_table_tensor.dtype)
    for index, r in enumerate(requests):
        blocks = layouts[r.row][0]
        table[index, : len(blocks)] = torch.tensor(blocks, dtype=table.dtype)
    lengths = torch.tensor([layouts[r.row][1] for r in requests], dtype=common.seq_lens.dtype)
    device = common.block_table_tensor.device
    return dataclasses.replace(common, seq_lens=lengths.to(device), block_table_tensor=table.to(device),
                               slot_mapping=slots, max_seq_len=int(lengths.max()), seq_lens_cpu_upper_bound=lengths)


def _physical(row_table: list[int], layout: tuple[list[int], int, int]) -> tuple[list[int], int]:
    """(physical blocks, length) of a compact layout, from a request's block table row."""
    logical, length, _ = layout
    return [row_table[i] for i in logical], length


def _slots(blocks: list[int], shift: int, start: int, end: int, block_size: int) -> torch.Tensor:
    """Where the tokens at positions [start, end) go: slot ``position - shift`` of the request's compact blocks."""
    index = torch.arange(start - shift, end - shift)
    return torch.tensor(blocks, dtype=torch.long)[index // block_size] * block_size + index % block_size


def _queries(group: list[_Request], starts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's new tokens, right-aligned (left pads: -1), and their positions."""
    width = max(r.end - r.start for r in group)
    index = torch.full((len(group), width), -1, dtype=torch.long)
    positions = torch.full((len(group), width), -1, dtype=torch.long)
    for i, r in enumerate(group):
        count = r.end - r.start
        index[i, width - count:] = torch.arange(starts[r.row], starts[r.row] + count)
        positions[i, width - count:] = torch.arange(r.start, r.end)
    return index.to(device), positions.to(device)


class CompactImpl:
    """Mixed in before a vLLM attention implementation: ``class Impl(CompactImpl, CPUAttentionBackendImpl)``.
    A subclass gives `cache_views`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from vllm.config import get_current_vllm_config

        self.engine = engine_from_config(get_current_vllm_config())
        self.caches: dict[str, tuple[int, PagedLayerCache]] = {}  # by layer: (the cache tensor's address, views)
        # per attention module: its decoder layer's plan and policies (looked up by name once, not every step)
        self.layers: dict[str, tuple[PagedLayer, PagedPolicies]] = {}

    def cache_views(self, layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) ``[blocks, Hkv, bs, D]`` views of the backend's cache tensor for one layer."""
        raise NotImplementedError

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if not self.engine.active:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # else: forward writes the step's tokens where the compact layout puts them, after this layer's eviction

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        step = getattr(attn_metadata, "kvpolicy", None)
        if not self.engine.active or step is None:  # no recipe; or warm-up and profiling runs: nothing kept
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        name = layer.layer_name
        if name not in self.layers:
            paged_layer = self.engine.layer(name)
            backend = "triton" if kv_cache.is_cuda else "torch"
            self.layers[name] = paged_layer, PagedPolicies(paged_layer.policies, backend=backend)
        paged_layer, policies = self.layers[name]
        known = self.caches.get(name)
        if known is None or known[0] != kv_cache.data_ptr():
            known = self.caches[name] = (kv_cache.data_ptr(),
                                         PagedLayerCache.over(*self.cache_views(layer, kv_cache), paged_layer.policies))
        cache = known[1]
        todo = step.rules[paged_layer.rule]
        stored = todo.stored if policies.defers else None
        if stored is not None and stored.before is not None:  # the queries stored since the last eviction
            policies.observe(cache, stored.before[0], cache.stored_queries(), *stored.before[1:], self.scale)
        if todo.evict is not None:
            policies.evict(cache, *todo.evict)
        count = attn_metadata.num_actual_tokens
        # the step's tokens after this layer's eviction made room for them, where the compact layout puts them
        super().do_kv_cache_update(layer, key[:count], value[:count], kv_cache, todo.slots)
        if todo.metadata is None:  # the same for every layer of the rule
            todo.metadata = slot_rows(todo.slots, step.positions, cache.positions.shape[1], cache.block_size)
        cache.write_metadata(todo.slots, step.positions, todo.metadata)
        if stored is not None and len(stored.entries):
            cache.store_queries(query[stored.step_rows], stored.entries, stored.buffer_rows * WINDOW)
        super().forward(layer, query, key, value, kv_cache, todo.kernel, output, output_scale, output_block_scale)
        if stored is not None:
            if stored.after is not None:  # a window filled
                policies.observe(cache, stored.after[0], cache.stored_queries(), *stored.after[1:], self.scale)
        elif todo.decode is not None:
            policies.observe(cache, todo.decode[0], query, *todo.decode[1:], self.scale)
        for rows, query_index, query_positions in todo.prompts:
            policies.observe(cache, rows, query, query_index, query_positions, self.scale)
        return output


class CompactBackend:
    """Mixed in before a vLLM attention backend: its KV cache spec carries the recipe's budgets, and its builder and
    implementation are the subclass's ``builder_class`` and ``impl_class`` (the stock ones with the mixins above)."""

    builder_class: type
    impl_class: type

    @classmethod
    def customize_spec(cls, spec):
        from .engine import process_engine

        return customize_spec(super().customize_spec(spec), process_engine())

    @classmethod
    def get_impl_cls(cls) -> type:
        return cls.impl_class

    @classmethod
    def get_builder_cls(cls) -> type:
        return cls.builder_class


def customize_spec(spec, engine) -> Any:
    """The KV cache spec of a backend running ``engine``'s recipe: vLLM's full attention spec with its budgets."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from .spec import KVPolicySpec

    if engine is None or not engine.active:
        return spec
    if type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
        raise KVPolicyError(f"kvpolicy: the vLLM integration runs models whose layers are all full attention; "
                            f"this one has a {type(spec).__name__} layer: serve it without kvpolicy")
    plan = engine.plan
    return KVPolicySpec.from_spec(spec, plan.rules, plan.slack, plan.evict_during_prefill, plan.step_tokens,
                                  reserve=plan.preemption == "never")

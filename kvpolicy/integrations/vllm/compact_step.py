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
from .compact_rows import CompactRows, slot_rows
from .deferred import WINDOW, QueryWindows, stored_observation
from .engine import engine_from_config
from .paged import PagedLayerCache, PagedPolicies
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
    # each longer chunk, observed alone; a chunk that passes a snapshot boundary before its request's first
    # eviction in pieces, each ending at a boundary followed by (block, slots): keep the state of those slots there
    prompts: list[tuple[CompactRows, torch.Tensor, torch.Tensor, tuple[int, torch.Tensor] | None]]
    stored: StoredQueries | None  # for layers whose policies batch decode statistics (`PagedPolicies.defers`)
    metadata: tuple[torch.Tensor, torch.Tensor] | None = None  # `paged.slot_rows` of the step's tokens, made once


@dataclass
class Adopt:
    """Requests that start at a prefix-cache hit: the slots and positions of the tokens vLLM copied into their
    blocks (K/V only), and, for policies that read statistics, where each one's state for them comes from."""

    slots: torch.Tensor
    positions: torch.Tensor
    states: list[tuple[int, torch.Tensor]]  # (the block whose snapshot holds it, the request's slots [P])


@dataclass
class StepPlan:
    rules: list[RuleStep]
    positions: torch.Tensor  # [N] position of each new token
    adopt: Adopt | None = None
    # blocks handed to requests since the last step (their snapshots are stale) and vLLM's block copies (src, dst)
    block_moves: tuple[set[int], list[tuple[int, int]]] | None = None


@dataclass
class _Request:
    row: int
    key: str  # its request id
    start: int
    end: int
    schedule: RequestSchedule
    table: list[int]  # its block table row this step
    before: list[tuple[list[int], int]]  # per rule: (physical blocks, length) before the step's eviction
    after: list[tuple[list[int], int, int]]  # and with the step's tokens in
    decision: tuple[bool, ...]


@dataclass
class Batch:
    """What vLLM's attention metadata does not carry and the builder needs, from the model runner of this process:
    each row's request id and prompt length (its runner computes ``is_prefilling`` from them and drops them), the
    requests (re)started at the step (new, or resumed after a preemption: their first step may start past token 0,
    at a prefix-cache hit), and those that ended since the builder last looked."""

    request_ids: list[str]
    prompt_tokens: torch.Tensor
    started: set[str]


#: the batch whose metadata is being built (`share_batch`)
BATCH: contextvars.ContextVar[Batch | None] = contextvars.ContextVar("kvpolicy_batch", default=None)
# filled by the runner's state update, read by the builder: requests started and ended, blocks handed to requests
# and vLLM's block copies (src, dst) since the builder last looked
_STEP = {"started": set(), "finished": set(), "allocated": set(), "copies": []}


def share_batch() -> None:
    """Wrap the model runner (the CPU runner inherits GPUModelRunner's methods) so that its metadata step runs with
    `BATCH` set, and its state update records which requests start and end. Idempotent."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    build, update = GPUModelRunner._build_attention_metadata, GPUModelRunner._update_states
    if getattr(build, "_kvpolicy", False):
        return

    @functools.wraps(update)
    def update_states(self, scheduler_output):
        _STEP["finished"] |= set(scheduler_output.finished_req_ids)
        _STEP["started"] = ({new.req_id for new in scheduler_output.scheduled_new_reqs}
                            | set(scheduler_output.scheduled_cached_reqs.resumed_req_ids))
        for new in scheduler_output.scheduled_new_reqs:
            _STEP["allocated"].update(block for group in new.block_ids for block in group)
        for groups in scheduler_output.scheduled_cached_reqs.new_block_ids:
            _STEP["allocated"].update(block for group in groups or () for block in group)
        _STEP["copies"] += [(copy.src_block_id, copy.dst_block_id)
                            for copy in scheduler_output.kv_cache_block_copies or ()]
        return update(self, scheduler_output)

    @functools.wraps(build)
    def build_metadata(self, *args, **kwargs):
        batch = self.input_batch
        token = BATCH.set(Batch(list(batch.req_ids), batch.num_prompt_tokens_cpu_tensor, _STEP["started"]))
        try:
            return build(self, *args, **kwargs)
        finally:
            BATCH.reset(token)

    build_metadata._kvpolicy = True
    GPUModelRunner._build_attention_metadata, GPUModelRunner._update_states = build_metadata, update_states


def take_finished() -> set[str]:
    """The requests that ended since the last call (the runner learns it a step later)."""
    finished, _STEP["finished"] = _STEP["finished"], set()
    return finished


def take_block_moves() -> tuple[set[int], list[tuple[int, int]]] | None:
    """The blocks handed to requests and vLLM's block copies since the last call (None: neither)."""
    allocated, copies = _STEP["allocated"], _STEP["copies"]
    _STEP["allocated"], _STEP["copies"] = set(), []
    return (allocated, copies) if allocated or copies else None


class CompactBuilder:
    """Mixed in before a vLLM metadata builder: ``class Builder(CompactBuilder, CPUAttentionMetadataBuilder)``. The
    metadata it returns is the stock builder's, with the step's plan as its ``kvpolicy`` attribute (None: a dummy
    run, or no recipe)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.engine = engine_from_config(vllm_config)
        if self.engine.active:
            share_batch()
        # a request's schedule, by request id (dropped when the runner learns that the request ended)
        self.schedules: dict[str, RequestSchedule] = {}
        # and its block table row at its last step: the scheduler frees the blocks a step's eviction empties at the
        # start of that step, so the compaction finds them there, not in the step's table
        self.last_tables: dict[str, list[int]] = {}
        # the decode queries stored for the layers whose policies batch their statistics (`deferred`)
        plan = self.engine.plan if self.engine.active else None
        self.windows = QueryWindows(len(plan.rules)) if plan is not None and plan.defers_statistics else None
        # and whether some layer still observes each decode step (policies that read a step's own attention)
        self.observes_decode = plan is not None and plan.observes_decode_steps
        # with prefix caching, policies that read statistics keep their state every this many prompt tokens, so that
        # a request that finds the prompt's start in the cache starts with the state a full prefill would give it
        caching = getattr(vllm_config.cache_config, "enable_prefix_caching", False)
        self.snapshot_tokens = plan.snapshot_tokens(self.kv_cache_spec.block_size) if caching and plan else 0

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
        if any(starts[row + 1] == starts[row] or int(table[row, 0]) == 0 for row in range(common.num_reqs)):
            return None  # a dummy run (profiling, warm-up): nothing to keep
        batch = BATCH.get()
        if batch is None:  # the scheduler evicts: so must we
            raise KVPolicyError("kvpolicy: this vLLM's model runner built attention metadata outside its "
                                "_build_attention_metadata step, so kvpolicy cannot tell its requests apart; serve "
                                "without kvpolicy or report this vLLM version")
        for ended in take_finished():
            self._forget(ended)
        prompt_tokens = batch.prompt_tokens[: common.num_reqs].tolist()
        requests, adopted = [], []
        for row in range(common.num_reqs):
            count = starts[row + 1] - starts[row]
            key, end = batch.request_ids[row], ends[row]
            start = end - count
            schedule = self.schedules.get(key)
            if key in batch.started or schedule is None:  # new, or resumed after a preemption: it starts over
                self._forget(key)
                schedule = self.schedules[key] = RequestSchedule(plan.rules, plan.slack, block_size,
                                                                 plan.evict_during_prefill, align=plan.align)
                if start:  # its first `start` tokens are a prefix-cache hit, copied into its own blocks
                    adopted.append((table[row], start))
                    if self.snapshot_tokens and start % self.snapshot_tokens:
                        raise KVPolicyError(f"kvpolicy: request {key} starts at a prefix-cache hit of {start} tokens, "
                                            f"not a multiple of {self.snapshot_tokens} (please report this)")
            row_table = table[row].tolist()
            last_table = self.last_tables.get(key, row_table)
            before = [_physical(last_table, schedule.compact(rule, start)) for rule in range(len(plan.rules))]
            decision = schedule.start_step(start, prefilling[row] if prefilling is not None else False,
                                           prompt_tokens[row] if plan.evict_during_prefill else None)
            after = [schedule.compact(rule, end) for rule in range(len(plan.rules))]
            self.last_tables[key] = row_table
            requests.append(_Request(row, key, start, end, schedule, row_table, before, after, decision))
        device = common.block_table_tensor.device
        positions = torch.cat([torch.arange(r.start, r.end) for r in requests]).to(device)
        adopt = _adopt(adopted, block_size, self.snapshot_tokens > 0, device) if adopted else None
        # the statistics: decode steps together (one query each), each prompt chunk alone (long, of any length)
        decoding = [r for r in requests if r.end - r.start == 1]
        prompts = [r for r in requests if r.end - r.start > 1]
        decode_queries = _queries(decoding, starts, device) if self.observes_decode and decoding else None
        prompt_pieces = [self._pieces(r, starts, prompt_tokens[r.row], device) for r in prompts] \
            if plan.needs_statistics else []
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
            # a piece's queries are the last slots of its rows: those up to its end (the pass's causal mask)
            observe_prompts = [(CompactRows.of([(layouts[r.row][0], layouts[r.row][1] - (r.end - end))], block_size,
                                               device), index, positions, snapshot)
                               for r, pieces in zip(prompts, prompt_pieces, strict=False)
                               for index, positions, snapshot, end in pieces]
            stored = self._stored(rule, requests, layouts, starts, device) if self.windows is not None else None
            slots = torch.cat([_slots(layouts[r.row][0], r.after[rule][2], r.start, r.end, block_size)
                               for r in requests]).to(device)
            kernel = super().build(common_prefix_len, _compact(common, requests, layouts, slots), fast_build)
            rules.append(RuleStep(kernel, slots, evict, decode, observe_prompts, stored))
        moves = take_block_moves()  # drained every step, needed only where snapshots are kept
        return StepPlan(rules, positions, adopt, moves if self.snapshot_tokens else None)

    def _pieces(self, r: _Request, starts: list[int], prompt: int, device: torch.device) -> list:
        """A prompt chunk's queries to observe: at once, or, before the request's first eviction, in pieces that
        end at each snapshot boundary it passes (a boundary's state is the full prefill's state there: the sums of
        the queries before it), each with the block and the slots whose state to keep."""
        every, block_size = self.snapshot_tokens, self.kv_cache_spec.block_size
        cuts = []
        if every and all(state.evicted_at is None for state in r.schedule.states):
            cuts = list(range((r.start // every + 1) * every, min(r.end, prompt) + 1, every))
        index, positions = _queries([r], starts, device)  # [1, chunk]: one request, no pads
        pieces, lo = [], r.start
        for hi in [*cuts, r.end]:
            if hi > lo:
                keep = slice(lo - r.start, hi - r.start)
                snapshot = None
                if hi in cuts:
                    position = torch.arange(hi)
                    blocks = torch.tensor(r.table, dtype=torch.long)[position // block_size]
                    snapshot = (r.table[hi // block_size - 1], (blocks * block_size + position % block_size).to(device))
                pieces.append((index[:, keep], positions[:, keep], snapshot, hi))
            lo = hi
        return pieces

    def _forget(self, key: str) -> None:
        self.schedules.pop(key, None)
        self.last_tables.pop(key, None)
        if self.windows is not None:  # nothing it stored counts any more
            self.windows.forget(key)

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



def _adopt(adopted: list[tuple[torch.Tensor, int]], block_size: int, with_state: bool, device: torch.device) -> Adopt:
    """What requests starting at a prefix-cache hit find in their blocks: vLLM copied the tokens' keys and values
    there, not kvpolicy's per-slot positions and state (the state comes from the snapshot kept at the hit's last
    block, which vLLM's copy carried to the request's own block: `PagedLayerCache.move_snapshots`)."""
    slots, positions, states = [], [], []
    for row, start in adopted:
        position = torch.arange(start)
        request_slots = (row[position // block_size].long() * block_size + position % block_size).to(device)
        slots.append(request_slots)
        positions.append(position)
        if with_state:
            states.append((int(row[start // block_size - 1]), request_slots))
    return Adopt(torch.cat(slots), torch.cat(positions).to(device), states)


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
        if step.block_moves is not None:
            cache.move_snapshots(*step.block_moves)
        if step.adopt is not None:  # before an eviction ranks them
            cache.write_metadata(step.adopt.slots, step.adopt.positions)
            for block, slots in step.adopt.states:
                cache.restore_snapshot(block, slots)
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
        for rows, query_index, query_positions, snapshot in todo.prompts:
            policies.observe(cache, rows, query, query_index, query_positions, self.scale)
            if snapshot is not None:
                cache.save_snapshot(*snapshot)
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
    return KVPolicySpec.from_spec(spec, **engine.plan.scheduler_view(spec.block_size))

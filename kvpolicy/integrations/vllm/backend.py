"""The worker side: vLLM's CPU attention backend, subclassed so that kvpolicy's policies run in it.

Without a ``kvpolicy`` entry in vLLM's ``additional_config`` every method defers to the stock backend. With one,
the layers keep their K/V in the same cache tensor vLLM allocated (keys in the first half of each slot, values
in the second, one row per token: ``[blocks, kv_heads, block_size, head_dim]`` each), and per step:

- the metadata builder runs the request schedule (`schedule.RequestSchedule`, the same rule as the scheduler's
  manager), and lists for each layer budget which requests evict now and which blocks each request reads;
- each layer evicts (its policies score the tokens; each KV head's best move into the arena), writes the step's
  new tokens, and attends with kvpolicy's backend, which returns the statistics its policies then observe.
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ...cache.policy_group import LayerPolicies
from ...errors import KVPolicyError
from .engine import engine_from_config, process_engine
from .paged import PagedLayerCache, PagedPolicies, RowBlocks
from .schedule import RequestSchedule
from .settings import PagedLayer
from .spec import KVPolicySpec

logger = init_logger("vllm.kvpolicy")


@dataclass
class RuleStep:
    """What the layers of one budget rule do in one step."""

    evict: tuple[RowBlocks, torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, budget, seen, arena blocks
    attend: list[tuple[RowBlocks, torch.Tensor, torch.Tensor]]  # rows, query index, query positions


@dataclass
class StepPlan:
    rules: list[RuleStep]
    positions: torch.Tensor  # [N] position of each new token


@dataclass
class KVPolicyMetadata(CPUAttentionMetadata):
    kvpolicy: StepPlan | None = None


class KVPolicyCPUBackend(CPUAttentionBackend):
    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        engine = process_engine()
        if engine is None or not engine.active:
            return spec
        if type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
            raise KVPolicyError(f"kvpolicy: the vLLM integration runs models whose layers are all full attention; "
                                f"this one has a {type(spec).__name__} layer: serve it without kvpolicy")
        plan = engine.plan
        return KVPolicySpec.from_spec(spec, plan.rules, plan.slack, plan.evict_during_prefill, plan.step_tokens)

    @staticmethod
    def get_impl_cls() -> type[KVPolicyImpl]:
        return KVPolicyImpl

    @staticmethod
    def get_builder_cls() -> type[KVPolicyMetadataBuilder]:
        return KVPolicyMetadataBuilder


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


class KVPolicyMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.engine = engine_from_config(vllm_config)
        if self.engine.active and self.engine.plan.evict_during_prefill:
            share_prompt_lengths()
        # a request's schedule, by the physical id of its first block (the arena's: held until the request ends)
        self.schedules: dict[int, RequestSchedule] = {}

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if not self.engine.active:
            return metadata
        return KVPolicyMetadata(**metadata.__dict__, kvpolicy=self._plan_step(common_attn_metadata))

    def _plan_step(self, common) -> StepPlan | None:
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
            before = [self._rows_for(schedule, rule, start) for rule in range(len(plan.rules))]
            decision = schedule.start_step(start, prefilling[row] if prefilling is not None else False,
                                           prompt_tokens[row] if prompt_tokens is not None else None)
            requests.append((row, start, end, schedule, before, decision))
        positions = torch.cat([torch.arange(start, end) for _, start, end, *_ in requests])
        # decode steps together (one query each); each prompt chunk alone, unpadded (long, of any length)
        decoding = [r for r in requests if r[2] - r[1] == 1]
        groups = ([decoding] if decoding else []) + [[r] for r in requests if r[2] - r[1] > 1]
        queries = [self._queries(group, starts) for group in groups]
        rules = []
        for rule in range(len(plan.rules)):
            evicting = [r for r in requests if r[5][rule]]
            evict = None
            if evicting:
                rows = RowBlocks.of([self._physical(table, r[0], r[4][rule]) for r in evicting], block_size)
                budget = torch.tensor([r[3].states[rule].budget for r in evicting], dtype=torch.long)
                seen = torch.tensor([r[1] for r in evicting], dtype=torch.long)
                arena = torch.tensor([r[3].arena(rule) for r in evicting], dtype=torch.long)
                evict = (rows, budget, seen, arena)
            attend = []
            for group, (query_index, query_positions) in zip(groups, queries, strict=True):
                rows = RowBlocks.of([self._physical(table, r[0], self._rows_for(r[3], rule, r[2])) for r in group],
                                    block_size)
                attend.append((rows, query_index, query_positions))
            rules.append(RuleStep(evict, attend))
        return StepPlan(rules, positions)

    @staticmethod
    def _prompt_tokens(rows: int) -> list[int] | None:
        shared = PROMPT_TOKENS.get()
        if shared is None:  # a dummy run (profiling, warm-up) outside the runner's metadata step; real steps have it
            return None
        return shared[:rows].tolist()

    @staticmethod
    def _rows_for(schedule: RequestSchedule, rule: int, end: int) -> tuple[list[int], int, int, int]:
        logical, first = schedule.live_blocks(rule, end)
        evicted = schedule.states[rule].evicted_at is not None
        return logical, schedule.arena(rule) if evicted else 0, first, end

    @staticmethod
    def _physical(table: torch.Tensor, row: int, rows: tuple[list[int], int, int, int]):
        logical, arena, first, end = rows
        return table[row, logical].tolist(), logical, arena, first, end

    @staticmethod
    def _queries(group: list, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's new tokens, right-aligned (left pads: -1), and their positions."""
        width = max(r[2] - r[1] for r in group)
        index = torch.full((len(group), width), -1, dtype=torch.long)
        positions = torch.full((len(group), width), -1, dtype=torch.long)
        for i, (row, start, end, *_) in enumerate(group):
            count = end - start
            index[i, width - count:] = torch.arange(starts[row], starts[row] + count)
            positions[i, width - count:] = torch.arange(start, end)
        return index, positions


class KVPolicyImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from vllm.config import get_current_vllm_config

        self.engine = engine_from_config(get_current_vllm_config())
        self.caches: dict[str, PagedLayerCache] = {}
        # per attention module: its decoder layer's plan and policies (looked up by name once, not every step)
        self.layers: dict[str, tuple[PagedLayer, PagedPolicies]] = {}

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if not self.engine.active:
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        # else: forward writes the step's tokens, after this layer's evictions have made room

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if not self.engine.active:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        step = getattr(attn_metadata, "kvpolicy", None)
        if step is None:  # warm-up and profiling runs: no request, nothing kept
            return output
        name = layer.layer_name
        if name not in self.layers:
            paged_layer = self.engine.layer(name)
            self.layers[name] = paged_layer, PagedPolicies(paged_layer.policies)
        paged_layer, policies = self.layers[name]
        cache = self._cache(name, kv_cache, paged_layer.policies)
        todo = step.rules[paged_layer.rule]
        if todo.evict is not None:
            rows, budget, seen, arena = todo.evict
            policies.evict(cache, rows, budget, seen, arena)
        count = attn_metadata.num_actual_tokens
        cache.write(key[:count], value[:count], attn_metadata.slot_mapping[:count], step.positions)
        for rows, query_index, query_positions in todo.attend:
            result = policies.attend(cache, rows, query, query_index, query_positions, self.scale)
            real = query_index >= 0
            output[query_index[real]] = result[real].to(output.dtype)
        return output

    def _cache(self, name: str, kv_cache: torch.Tensor, policies: LayerPolicies) -> PagedLayerCache:
        cache = self.caches.get(name)
        if cache is None or cache.keys.data_ptr() != kv_cache.data_ptr():
            dim = self.head_size
            cache = self.caches[name] = PagedLayerCache.over(kv_cache[..., :dim], kv_cache[..., dim:], policies)
            logger.debug("kvpolicy: layer %s keeps %d metadata bytes per block beside its K/V", name,
                         cache.metadata_bytes_per_block())
        return cache

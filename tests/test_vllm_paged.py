"""The vLLM integration's pure parts (no vLLM): settings, the eviction schedule, and the paged cache against
kvpolicy's own dense layer (`PolicyLayer`) driven with the same tokens.

The paged side is driven the way vLLM drives it: blocks allocated as a request grows, the blocks the scheduler's
schedule says are empty returned to a pool one step later (and handed to the other request), every request of the
batch in one call, and the outputs computed the way vLLM's kernel computes them: from a block table and a length
per request (`engine_kernel`), over the compact layout kvpolicy keeps. Both sides must give the same attention
output at every step and keep the same positions in every KV head.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from kvpolicy.backend.dispatch import attend
from kvpolicy.cache.layer import PolicyLayer
from kvpolicy.cache.policy_group import LayerPolicies, make_policies
from kvpolicy.errors import KVPolicyError
from kvpolicy.integrations.vllm.compact_rows import CompactRows
from kvpolicy.integrations.vllm.deferred import QueryWindows, stored_observation
from kvpolicy.integrations.vllm.engine import rank_heads
from kvpolicy.integrations.vllm.paged import PagedLayerCache, PagedPolicies, cpu_cache_views
from kvpolicy.integrations.vllm.schedule import RequestSchedule, decoding_blocks, most_blocks
from kvpolicy.integrations.vllm.settings import Settings, paged_plan, read_settings
from kvpolicy.recipe import load_recipe
from kvpolicy.recipe.budget import Budget
from kvpolicy.registry import get_registry

HKV, GROUPS, DIM, BLOCK = 2, 2, 8, 4


def recipe(policy: str, budget: dict, slack: int, params: dict | None = None) -> dict:
    """Evictions aligned to blocks, as the vLLM integration makes them (`PagedPlan.align`)."""
    return {"kvpolicy": 1, "name": policy, "policy": policy, "params": params or {},
            "budget": {**budget, "slack": slack, "align": BLOCK}}


def dense_layer(spec: dict) -> PolicyLayer:
    plan = load_recipe(spec).resolve(1, HKV)
    policies = make_policies([plan], get_registry())
    return PolicyLayer(0, [plan.layers[0]], LayerPolicies.of_rows([plan.layers[0]], policies))


def engine_kernel(cache: PagedLayerCache, blocks: list[int], length: int, query: torch.Tensor, scale: float
                  ) -> torch.Tensor:
    """What vLLM's paged kernel computes for one request: the queries ``query`` [q, Hq, D] are its last ``length``
    slots' tokens, read through its block table from slot 0 on, causal; no mask besides. [q, Hq, D]"""
    index = torch.arange(length)
    block = torch.tensor(blocks)[index // BLOCK]
    keys = cache.keys[block, :, index % BLOCK].float().transpose(0, 1)[None]  # [1, Hkv, L, D]
    values = cache.values[block, :, index % BLOCK].float().transpose(0, 1)[None]
    count = query.shape[0]
    visible = torch.arange(length)[None] <= torch.arange(length - count, length)[:, None]
    out = F.scaled_dot_product_attention(query.float().transpose(0, 1)[None], keys, values, attn_mask=visible,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


class PagedRequest:
    """One request as vLLM's scheduler and worker see it, over a shared pool of blocks."""

    def __init__(self, pool: list[int], rules, slack: int, prompt: int, align: int = 0):
        self.pool, self.blocks, self.prompt, self.done = pool, [], prompt, 0
        self.manager_view = RequestSchedule(rules, slack, BLOCK, align=align)  # the scheduler's copy
        self.worker_view = RequestSchedule(rules, slack, BLOCK, align=align)  # the worker's copy
        self.last_blocks: list[int | None] = []  # the block table the worker saw at the last step

    def schedule(self, count: int) -> None:
        """What vLLM's manager does before a step of ``count`` tokens: decide, free what the step's eviction
        empties (into the pool, where the other request may take it in the same step), then allocate."""
        self.last_blocks = list(self.blocks)
        self.manager_view.start_step(self.done, prefilling=self.done < self.prompt)
        lo, hi = self.manager_view.empty_blocks()
        for logical in range(lo, min(hi, len(self.blocks))):
            if self.blocks[logical] is not None:
                self.pool.append(self.blocks[logical])
                self.blocks[logical] = None
        while len(self.blocks) < math.ceil((self.done + count) / BLOCK):
            self.blocks.append(self.pool.pop(0))

    def rows(self, end: int, table: list[int | None] | None = None) -> tuple[list[int], int]:
        """(physical blocks, length) of the compact layout with ``end`` tokens in, from ``table`` (default: this
        step's block table); a freed block there fails."""
        logical, length, _ = self.worker_view.compact(0, end)
        table = self.blocks if table is None else table
        physical = [table[i] for i in logical]
        assert None not in physical, f"the layout reads a freed block: {logical} over {table}"
        return physical, length

    def slots(self, count: int) -> torch.Tensor:
        """Where the step's ``count`` tokens go: slot ``position - shift`` of the compact layout."""
        physical, _ = self.rows(self.done + count)
        shift = self.worker_view.compact(0, self.done + count)[2]
        index = torch.arange(self.done, self.done + count) - shift
        return torch.tensor(physical)[index // BLOCK] * BLOCK + index % BLOCK


def run_both(spec: dict, steps: list[list[int]], seed: int = 0, dtype: torch.dtype = torch.float32,
             backend: str = "torch", deferred: bool = False):
    """``steps``: tokens per request per step (0: the request sits the step out). Returns the largest difference
    between the two sides' attention outputs over every step (the paged cache and queries in ``dtype``, as vLLM
    serves them; the dense reference in fp32). ``deferred``: the paged side stores decode queries and observes them
    when the builder's `QueryWindows` says (before an eviction, or a full window), as deferring layers do."""
    torch.manual_seed(seed)
    requests = len(steps[0])
    prompts = [steps[0][r] for r in range(requests)]
    dense = [dense_layer(spec) for _ in range(requests)]
    plan = paged_plan(Settings(recipe=spec, slack=spec["budget"]["slack"]), 1, HKV, BLOCK)
    layer = plan.layers[0]
    policies = PagedPolicies(layer.policies, backend=backend)
    total_blocks = 64
    kv = torch.zeros(total_blocks, HKV, BLOCK, 2 * DIM, dtype=dtype)
    cache = PagedLayerCache.over(*cpu_cache_views(kv), layer.policies)
    pool = list(range(1, total_blocks))  # block 0 is vLLM's null block
    paged = [PagedRequest(pool, plan.rules, plan.slack, prompts[r], plan.align) for r in range(requests)]
    windows = QueryWindows(1, window=5) if deferred else None
    assert not deferred or policies.defers
    worst = 0.0
    for counts in steps:
        active = [r for r in range(requests) if counts[r]]
        for r in active:
            paged[r].schedule(counts[r])
        keys = {r: torch.randn(1, HKV, counts[r], DIM) for r in active}
        values = {r: torch.randn(1, HKV, counts[r], DIM) for r in active}
        queries = {r: torch.randn(1, HKV * GROUPS, counts[r], DIM) for r in active}
        # the worker: evictions first, then the new tokens, then the kernel and the statistics for the whole batch
        evicting, befores = [], {}
        for r in active:
            request = paged[r]
            befores[r] = request.rows(request.done, request.last_blocks)  # as the worker remembers them
            if request.worker_view.start_step(request.done, prefilling=request.done < request.prompt)[0]:
                evicting.append(r)
        stored = None
        if windows is not None:
            stored = windows.plan(0, [(r, paged[r].done, paged[r].done + counts[r], r in evicting) for r in active])
            before = stored_observation([(befores[active[i]], flush) for i, flush in stored.before], BLOCK, "cpu")
            if before is not None:
                policies.observe(cache, before[0], cache.stored_queries(), *before[1:], 0.3)
        if evicting:
            rows = CompactRows.of([befores[r] for r in evicting], BLOCK)
            policies.evict(cache, rows, torch.tensor([paged[r].worker_view.states[0].budget for r in evicting]),
                           torch.tensor([paged[r].done for r in evicting]))
        for r in active:
            request = paged[r]
            cache.write(keys[r][0].transpose(0, 1), values[r][0].transpose(0, 1), request.slots(counts[r]),
                        torch.arange(request.done, request.done + counts[r]))
        flat_query = torch.cat([queries[r][0].transpose(0, 1) for r in active]).to(dtype)
        starts = dict(zip(active, torch.tensor([0] + [counts[r] for r in active]).cumsum(0).tolist(), strict=False))
        outputs = {r: engine_kernel(cache, *paged[r].rows(paged[r].done + counts[r]),
                                    flat_query[starts[r]:starts[r] + counts[r]], 0.3) for r in active}
        # the statistics as the worker asks for them: the decode steps in one call (or stored), each prompt chunk alone
        decoding = [r for r in active if counts[r] == 1]
        if stored is not None:
            if stored.stores:
                cache.store_queries(flat_query[[starts[active[i]] for i, _ in stored.stores]],
                                    torch.tensor([entry for _, entry in stored.stores]), windows.capacity * 5)
            after = stored_observation([(paged[active[i]].rows(paged[active[i]].done + 1), flush)
                                        for i, flush in stored.after], BLOCK, "cpu")
            if after is not None:
                policies.observe(cache, after[0], cache.stored_queries(), *after[1:], 0.3)
            decoding = []
        for group in ([decoding] if decoding else []) + [[r] for r in active if counts[r] > 1]:
            width = max(counts[r] for r in group)
            index = torch.full((len(group), width), -1)
            query_positions = torch.full((len(group), width), -1)
            for i, r in enumerate(group):
                index[i, width - counts[r]:] = torch.arange(starts[r], starts[r] + counts[r])
                query_positions[i, width - counts[r]:] = torch.arange(paged[r].done, paged[r].done + counts[r])
            rows = CompactRows.of([paged[r].rows(paged[r].done + counts[r]) for r in group], BLOCK)
            policies.observe(cache, rows, flat_query, index, query_positions, 0.3)
        for r in active:
            layer_ref = dense[r]
            layer_ref.append(keys[r], values[r])
            call = layer_ref.begin_call(None, 0.3)
            result = attend(queries[r], call)
            layer_ref.end_call(result.stats)
            worst = max(worst, (outputs[r] - result.output[0].float()).abs().max().item())
            paged[r].done += counts[r]
    return worst


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_a_bf16_cache_attends_as_fp32_does(policy):
    # one request alone, before and after its evictions, and two together; bf16 K/V and queries as vLLM serves
    # them, so only their rounding separates the two sides
    steps = [[9, 0], *[[1, 0]] * 8, [0, 12], *DECODE[:10]]
    assert run_both(recipe(policy, {"tokens": 10}, slack=3), steps, dtype=torch.bfloat16) < 0.05


def kept_positions_paged(cache, rows: CompactRows) -> list[list[int]]:
    positions = rows.gather(cache.positions)[0, :, : int(rows.lengths[0])]
    return [sorted(positions[h].tolist()) for h in range(HKV)]


DECODE = [[1, 1]] * 40


@pytest.mark.parametrize("policy,params", [
    ("h2o", {"recent_ratio": 0.5}), ("streaming", {"sinks": 2}), ("window", {}), ("tova", {}),
    ("scissorhands", {}), ("roco", {}), ("snapkv", {"window": 3}),
    ("lazy", {"window": 6}),  # its lag (5) above the recipe's slack: an eviction every 6 tokens
])
def test_paged_matches_dense_layer_step_by_step(policy, params):
    # two requests of different prompt lengths, one prefilled in two chunks, decoding together
    steps = [[9, 0], [7, 13], *DECODE]
    worst = run_both(recipe(policy, {"tokens": 10}, slack=3, params=params), steps)
    assert worst < 1e-5


@pytest.mark.parametrize("policy,params", [("h2o", {"recent_ratio": 0.5}), ("tova", {})])
def test_the_triton_score_pass_reads_the_blocks_in_place_as_the_torch_path_does(policy, params, monkeypatch):
    """backend triton (the interpreter here): decode steps score by `triton_paged` over the blocks where they lie,
    and evictions move the K/V there (`move_slots`); the evictions the statistics drive keep the outputs on the
    dense layer's, step by step."""
    import kvpolicy.backend.triton_paged as triton_paged

    calls = {"paged_column_sums": 0, "move_slots": 0}
    for name in calls:
        original = getattr(triton_paged, name)
        monkeypatch.setattr(triton_paged, name, lambda *a, _f=original, _n=name, **kw: (
            calls.__setitem__(_n, calls[_n] + 1), _f(*a, **kw))[1])
    steps = [[9, 0], [7, 13], *DECODE[:14]]
    assert run_both(recipe(policy, {"tokens": 10}, slack=3, params=params), steps, backend="triton") < 1e-5
    assert calls["paged_column_sums"] >= 14 and calls["move_slots"] >= 3


@pytest.mark.parametrize("policy,params,budget", [
    ("h2o", {"recent_ratio": 0.3}, {"tokens": 10}), ("roco", {}, {"tokens": 10}),
    ("h2o", {"accumulate": "mean"}, {"tokens": 12}),
])
def test_decode_statistics_stored_and_read_before_each_eviction_keep_what_each_step_would(policy, params, budget):
    """Additive policies' layers store each decode query and read them in one pass right before the request evicts,
    or when 5 are stored (`QueryWindows`): the same evictions as observing every step, so the same outputs as the
    dense layer's. Three requests: prompts of different lengths (one in two chunks), one sitting steps out, and
    slack 7 (two windows fill between evictions)."""
    steps = [[9, 0, 5], [7, 13, 1], *[[1, 1, 1]] * 12, *[[1, 0, 1]] * 6, *[[1, 1, 1]] * 30]
    assert run_both(recipe(policy, budget, slack=7, params=params), steps, deferred=True) < 1e-5


@pytest.mark.parametrize("policy,deferred", [("h2o", True), ("tova", False)])
def test_a_batch_scored_in_parts_scores_as_one(policy, deferred, monkeypatch):
    """A batch whose keys and logits would not fit `score_pass.PART_ELEMENTS` is scored a few rows at a time (here:
    one)."""
    from kvpolicy.integrations.vllm import score_pass

    monkeypatch.setattr(score_pass, "PART_ELEMENTS", 1)
    steps = [[9, 0, 5], [7, 13, 1], *[[1, 1, 1]] * 24]
    assert run_both(recipe(policy, {"tokens": 10}, slack=7), steps, deferred=deferred) < 1e-5


def test_only_additive_policies_defer():
    def layer_policies(policy: str, params: dict | None = None):
        plan = paged_plan(Settings(recipe=recipe(policy, {"tokens": 10}, slack=3, params=params)), 1, HKV, BLOCK)
        return PagedPolicies(plan.layers[0].policies)

    assert layer_policies("h2o").defers and layer_policies("roco").defers
    assert not layer_policies("h2o", {"decay": 0.9}).defers  # a decay weighs a chunk's queries differently
    assert not layer_policies("tova").defers and not layer_policies("scissorhands").defers
    assert not layer_policies("streaming").defers  # no statistics at all


def test_query_windows_forget_ended_requests_and_reuse_their_rows():
    windows = QueryWindows(2, window=3)
    assert windows.plan(0, [("a", 5, 6, False), ("b", 8, 9, False)]).stores == [(0, 0), (1, 3)]
    windows.plan(1, [("a", 5, 6, False), ("b", 8, 9, False)])
    plan = windows.plan(0, [("a", 6, 7, True), ("b", 9, 10, False)])  # a evicts: its stored query is read first
    assert [(i, f.entries, f.end) for i, f in plan.before] == [(0, [0], 6)] and plan.stores == [(0, 0), (1, 4)]
    plan = windows.plan(0, [("b", 10, 11, False)])  # b's window of 3 fills: read after the step; a sits it out
    assert [(i, f.entries, f.end) for i, f in plan.after] == [(0, [3, 4, 5], 11)]
    assert windows.pending("b", 1) == 1 and windows.pending("a", 0) == 1  # rule 1 counts apart
    windows.forget("a")  # the runner says a ended
    assert windows.pending("a", 0) == 0 and windows.free == [0] and windows.pending("b", 1) == 1
    assert windows.plan(0, [("c", 0, 1, False)]).stores == [(0, 0)]  # a new request takes the freed row
    assert windows.capacity == 2


@pytest.mark.parametrize("slack", [0, 1, BLOCK - 1, 2 * BLOCK + 1])
def test_ratio_budgets_and_any_slack(slack):
    # a ratio budget resolves from the prompt once it is in (one pass each here, as the dense layer resolves it)
    steps = [[23, 18], *DECODE]
    assert run_both(recipe("h2o", {"ratio": 0.4}, slack=slack), steps, seed=slack) < 1e-5


def test_paged_and_dense_keep_the_same_tokens():
    spec = recipe("h2o", {"tokens": 8}, slack=BLOCK - 1)
    torch.manual_seed(3)
    plan = paged_plan(Settings(recipe=spec, slack=BLOCK - 1), 1, HKV, BLOCK)
    policies = PagedPolicies(plan.layers[0].policies)
    cache = PagedLayerCache.over(*cpu_cache_views(torch.zeros(16, HKV, BLOCK, 2 * DIM)), plan.layers[0].policies)
    dense = dense_layer(spec)
    pool = list(range(1, 16))
    request = PagedRequest(pool, plan.rules, plan.slack, prompt=11)
    evictions = 0
    for count in [11] + [1] * 20:
        request.schedule(count)
        before = request.rows(request.done, request.last_blocks)
        if request.worker_view.start_step(request.done, prefilling=False)[0]:
            evictions += 1
            policies.evict(cache, CompactRows.of([before], BLOCK), torch.tensor([8]), torch.tensor([request.done]))
            # the kept tokens fill the first `budget` slots, hole-free, and are the dense layer's
            assert request.rows(request.done)[1] == 8
            assert kept_positions_paged(cache, CompactRows.of([request.rows(request.done)], BLOCK)) == \
                dense.kept_positions()[0]
        keys, values = torch.randn(1, HKV, count, DIM), torch.randn(1, HKV, count, DIM)
        cache.write(keys[0].transpose(0, 1), values[0].transpose(0, 1), request.slots(count),
                    torch.arange(request.done, request.done + count))
        query = torch.randn(1, HKV * GROUPS, count, DIM)
        policies.observe(cache, CompactRows.of([request.rows(request.done + count)], BLOCK),
                         query[0].transpose(0, 1), torch.arange(count)[None],
                         torch.arange(request.done, request.done + count)[None], 0.3)
        dense.append(keys, values)
        dense.end_call(attend(query, dense.begin_call(None, 0.3)).stats)
        request.done += count
    assert evictions >= 3


def test_the_cpu_cache_views_and_compact_rows_gather_and_scatter():
    # vLLM's CPU cache holds each (block, KV head) as its keys transposed ([D, bs]) and then its values ([bs, D])
    kv = torch.arange(3 * HKV * BLOCK * 2 * DIM, dtype=torch.float32).view(3, HKV, BLOCK, 2 * DIM)
    keys, values = cpu_cache_views(kv)
    flat = kv.view(3, HKV, -1)
    assert torch.equal(keys[1, 0, 2], flat[1, 0, torch.arange(DIM) * BLOCK + 2])
    assert torch.equal(values[2, 1, 3], flat[2, 1, BLOCK * DIM + 3 * DIM + torch.arange(DIM)])
    # rows read blocks in table order up to their length; scatter writes back only what was gathered
    tensor = torch.randn(12, HKV, BLOCK)
    rows = CompactRows.of([([3, 7, 1], 2 * BLOCK + 1), ([5], 3)], BLOCK)
    gathered = rows.gather(tensor)
    assert gathered.shape == (2, HKV, 2 * BLOCK + 1)
    assert torch.equal(gathered[0, :, BLOCK:2 * BLOCK], tensor[7]) and torch.equal(gathered[0, :, -1], tensor[1, :, 0])
    assert torch.equal(gathered[1, :, :3], tensor[5, :, :3])
    before = tensor.clone()
    rows.scatter(tensor, gathered + 1)
    assert torch.equal(tensor[7], before[7] + 1) and torch.equal(tensor[1, :, 1:], before[1, :, 1:])
    assert torch.equal(tensor[5, :, :3], before[5, :, :3] + 1)


def test_the_compact_layout_reads_only_blocks_vllm_holds():
    """Position p's slot in the compact layout lies in a block no later than p's own (vLLM allocated it) and never
    in a block the scheduler freed; the layout has no holes: the length is the budget plus the tokens since."""
    schedule = RequestSchedule((Budget(tokens=45),), slack=BLOCK - 1, block_size=BLOCK)
    freed: set[int] = set()
    evictions = 0
    for start, end in [(0, 100), *((s, s + 1) for s in range(100, 400))]:
        lo, hi = schedule.empty_blocks()
        freed |= set(range(lo, hi))
        evictions += schedule.start_step(start, prefilling=False)[0]
        blocks, length, shift = schedule.compact(0, end)
        assert not freed & set(blocks) and len(blocks) == math.ceil(length / BLOCK)
        for position in range(max(0, end - 5), end):
            slot = position - shift
            assert blocks[slot // BLOCK] <= position // BLOCK
        if schedule.states[0].evicted_at is not None:
            assert length == 45 + end - schedule.states[0].evicted_at
    assert evictions > 5 and len(freed) > 5


def test_schedule_frees_whole_blocks_and_holds_the_budget():
    rule = Budget(ratio=0.2)
    schedule = RequestSchedule((rule,), slack=31, block_size=32)
    prompt = 1500
    schedule.start_step(0, prefilling=True)
    schedule.start_step(prompt, prefilling=False)
    budget = schedule.states[0].budget
    assert budget == math.ceil(prompt * 0.2) and schedule.arena(0) == math.ceil(budget / 32)
    held_blocks = []
    for done in range(prompt + 1, prompt + 300):
        lo, hi = schedule.empty_blocks()
        schedule.start_step(done, prefilling=False)
        held = schedule.arena(0) + (math.ceil(done / 32) - max(hi, schedule.arena(0)))
        held_blocks.append(held)
        assert schedule.states[0].held <= budget + 31
    # steady state: the arena plus the block being filled and the one emptied a step ago
    assert max(held_blocks[64:]) <= schedule.arena(0) + 2


def test_schedule_waits_for_the_prompt_and_answers_a_repeated_start_alike():
    schedule = RequestSchedule((Budget(ratio=0.5), Budget(tokens=8)), slack=0, block_size=4)
    assert schedule.start_step(0, prefilling=True) == (False, False)
    assert schedule.start_step(12, prefilling=True) == (False, True)  # tokens known; the ratio waits
    assert schedule.start_step(12, prefilling=True) == (False, True)
    assert schedule.start_step(20, prefilling=False) == (True, True)
    assert schedule.states[0].budget == 10
    with pytest.raises(ValueError, match="go forward"):
        schedule.start_step(5, prefilling=False)


def test_evicting_during_prefill_resolves_a_ratio_from_the_prompt_length_and_evicts_between_chunks():
    whole = RequestSchedule((Budget(ratio=0.2),), slack=31, block_size=32)
    during = RequestSchedule((Budget(ratio=0.2),), slack=31, block_size=32, evict_during_prefill=True)
    prompt, chunk = 1000, 128
    decisions = {"whole": [], "during": []}
    for start in range(0, prompt, chunk):
        decisions["whole"].append(whole.start_step(start, prefilling=True, prompt_tokens=prompt)[0])
        decisions["during"].append(during.start_step(start, prefilling=True, prompt_tokens=prompt)[0])
        assert during.states[0].held <= 200 + 31 + chunk
    assert not any(decisions["whole"]) and whole.states[0].budget is None  # waits for the whole prompt
    assert during.states[0].budget == 200
    # held 256 > 200 + 31 at the third chunk's start: back to 200; then at every chunk (200 + 128 > 231)
    assert decisions["during"] == [False, False, True, True, True, True, True, True]
    assert whole.start_step(prompt, prefilling=False) == (True,) and whole.states[0].budget == 200
    lo, hi = during.empty_blocks()
    assert (lo, hi) == (during.arena(0), 896 // 32)  # the blocks the last eviction emptied, freed a step later


def most_held(schedule: RequestSchedule, prompt: int, total: int, chunks: list[int], block: int) -> tuple[int, int]:
    """The most blocks a request holds, fed ``chunks`` of its prompt and then a token a step up to ``total``, the
    manager freeing what each step's eviction empties at that step's start (`KVPolicyManager.remove_skipped_blocks`);
    and the most once its prompt is in."""
    freed, most, decoding, done, chunks = set(), 0, 0, 0, iter(chunks)
    while done < total:
        count = min(next(chunks, prompt), prompt - done) if done < prompt else 1
        schedule.start_step(done, prefilling=done < prompt, prompt_tokens=prompt)
        lo, hi = schedule.empty_blocks()
        freed |= set(range(lo, hi))
        allocated = -(-(done + count) // block)  # the logical blocks this step's tokens need
        most = max(most, len(set(range(allocated)) - freed))
        if done >= prompt:
            decoding = max(decoding, len(set(range(allocated)) - freed))
        done += count
    return most, decoding


@pytest.mark.parametrize("align", [0, 32])
@pytest.mark.parametrize("prompt,chunk,rules,during_prefill", [
    (1500, 256, (Budget(ratio=0.2),), True), (1001, 128, (Budget(ratio=0.2),), True),
    (760, 512, (Budget(ratio=0.1),), True), (2000, 96, (Budget(ratio=0.3), Budget(tokens=64)), True),
    (1500, 512, (Budget(ratio=0.2),), False), (900, 100, (Budget(tokens=128),), False),
    (1200, 300, (Budget(ratio=0.2), Budget(tokens=96)), False), (150, 64, (Budget(ratio=0.5),), False),
])
def test_most_blocks_bounds_what_a_request_holds_whatever_the_chunking(prompt, chunk, rules, during_prefill, align):
    """A request is admitted when `most_blocks` are free beside what the running requests may still take, so that
    vLLM never preempts one: whatever chunks vLLM cuts a prompt into (at most ``chunk`` tokens, fewer when other
    requests share the step), the request must never hold more; and the bound must not be loose, or fewer
    requests run at once than could. With evictions aligned to blocks (``align``, vLLM's default), a decoding
    request holds a block less."""
    block, slack, new = 32, 31, 200
    bound = most_blocks(rules, slack, block, prompt, prompt + new, chunk, during_prefill, align)
    rng = random.Random(prompt)
    most = decoding = 0
    for trial in range(12):
        chunks = [chunk] * (prompt // chunk + 1) if trial == 0 else [rng.randint(1, chunk) for _ in range(prompt)]
        schedule = RequestSchedule(rules, slack, block, evict_during_prefill=during_prefill, align=align)
        held = most_held(schedule, prompt, prompt + new, chunks, block)
        most, decoding = max(most, held[0]), max(decoding, held[1])
    assert most <= bound < most + 6, (most, bound)
    # what the manager reserves for a request once its prompt is in
    # ... which is tight: a decoding request fills every block it can touch (the 200 new tokens pass many
    # evictions; unaligned, one of them straddles a block boundary)
    assert decoding_blocks(rules, slack, block, prompt, prompt + new, align) == decoding
    if align:
        assert decoding == decoding_blocks(rules, slack, block, prompt, prompt + new, 0) - 1
    if during_prefill and 4 * chunk < prompt:  # below the whole prompt's blocks, which vLLM would wait for
        assert bound < -(-prompt // block) * 0.7
    assert most_blocks(rules, slack, block, prompt, prompt + 10, chunk, during_prefill, align) <= -(-(prompt + 10) // block)



def test_most_blocks_holds_for_random_sizes_slacks_and_rules():
    """The bound the admission relies on, over block sizes, slacks (0 included), one to three rules of tokens and
    ratios, chunkings vLLM could cut, evictions aligned to blocks or not: a request past its bound is one vLLM may
    have to preempt."""
    rng = random.Random(7)
    for _ in range(600):
        block, slack = rng.choice([8, 16, 32]), rng.choice([0, 1, 7, 31, 63, 100])
        align = rng.choice([0, block])
        prompt, new, chunk = rng.randint(20, 1200), rng.randint(1, 200), rng.randint(1, 512)
        rules = tuple(Budget(ratio=rng.choice([0.1, 0.2, 0.5])) if rng.random() < 0.5
                      else Budget(tokens=rng.randint(8, 400)) for _ in range(rng.randint(1, 3)))
        during = rng.random() < 0.5
        chunks = ([chunk] * (prompt // chunk + 1) if rng.random() < 0.5
                  else [rng.randint(1, chunk) for _ in range(prompt)])
        schedule = RequestSchedule(rules, slack, block, evict_during_prefill=during, align=align)
        most, decoding = most_held(schedule, prompt, prompt + new, chunks, block)
        case = (block, slack, prompt, new, chunk, rules, during, align)
        assert most <= most_blocks(rules, slack, block, prompt, prompt + new, chunk, during, align), case
        assert decoding <= decoding_blocks(rules, slack, block, prompt, prompt + new, align), case

# --- settings: what a user writes, and what a paged engine refuses -------------------------------------------


def test_settings_read_the_users_entry():
    assert read_settings({}) is None
    assert read_settings({"other": 1}) is None
    assert read_settings({"kvpolicy": "h2o"}) == Settings(recipe="h2o")
    assert read_settings({"kvpolicy": {"recipe": "h2o", "budget": 0.1, "slack": 0}}) == Settings("h2o", 0.1, 0)
    assert read_settings({"kvpolicy": {"recipe": "h2o", "evict_during_prefill": True}}).evict_during_prefill
    for bad, words in [
        ({"kvpolicy": 3}, "must be a mapping"),
        ({"kvpolicy": {"recipe": "h2o", "budgte": 0.2}}, "unknown key 'budgte'"),
        ({"kvpolicy": {"recipe": 7}}, "\\['recipe'\\]"),
        ({"kvpolicy": {"recipe": "h2o", "budget": 1.5}}, "\\['budget'\\]"),
        ({"kvpolicy": {"recipe": "h2o", "budget": True}}, "\\['budget'\\]"),
        ({"kvpolicy": {"recipe": "h2o", "slack": -1}}, "\\['slack'\\]"),
        ({"kvpolicy": {"recipe": "h2o", "evict_during_prefill": "yes"}}, "\\['evict_during_prefill'\\]"),
        ({"kvpolicy": {"recipe": "h2o", "preemption": "swap"}}, "\\['preemption'\\] must be 'never'"),
    ]:
        with pytest.raises(KVPolicyError, match=words):
            read_settings(bad)
    assert read_settings({"kvpolicy": {"recipe": "h2o", "preemption": "recompute"}}).preemption == "recompute"


def test_the_configurations_whose_answers_may_depend_on_load_are_named_at_start():
    """An answer equals the request's answer alone where neither admission nor the eviction points depend on the
    other requests: the default admission (no preemption) and a ratio budget evicting once the prompt is in."""
    from types import SimpleNamespace

    from kvpolicy.integrations.vllm.engine import load_dependence

    chunked, whole = SimpleNamespace(enable_chunked_prefill=True), SimpleNamespace(enable_chunked_prefill=False)

    def reasons(scheduler, **entry):
        plan = paged_plan(Settings(recipe="h2o", **entry), 2, 2, BLOCK)
        return " | ".join(load_dependence(plan, scheduler))

    assert reasons(chunked) == "" and reasons(chunked, budget=0.2) == ""
    assert "preemption: recompute" in reasons(chunked, preemption="recompute")
    assert "chunked prefill" in reasons(chunked, evict_during_prefill=True)
    assert "chunked prefill" in reasons(chunked, budget=256)  # a token budget evicts between chunks
    assert reasons(whole, evict_during_prefill=True) == ""


def test_each_tensor_parallel_rank_runs_the_policies_of_its_own_heads():
    # vLLM's split: a run of heads per rank, or, with fewer heads than ranks, one head held by neighbouring ranks
    assert [rank_heads(4, 2, r) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    spec = {"kvpolicy": 1, "name": "apart", "policy": "h2o", "budget": {"ratio": 0.2},
            "heads": [{"heads": [1], "policy": "streaming"}]}
    whole = paged_plan(Settings(recipe=spec), 2, 2, BLOCK)
    ranks = [paged_plan(Settings(recipe=spec), 2, 2, BLOCK, heads=rank_heads(2, 2, r)) for r in range(2)]
    assert whole.layers[0].policies.names == ["h2o", "streaming"]
    assert [plan.layers[0].policies.names for plan in ranks] == [["h2o"], ["streaming"]]
    # one schedule for all: vLLM refuses ranks whose KV cache specs differ (h2o's head reads statistics, and
    # prefix-cache hits are cut for it on the rank that runs streaming's head too)
    assert whole.snapshot_tokens(BLOCK) > 0
    assert all(plan.scheduler_view(BLOCK) == whole.scheduler_view(BLOCK) for plan in ranks)
    assert all(plan.prefix_cacheable == whole.prefix_cacheable for plan in ranks)
    tova = {**spec, "policy": "tova"}  # statistics that are not sums over queries, on one rank's head only
    assert not any(paged_plan(Settings(recipe=tova), 2, 2, BLOCK, heads=rank_heads(2, 2, r)).prefix_cacheable
                   for r in range(2))
    with pytest.raises(ValueError, match="a run of the model's 2 KV heads"):
        paged_plan(Settings(recipe=spec), 2, 2, BLOCK, heads=range(1, 3))


def test_paged_plan_of_the_builtin_recipes():
    for name in ("window", "streaming", "h2o", "tova", "scissorhands", "roco", "snapkv", "pyramidkv", "lazy"):
        plan = paged_plan(Settings(recipe=name), 30, 3, 32)
        assert plan is not None and len(plan.layers) == 30 and plan.slack >= 31, name
    assert len(paged_plan(Settings(recipe="pyramidkv"), 30, 3, 32).rules) > 1  # a budget per layer
    assert paged_plan(Settings(recipe="full"), 30, 3, 32) is None  # evicts nothing: vLLM runs stock
    assert paged_plan(Settings(recipe="h2o", slack=0), 30, 3, 32).slack == 0
    assert paged_plan(Settings(recipe="h2o", budget=64), 30, 3, 32).rules == (Budget(tokens=64),)
    # the entry's budget over a recipe with no budget of its own keeps the recipe's slack (none here)
    bare = {"kvpolicy": 1, "policy": "streaming", "params": {"sinks": 4}}
    assert paged_plan(Settings(recipe=bare, budget=64), 30, 3, 32).rules == (Budget(tokens=64),)
    sparse = {"kvpolicy": 1, "policy": "h2o", "budget": {"ratio": 0.2, "slack": 40}}
    assert paged_plan(Settings(recipe=sparse, budget=0.1), 30, 3, 32).slack == 40


@pytest.mark.parametrize("spec,words", [
    ("adakv", "splits each layer's budget among its KV heads"),
    ("fastgen", "sets each KV head's budget itself"),
    ("expected-attention", "policy 'expected-attention' \\(layer 0\\) scores tokens from the cached keys and the "
     "queries' moments"),
    ({"kvpolicy": 1, "policy": "streaming", "params": {"positions": "in_cache"}, "budget": {"tokens": 64}},
     "positions: in_cache"),
    ({"kvpolicy": 1, "policy": "h2o", "budget": {"ratio": 0.2}, "layers": [{"layers": "0-1", "policy": "full"}]},
     "layer\\(s\\) 0-1 keep every token"),
    ({"kvpolicy": 1, "policy": "h2o", "budget": {"ratio": 0.2}, "heads": [{"heads": "0", "budget": {"tokens": 9}}]},
     "KV heads of layer 0 have different budgets"),
    ("h2o-mixed", "budget.memory \\(layer 0\\): precision tiers and budgets in bytes do not run in vLLM yet"),
    ({"kvpolicy": 1, "policy": "h2o", "budget": {"ratio": 0.2, "tiers": [{"bits": 16, "share": 0.5}, {"bits": 4}]}},
     "budget.tiers \\(layer 0\\)"),
])
def test_paged_plan_refuses_what_blocks_cannot_hold(spec, words):
    with pytest.raises(KVPolicyError, match=words) as info:
        paged_plan(Settings(recipe=spec), 30, 3, 32)
    assert "\n" not in str(info.value)


# --- prefix caching: a cached prompt's statistics, kept and continued --------------------------------------------

@pytest.mark.parametrize("policy,params", [("h2o", {}), ("h2o", {"accumulate": "mean"}), ("roco", {})])
def test_a_prefix_cache_hit_continues_the_state_a_full_prefill_leaves(policy, params):
    """With prefix caching, request A observes its prompt in pieces that end at snapshot boundaries and keeps the
    state of its first P slots there; B, whose prompt starts with the same P tokens, gets copies of A's blocks (K/V
    only, as vLLM copies them), the snapshot (carried by the copy of the block holding token P - 1), and observes
    only its own ending: its state equals B observing its whole prompt at once in a cache of its own."""
    torch.manual_seed(3)
    spec = recipe(policy, {"tokens": 8}, slack=3, params=params)
    layer = paged_plan(Settings(recipe=spec, slack=3), 1, HKV, BLOCK).layers[0]
    policies = PagedPolicies(layer.policies)
    shared, own_a, own_b, cut = 12, 5, 7, 8  # a snapshot every 8 tokens: B's hit is cut to 8
    keys = torch.randn(shared + own_b + own_a, HKV, DIM)
    queries = torch.randn(shared + own_b + own_a, HKV * GROUPS, DIM)
    a_tokens = list(range(shared)) + list(range(shared + own_b, shared + own_b + own_a))  # rows of keys/queries
    b_tokens = list(range(shared + own_b))

    def cache_with(tokens: list[int], blocks: list[int], kv: torch.Tensor) -> PagedLayerCache:
        cache = PagedLayerCache.over(*cpu_cache_views(kv), layer.policies)
        position = torch.arange(len(tokens))
        slots = torch.tensor(blocks)[position // BLOCK] * BLOCK + position % BLOCK
        cache.write(keys[tokens], keys[tokens], slots, position)
        return cache

    def observe(cache, blocks, tokens, lo, hi):  # queries [lo, hi) are the last of the slots the pass reads
        rows = CompactRows.of([(blocks, hi)], BLOCK, torch.device("cpu"))
        policies.observe(cache, rows, queries[tokens], torch.arange(lo, hi)[None], torch.arange(lo, hi)[None], 0.3)

    def state(cache, blocks, count):
        position = torch.arange(count)
        return {name: tensor[torch.tensor(blocks)[position // BLOCK], :, position % BLOCK]
                for name, tensor in cache.state.items()}

    # A in blocks 1-5, observed in two pieces around the boundary at 8, its state kept there with block 2 (tokens 4-7)
    kv = torch.zeros(16, HKV, BLOCK, 2 * DIM)
    a_blocks = [1, 2, 3, 4, 5]
    cache = cache_with(a_tokens, a_blocks, kv)
    observe(cache, a_blocks, a_tokens, 0, cut)
    position = torch.arange(cut)
    cache.save_snapshot(2, torch.tensor(a_blocks)[position // BLOCK] * BLOCK + position % BLOCK)
    observe(cache, a_blocks, a_tokens, cut, len(a_tokens))
    # vLLM hands block 9 to another request, and copies A's blocks 1 and 2 into B's 7 and 8, the snapshot with them
    cache.move_snapshots({9}, [(1, 7), (2, 8)])
    b_blocks = [7, 8, 10, 11, 12]
    kv[b_blocks[:2]] = kv[a_blocks[:2]]
    position = torch.arange(cut, len(b_tokens))
    cache.write(keys[b_tokens[cut:]], keys[b_tokens[cut:]], torch.tensor(b_blocks)[position // BLOCK] * BLOCK
                + position % BLOCK, position)
    position = torch.arange(cut)
    cache.write_metadata(torch.tensor(b_blocks)[position // BLOCK] * BLOCK + position % BLOCK, position)
    cache.restore_snapshot(8, torch.tensor(b_blocks)[position // BLOCK] * BLOCK + position % BLOCK)
    observe(cache, b_blocks, b_tokens, cut, len(b_tokens))
    # B alone, its whole prompt at once
    alone_blocks = [1, 2, 3, 4, 5]
    alone = cache_with(b_tokens, alone_blocks, torch.zeros(16, HKV, BLOCK, 2 * DIM))
    observe(alone, alone_blocks, b_tokens, 0, len(b_tokens))
    got, want = state(cache, b_blocks, len(b_tokens)), state(alone, alone_blocks, len(b_tokens))
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    # a block handed to a request loses its snapshot; a copy from a block without one clears the destination's
    cache.move_snapshots({8}, [(3, 2)])
    assert 8 not in cache.snapshots and 2 not in cache.snapshots and 7 not in cache.snapshots
    with pytest.raises(RuntimeError, match="no state was kept"):
        cache.restore_snapshot(8, torch.arange(cut))


def test_a_threshold_budget_is_refused_in_one_line():
    threshold = {"kvpolicy": 1, "policy": "h2o", "budget": {"ratio": 0.3, "threshold": 1.0}}
    with pytest.raises(KVPolicyError, match=r"budget\.threshold \(layer 0\): .*one count; give the budget as ratio"):
        paged_plan(Settings(recipe=threshold), 30, 3, 32)


def test_a_merging_policy_is_refused_in_one_line():
    with pytest.raises(KVPolicyError, match=r"policy 'd2o' \(layer 0\) merges evicted tokens .* use h2o$"):
        paged_plan(Settings(recipe={"kvpolicy": 1, "policy": "d2o", "budget": {"ratio": 0.2}}), 30, 3, 32)


def test_which_recipes_run_with_prefix_caching():
    def plan(policy: str, params: dict | None = None):
        return paged_plan(Settings(recipe=recipe(policy, {"tokens": 10}, slack=3, params=params)), 1, HKV, BLOCK)

    for policy in ("streaming", "window", "h2o", "roco"):
        assert plan(policy).prefix_cacheable, policy
    for policy, params in (("tova", None), ("scissorhands", None), ("snapkv", None), ("h2o", {"decay": 0.9}),
                           ("lazy", None)):
        assert not plan(policy, params).prefix_cacheable, policy
    assert plan("streaming").snapshot_tokens(32) == 0  # no statistics: a hit may end at any block
    assert plan("h2o").snapshot_tokens(32) == 256 and plan("h2o").snapshot_tokens(48) == 288


def test_a_probing_policy_is_refused_in_one_line():
    with pytest.raises(KVPolicyError, match=r"policy 'kvzip' \(layer 0\) scores the prompt by a probe.* or h2o$"):
        paged_plan(Settings(recipe={"kvpolicy": 1, "policy": "kvzip", "budget": {"ratio": 0.2}}), 30, 3, 32)

"""Runs jobs on vLLM (in the vLLM environment) for tests/test_vllm.py: one engine per job, results as JSON lines.

    python driver.py JOBS.json     # [{"model": dir, "config": {...} | null, "prompts": [[ids]...], "max_tokens": n,
                                   #   "engine": {LLM keyword arguments},
                                   #   "abort": {"after_steps": k, "requests": [i, ...]} (optional)}, ...]

Each result: the generated token ids per prompt, the most KV blocks each request held at once, read from the
scheduler's block manager (kvpolicy's manager records it; the stock one is read from its block table), and how
many times the job called vLLM's CPU attention kernel and kvpolicy's own attention (`calls`; with one rank, whose
worker runs in this process). The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that its
scheduler can be read. A job with ``abort`` runs its prompts through the engine's loop instead and aborts some
mid-way (`run_under_load`).
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def managers(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.kv_cache_manager.coordinator.single_type_managers


CALLS = {"vllm_kernel": 0, "kvpolicy_attention": 0}


def count_calls() -> None:
    """Count the calls of vLLM's CPU attention kernel and of every attention kvpolicy has (its backends' `attend`)."""
    import vllm._custom_ops as ops

    import kvpolicy.backend.dispatch as dispatch
    import kvpolicy.backend.torch_ref as torch_ref

    def counted(module, name, key):
        original = getattr(module, name)

        def call(*args, **kwargs):
            CALLS[key] += 1
            return original(*args, **kwargs)

        setattr(module, name, call)

    if hasattr(ops, "cpu_attention_with_kv_cache"):  # the CPU build's kernel (a CUDA build counts none)
        counted(ops, "cpu_attention_with_kv_cache", "vllm_kernel")
    for module in (dispatch, torch_ref):
        counted(module, "attend", "kvpolicy_attention")


def run(job):
    from vllm import LLM, SamplingParams

    engine = {"dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False, "block_size": 32,
              "max_model_len": 2048, "kv_cache_memory_bytes": 128 << 20, **job.get("engine", {})}
    if job.get("config") is not None:
        engine["additional_config"] = {"kvpolicy": job["config"]}
    try:
        llm = LLM(model=job["model"], **engine)
    except Exception as exc:  # the test reads the reason
        return {"error": f"{type(exc).__name__}: {exc}"}
    manager = managers(llm)[0]
    peaks = {}
    original = manager.remove_skipped_blocks

    def watch(request_id, processed, num_prompt_tokens=None):
        original(request_id, processed, num_prompt_tokens)
        blocks = manager.req_to_blocks.get(request_id, [])
        held = sum(1 for block in blocks if not block.is_null)
        peaks.setdefault(request_id, []).append((processed, held, manager.block_pool.get_num_free_blocks()))

    manager.remove_skipped_blocks = watch
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    CALLS.update(dict.fromkeys(CALLS, 0))
    if "abort" in job:
        result = run_under_load(llm, job, params)
        del llm
        return result
    if job.get("one_by_one"):  # each prompt once the one before it has ended: it may reuse that one's prefix
        outputs = [llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0] for ids in job["prompts"]]
    else:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], params, use_tqdm=False)
    result = {
        "tokens": [list(out.outputs[0].token_ids) for out in outputs],
        "cached_tokens": [out.num_cached_tokens or 0 for out in outputs],
        **(pool_report(llm) if job.get("engine", {}).get("enable_prefix_caching") else {}),
        # requests reach the scheduler in prompt order (vLLM adds a suffix to their ids)
        "blocks": list(peaks.values()),
        "pool_blocks": manager.block_pool.num_gpu_blocks,
        "block_size": manager.block_size,
        "manager": type(manager).__name__,
        "calls": dict(CALLS),
    }
    del llm
    return result


def count_lru_reclaims(llm) -> dict:
    """Count the cached blocks vLLM's pool hands out again (its LRU dropping a prefix-cache entry)."""
    pool = managers(llm)[0].block_pool
    counts = {"reclaimed": 0}
    original = pool._maybe_evict_cached_block

    def evict(block):
        dropped = original(block)
        counts["reclaimed"] += bool(dropped)
        return dropped

    pool._maybe_evict_cached_block = evict
    return counts


def pool_report(llm) -> dict:
    """Once nothing runs: blocks that requests still hold or reference, blocks in the prefix cache, and whether vLLM
    can empty its prefix cache (only when no block is in use)."""
    manager = managers(llm)[0]
    pool = manager.block_pool
    blocks = [block for block in pool.blocks if not block.is_null]
    return {
        "referenced_at_end": sum(1 for block in blocks if block.ref_cnt),
        "cached_at_end": sum(1 for block in blocks if block.block_hash is not None),
        "free_blocks_at_end": pool.get_num_free_blocks(), "pool_blocks": pool.num_gpu_blocks,
        "uncached": getattr(manager, "uncached", 0), "overruns": getattr(manager, "overruns", 0),
        "reset_prefix_cache": pool.reset_prefix_cache(),
    }


def run_under_load(llm, job, params) -> dict:
    """The prompts through the engine's own loop, each added at its step of ``arrive_at_step`` (all at once without
    it) with its ``priorities`` entry; after ``abort.after_steps`` steps, the requests ``abort.requests`` are aborted
    mid-way. Reports what finished, how often vLLM preempted a request, and the KV
    blocks still held once nothing runs (read from the block pool and from the manager's per-request tables)."""
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    preempted = []
    original = scheduler._preempt_request

    def preempt(request, *args, **kwargs):
        preempted.append({"request": request.request_id, "generated": request.num_output_tokens,
                          "computed": request.num_computed_tokens})
        return original(request, *args, **kwargs)

    scheduler._preempt_request = preempt
    reclaims = count_lru_reclaims(llm)
    count = len(job["prompts"])
    priorities, arrivals = job.get("priorities") or [0] * count, job.get("arrive_at_step") or [0] * count

    def arrive(step: int) -> None:
        for index, (ids, priority, at) in enumerate(zip(job["prompts"], priorities, arrivals, strict=True)):
            if at == step:
                engine.add_request(str(index), {"prompt_token_ids": ids}, params, priority=priority)

    arrive(0)
    aborted = [str(index) for index in job["abort"]["requests"]]
    tokens, cached, finished, steps = {}, {}, set(), 0
    while engine.has_unfinished_requests() or steps < max(arrivals):
        if steps:
            arrive(steps)
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
            cached[out.request_id] = out.num_cached_tokens or 0
            if out.finished:
                finished.add(out.request_id)
        steps += 1
        if steps == job["abort"]["after_steps"]:
            engine.abort_request(aborted)
    pool = scheduler.kv_cache_manager.block_pool
    held = {rid: sum(1 for block in blocks if not block.is_null)
            for manager in scheduler.kv_cache_manager.coordinator.single_type_managers
            for rid, blocks in manager.req_to_blocks.items()}
    return {
        "tokens": [tokens.get(str(index), []) for index in range(len(job["prompts"]))],
        "cached_tokens": [cached.get(str(index), 0) for index in range(len(job["prompts"]))],
        "finished": sorted(finished, key=int), "aborted": aborted, "preempted": preempted, "steps": steps,
        "pool_blocks": pool.num_gpu_blocks, "free_blocks_at_end": pool.get_num_free_blocks(),
        "held_at_end": {rid: count for rid, count in held.items() if count},
        # allocations past the most blocks a request was admitted for (kvpolicy's manager counts them)
        "overruns": sum(getattr(manager, "overruns", 0)
                        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers),
        **reclaims,
        **(pool_report(llm) if job.get("engine", {}).get("enable_prefix_caching") else {}),
    }


def main():
    jobs = json.load(open(sys.argv[1]))
    count_calls()
    for job in jobs:
        print("RESULT " + json.dumps(run(job)), flush=True)


if __name__ == "__main__":
    main()

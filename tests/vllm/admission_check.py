"""Run by tests/test_vllm.py in .venv-vllm, over vLLM's own block pool.

Admission with prefix-cache hits while this step's evictions hold free blocks in quarantine: whenever
get_num_blocks_to_allocate says a hit request fits in the free blocks, its copies find clean blocks."""
import random

import torch
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvpolicy.integrations.vllm.spec import KVPolicyManager, KVPolicySpec
from kvpolicy.recipe.budget import Budget

BS = 4
BASE = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
rng = random.Random(0)
checked = {True: 0, False: 0}
for case in range(600):
    reserve = case % 2 == 0  # kvpolicy's admission, and vLLM's (preemption: recompute)
    spec = KVPolicySpec.from_spec(BASE, rules=(Budget(ratio=0.2),), slack=BS - 1, reserve=reserve)
    pool = BlockPool(num_gpu_blocks=rng.randint(20, 60), enable_caching=True, hash_block_size=BS)
    manager = KVPolicyManager(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                              scheduler_block_size=BS)
    held = pool.get_new_blocks(rng.randint(0, pool.get_num_free_blocks() - 1))  # other requests' blocks
    quarantined = held[:rng.randint(0, len(held))]  # freed by this step's evictions
    pool.free_blocks(quarantined)
    manager.freed_now.update(b.block_id for b in quarantined)
    still = held[len(quarantined):]
    hits = still[:rng.randint(1, max(1, len(still)))] if still else []
    if not hits:
        continue
    prompt = len(hits) * BS + rng.randint(1, 40)
    manager.note_request("r", prompt, prompt + 16)
    n = len(hits) * BS
    want = manager.get_num_blocks_to_allocate("r", prompt, hits, n, n, prompt, apply_admission_cap=True)
    if want > pool.get_num_free_blocks():
        continue
    manager.add_local_computed_blocks("r", hits, len(hits) * BS, 0)  # raises if the copies find no clean block
    checked[reserve] += 1
print("admitted and copied, by reserve:", checked)
assert min(checked.values()) > 50, checked

# and a request that evicts during its prefill is never asked for its whole prompt: with nothing else running, one
# whose bound and hit copies fit in the pool is admitted, however long its prompt
for case in range(200):
    reserve = case % 2 == 0
    spec = KVPolicySpec.from_spec(BASE, rules=(Budget(tokens=8),), slack=BS - 1, evict_during_prefill=True,
                                  step_tokens=4 * BS, reserve=reserve)
    pool = BlockPool(num_gpu_blocks=40, enable_caching=True, hash_block_size=BS)
    manager = KVPolicyManager(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                              scheduler_block_size=BS)
    hits = pool.get_new_blocks(rng.randint(1, 6))
    prompt = rng.randint(60, 400) * BS  # far more blocks than the pool holds
    manager.note_request("r", prompt, prompt + 16)
    n = len(hits) * BS
    want = manager.get_num_blocks_to_allocate("r", prompt, hits, n, n, prompt, apply_admission_cap=True)
    bound = manager.bounds["r"]
    assert want <= max(bound, 2 * len(hits) + 1), (reserve, want, bound, len(hits), prompt)
print("long prompts admitted on their bounds")

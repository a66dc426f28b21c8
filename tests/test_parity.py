"""With a budget at least as large as the sequence, kvpolicy equals plain transformers."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy, uniform_plan
from tiny_models import ARCHS, padded_batch, tiny_model

from kvpolicy.errors import KVPolicyError
from kvpolicy.hf.session import attach
from kvpolicy.recipe.budget import Budget

STEPS = 20
POLICIES = [
    ("full", {}), ("h2o", {}), ("window", {}), ("streaming", {"sinks": 4}),
    ("streaming", {"sinks": 4, "positions": "in_cache"}),
    # FastGen keeps everything when its local window (or frequent share) is the whole length: a fixed pattern,
    # and run-time profiling between two candidates that both keep everything (token ids recorded)
    ("fastgen", {"pattern": "frequency+local", "local_ratio": 1.0}),
    ("fastgen", {"candidates": ("special+punct+local", "full"), "local_ratio": 1.0, "special_tokens": (2,),
                 "punct_tokens": tuple(range(10, 128, 9))}),
    ("fastgen", {"threshold": 0.5, "frequency_ratio": 1.0, "candidates": ("punct+frequency",),
                 "special_tokens": (), "punct_tokens": (11, 12)}),
]


@pytest.mark.parametrize("arch", ARCHS)
def test_large_budget_equals_transformers(arch):
    model = tiny_model(arch)
    ids, mask = padded_batch()
    ref_tokens, ref_logits = greedy(model, ids, mask, STEPS)
    ref_prefill = model(input_ids=ids, attention_mask=mask).logits
    for policy, params in POLICIES:
        session = attach(model, uniform_plan(model, policy, Budget(tokens=1000), **params))
        if arch == "opt" and params.get("positions") == "in_cache":  # learned positions: no RoPE to move
            with pytest.raises(KVPolicyError, match="need a RoPE model"):
                session.new_cache()
            session.detach()
            continue
        try:
            tokens, logits = greedy(session.model, ids, mask, STEPS, cache=session.new_cache())
            prefill = model(input_ids=ids, attention_mask=mask, cache=session.new_cache()).logits
        finally:
            session.detach()
        assert torch.equal(tokens, ref_tokens), policy
        torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-4, msg=policy)
        real = mask.bool()
        torch.testing.assert_close(prefill[real], ref_prefill[real], atol=2e-4, rtol=1e-4, msg=policy)

"""Shared test helpers: plans built in code, and generation that records each step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from kvpolicy.hf.session import model_shape
from kvpolicy.recipe.budget import UNBOUNDED, Budget
from kvpolicy.recipe.plan import HeadPlan, LayerPlan, Plan
from kvpolicy.registry import get_registry


def uniform_plan(model, policy: str, budget: Budget | None = None, **params) -> Plan:
    layers, heads = model_shape(model)
    cls = get_registry().get(policy)
    head = HeadPlan(policy, cls.Params(**params), budget if cls.evicts and not cls.dynamic_budget and budget else UNBOUNDED)
    return Plan(f"{policy}-test", [LayerPlan([head] * heads) for _ in range(layers)])


def per_head_counts(cache) -> list[torch.Tensor]:
    """Tokens held per (row, KV head), one [B, Hkv] tensor per layer."""
    return [layer.valid.sum(dim=2).clone() for layer in cache.layers]


class StepRecorder(LogitsProcessor):
    """Calls ``snapshot()`` after every forward pass of `generate` and keeps what it returns."""

    def __init__(self, snapshot: Callable[[], object]):
        self.snapshot = snapshot
        self.steps: list[object] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps.append(self.snapshot())
        return scores


def greedy(model, ids, mask, steps: int, recorder: StepRecorder | None = None, **kwargs):
    """Greedy generation of exactly ``steps`` tokens, with per-step logits."""
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        logits_processor=LogitsProcessorList([recorder] if recorder else []),
        **kwargs,
    )
    return out.sequences, torch.stack(out.logits, dim=1)


def run_against_reference(model, reference, plan, ids, mask, steps: int, tokenizer=None):
    """Greedy generation under a brute-force reference, then under kvpolicy with ``plan``.

    Asserts the same kept positions per (layer, row, KV head) after every forward pass,
    the same tokens and the same logits; returns kvpolicy's per-step kept positions.
    """
    from kvpolicy.hf.session import attach

    reference.register()
    model.set_attn_implementation(reference.name)
    hook = reference.hook(model) if hasattr(reference, "hook") else None  # e.g. to see the token ids
    theirs = StepRecorder(lambda: dict(reference.current))
    try:
        ref_tokens, ref_logits = greedy(model, ids, mask, steps, recorder=theirs)
    finally:
        if hook is not None:
            hook.remove()
    model.set_attn_implementation("sdpa")

    session = attach(model, plan, tokenizer=tokenizer)
    layers = range(model.config.num_hidden_layers)
    ours = StepRecorder(lambda: {layer: session.last_cache.kept_positions(layer) for layer in layers})
    try:
        tokens, logits = greedy(model, ids, mask, steps, recorder=ours, cache=session.new_cache())
    finally:
        session.detach()
    assert len(ours.steps) == len(theirs.steps) == steps
    for step, (mine, expected) in enumerate(zip(ours.steps, theirs.steps, strict=True)):
        for layer in layers:
            assert mine[layer] == expected[layer], f"step {step} layer {layer}"
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    reference.kvpolicy_cache = session.last_cache  # for checks beyond the kept positions
    return ours.steps


def run_script_under_interpreter(script: str) -> None:
    """Run ``script`` in a fresh Python with ``TRITON_INTERPRET=1`` (triton reads it at import); it must print "ok"."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("KVPOLICY_BACKEND", None)
    result = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]

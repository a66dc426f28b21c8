"""StreamingLLM with in-cache positions (the paper's method) against a naive reference."""

from __future__ import annotations

import torch
from helpers import StepRecorder, greedy, uniform_plan
from tiny_models import padded_batch, tiny_model
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.llama.modeling_llama import rotate_half

from kvpolicy.hf.session import attach
from kvpolicy.recipe.budget import Budget

NAME = "streaming_incache_reference"


class NaiveStreaming:
    """Keeps every K/V (DynamicCache); per row, attends to sinks + recent re-rotated to their cache index."""

    def __init__(self, model, budget: int, sinks: int):
        self.rotary, self.budget, self.sinks = model.model.rotary_emb, budget, sinks
        self.kept: dict[tuple[int, int], list[int]] = {}  # (layer, row) -> padded indices, by position

    def turn(self, x: torch.Tensor, delta: float) -> torch.Tensor:
        cos, sin = self.rotary(x[None, None], torch.tensor([[delta]]))
        return x * cos[0, 0] + rotate_half(x) * sin[0, 0]

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        batch, q_heads, queries, dim = query.shape
        kv_heads, total = key.shape[1], key.shape[2]
        group = q_heads // kv_heads
        real = torch.ones(batch, total, dtype=torch.bool) if attention_mask is None else attention_mask.bool()[:, -total:]
        position = torch.cumsum(real.long(), dim=1) - 1
        out = torch.zeros(batch, queries, q_heads, dim)
        for b in range(batch):
            kept = self.kept.setdefault((module.layer_idx, b), [])
            kept += [j for j in range(total - queries, total) if real[b, j]]
            for i in range(total - queries, total):
                if not real[b, i]:
                    continue
                cols = [j for j in kept if j <= i]
                for qh in range(q_heads):
                    h = qh // group
                    q = self.turn(query[b, qh, i - total + queries], float(cols.index(i) - position[b, i]))
                    ks = torch.stack([self.turn(key[b, h, j], float(r - position[b, j])) for r, j in enumerate(cols)])
                    probs = torch.softmax(ks @ q * scaling, dim=0)
                    out[b, i - total + queries, qh] = probs @ value[b, h, cols]
            if len(kept) > self.budget:
                kept[:] = kept[: self.sinks] + kept[len(kept) - (self.budget - self.sinks) :]
        return out, None


def test_in_cache_positions_match_naive_reference():
    model = tiny_model("llama")
    ids, mask = padded_batch(lengths=(13, 9))
    steps, budget, sinks = 8, 6, 2

    reference = NaiveStreaming(model, budget, sinks)
    AttentionInterface.register(NAME, reference.attention)
    AttentionMaskInterface.register(NAME, lambda *a, attention_mask=None, **k: attention_mask)
    model.set_attn_implementation(NAME)
    ref_tokens, ref_logits = greedy(model, ids, mask, steps)
    model.set_attn_implementation("sdpa")

    session = attach(model, uniform_plan(model, "streaming", Budget(tokens=budget), sinks=sinks, positions="in_cache"))
    recorder = StepRecorder(lambda: session.last_cache.kept_positions(0))
    tokens, logits = greedy(model, ids, mask, steps, recorder=recorder, cache=session.new_cache())
    session.detach()
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens, ref_tokens)
    assert recorder.steps[-1][0][0] == [0, 1, 16, 17, 18, 19]  # 13 prompt + 7 fed back; sinks + recent

    # and it is not the same as keeping original positions
    session = attach(model, uniform_plan(model, "streaming", Budget(tokens=budget), sinks=sinks))
    _, original = greedy(model, ids, mask, steps, cache=session.new_cache())
    session.detach()
    assert not torch.allclose(original, logits, atol=1e-3)

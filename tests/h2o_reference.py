"""A deliberately naive H2O, written from the paper's Algorithm 1 with explicit attention matrices.

It keeps every K/V in a DynamicCache and simulates eviction with Python sets, looping
over batch rows, KV heads and queries, so that it shares no code with kvpolicy.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

NAME = "h2o_bruteforce"


class BruteForceH2O:
    def __init__(self, budget: int, recent_ratio: float = 0.5):
        self.budget = budget
        self.recent = round(budget * recent_ratio)
        self.kept: dict[tuple[int, int, int], set[int]] = {}  # (layer, row, kv head) -> padded indices
        self.score: dict[tuple[int, int, int], dict[int, float]] = {}
        self.current: dict[int, list[list[list[int]]]] = {}  # layer -> [row][head] kept real positions

    def register(self) -> None:
        AttentionInterface.register(NAME, self.attention)
        AttentionMaskInterface.register(NAME, lambda *a, attention_mask=None, **k: attention_mask)

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        batch, q_heads, queries, dim = query.shape
        kv_heads, total = key.shape[1], key.shape[2]
        group = q_heads // kv_heads
        scaling = scaling or dim**-0.5
        real = torch.ones(batch, total, dtype=torch.bool) if attention_mask is None else attention_mask.bool()[:, -total:]
        real_pos = torch.cumsum(real.long(), dim=1) - 1
        out = torch.zeros(batch, queries, q_heads, dim)
        first_new = total - queries
        for b in range(batch):
            for h in range(kv_heads):
                kept = self.kept.setdefault((layer, b, h), set())
                score = self.score.setdefault((layer, b, h), {})
                new = [j for j in range(first_new, total) if real[b, j]]
                for j in new:
                    kept.add(j)
                    score.setdefault(j, 0.0)
                for i in range(first_new, total):
                    if not real[b, i]:
                        continue
                    cols = sorted(j for j in kept if j <= i)
                    accumulated = {j: 0.0 for j in cols}
                    for g in range(group):
                        qh = h * group + g
                        logits = [float(query[b, qh, i - first_new] @ key[b, h, j]) * scaling for j in cols]
                        top = max(logits)
                        weights = [math.exp(x - top) for x in logits]
                        norm = sum(weights)
                        probs = [w / norm for w in weights]
                        out[b, i - first_new, qh] = sum(p * value[b, h, j] for p, j in zip(probs, cols, strict=True))
                        for p, j in zip(probs, cols, strict=True):
                            accumulated[j] += p / group
                    for j in cols:
                        score[j] += accumulated[j]
                if len(kept) > self.budget:
                    newest_first = sorted(kept, reverse=True)
                    recent = set(newest_first[: self.recent])
                    others = sorted(kept - recent, key=lambda j: -score[j])
                    kept.intersection_update(recent | set(others[: self.budget - len(recent)]))
                    for j in list(score):
                        if j not in kept:
                            del score[j]
        self.current[layer] = [
            [sorted(int(real_pos[b, j]) for j in self.kept[(layer, b, h)]) for h in range(kv_heads)]
            for b in range(batch)
        ]
        return out.to(query.dtype), None

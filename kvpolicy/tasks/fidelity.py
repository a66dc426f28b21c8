"""Fidelity to the full cache on the same prompts: greedy-token agreement and KL of next-token distributions.

For each prompt (2 x ``--trials`` segments of ``--prompt-tokens`` tokens from the text) one
batch holds the full cache, every policy row generating freely, and every policy row
again under teacher forcing on the full cache's greedy continuation. Per step:

- ``greedy_match``: share of a row's free-running greedy tokens equal, position by
  position, to the full cache's; ``agree_prefix``: tokens until the first difference.
- ``kl``: mean KL(full || policy) of the next-token distributions under teacher forcing;
  ``top1``: share of teacher-forced steps whose argmax equals the full cache's token.

The first new token comes from the prefill forward pass, before anything is evicted,
so it is the same for every row; it is left out and the next ``CONTINUATION`` are scored.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Context, Row, batched_session, forward, text_segments

CONTINUATION = 32
PROMPTS_PER_TRIAL = 2


class Fidelity:
    uses_prompt_tokens = True
    name = "fidelity"
    description = "agreement with the full cache: greedy tokens and KL(full || policy)"
    columns = [("greedy_match", "greedy=", "{:.0%}"), ("top1", "top-1=", "{:.0%}"), ("kl", "KL", "{:.3f}")]
    plots = [
        ("quality", "greedy_match", "greedy tokens = full cache (free-running)"),
        ("quality", "top1", "top-1 = full cache (teacher-forced)"),
        ("quality", "kl", "KL(full || policy), nats"),
    ]

    def settings(self, ctx: Context) -> dict[str, Any]:
        return {"prompt_tokens": ctx.prompt_tokens, "prompts": PROMPTS_PER_TRIAL * ctx.trials,
                "continuation": CONTINUATION, "seed": ctx.seed}

    def tokens_needed(self, ctx: Context) -> int:
        return ctx.prompt_tokens

    def run(self, ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
        policy_rows = [row for row in rows if not row.is_full]
        full = Row("full", None, "full")
        sums = torch.zeros(4, len(policy_rows), dtype=torch.float64)  # greedy_match, agree_prefix, kl, top1
        prompts = text_segments(ctx, ctx.prompt_tokens, PROMPTS_PER_TRIAL * ctx.trials)
        for prompt in ctx.track(prompts, len(prompts), "fidelity", rows=len(policy_rows), unit="prompts",
                                tokens=lambda p: p.numel() * (2 * len(policy_rows) + 1)):
            if policy_rows:
                sums += compare_to_full(ctx, full, policy_rows, prompt, CONTINUATION)
        means = sums / max(1, len(prompts))
        exact = {"greedy_match": 1.0, "agree_prefix": float(CONTINUATION), "kl": 0.0, "top1": 1.0}
        results, index = [], 0
        for row in rows:
            if row.is_full:
                results.append(dict(exact))
                continue
            match, prefix, kl, top1 = means[:, index].tolist()
            results.append({"greedy_match": match, "agree_prefix": prefix, "kl": kl, "top1": top1})
            index += 1
        return results


def compare_to_full(ctx: Context, full: Row, rows: list[Row], prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """[4, len(rows)]: greedy match, agreeing prefix, mean KL and top-1 agreement on one prompt."""
    model, n = ctx.model, len(rows)
    batch = [full, *rows, *rows]  # 0: full; 1..n: free-running; n+1..2n: teacher-forced
    session = batched_session(model, batch, tokenizer=ctx.tokenizer)
    free_tokens, full_tokens, kls, top1 = [], [], [], []
    try:
        cache = session.new_cache()
        with torch.inference_mode():
            logits = forward(model, prompt.expand(len(batch), -1), cache).logits[:, -1]
            first = logits[0].argmax().expand(len(batch), 1)  # identical for every row: see the docstring
            logits = forward(model, first, cache).logits[:, -1].float()
            for step in range(steps):
                logprobs = torch.log_softmax(logits, dim=-1)
                reference = logprobs[0].argmax()
                free = logprobs[1 : n + 1].argmax(dim=-1)
                forced = logprobs[n + 1 :]
                kls.append((logprobs[0].exp() * (logprobs[0] - forced)).sum(dim=-1))
                top1.append(forced.argmax(dim=-1) == reference)
                free_tokens.append(free)
                full_tokens.append(reference)
                if step + 1 < steps:
                    step_ids = torch.cat([reference[None], free, reference.expand(n)])[:, None]
                    logits = forward(model, step_ids, cache).logits[:, -1].float()
    finally:
        session.detach()
    same = torch.stack(free_tokens, dim=1) == torch.stack(full_tokens)[None, :]  # [n, steps]
    prefix = torch.where(same.all(dim=1), steps, (~same).int().argmax(dim=1))
    return torch.stack([
        same.double().mean(dim=1), prefix.double(), torch.stack(kls, 1).double().mean(dim=1),
        torch.stack(top1, 1).double().mean(dim=1),
    ])

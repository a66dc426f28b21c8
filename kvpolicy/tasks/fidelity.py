"""Fidelity to the full cache on the same prompts: greedy-token agreement and KL of next-token distributions.

For each prompt (2 x ``--trials`` segments of ``--prompt-tokens`` tokens from the text) one
batch holds the full cache, every policy row generating freely, and every policy row
again under teacher forcing on the full cache's greedy continuation. Per step:

- ``greedy_match``: share of a row's free-running greedy tokens equal, position by
  position, to the full cache's; ``agree_prefix``: tokens until the first difference.
- ``kl``: mean KL(full || policy) of the next-token distributions under teacher forcing;
  ``top1``: share of teacher-forced steps whose argmax equals the full cache's token.

The first new token comes from the prefill forward pass, before anything is evicted,
so it is the same for every row; it is left out and the next ``--new-tokens`` (32 unless given) are scored.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Context, Row, batched_session, forward, text_segments

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
                "continuation": ctx.new_tokens, "seed": ctx.seed}

    def tokens_needed(self, ctx: Context) -> int:
        return ctx.prompt_tokens

    def run(self, ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
        policy_rows = [row for row in rows if not row.is_full]
        full = Row("full", None, "full")
        sums = torch.zeros(4, len(policy_rows), dtype=torch.float64)  # greedy_match, agree_prefix, kl, top1
        prompts = text_segments(ctx, ctx.prompt_tokens, PROMPTS_PER_TRIAL * ctx.trials)
        for prompt in ctx.track(prompts, len(prompts), "fidelity", rows=len(policy_rows), unit="prompts",
                                tokens=lambda p: (p.numel() + ctx.new_tokens) * (2 * len(policy_rows) + 1)):
            if policy_rows:
                sums += compare_to_full(ctx, full, policy_rows, prompt, ctx.new_tokens)
        means = sums / max(1, len(prompts))
        exact = {"greedy_match": 1.0, "agree_prefix": float(ctx.new_tokens), "kl": 0.0, "top1": 1.0}
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
    """[4, len(rows)]: greedy match, agreeing prefix, mean KL and top-1 agreement on one prompt.

    The full cache's continuation runs first, on its own (rows that store tokens differently, e.g. at
    precision tiers, cannot share a batch with it); then each row runs twice in one batch, free-running and
    teacher-forced on the full cache's tokens."""
    first, reference, reference_logprobs = _full_continuation(ctx, full, prompt, steps)
    model, n = ctx.model, len(rows)
    batch = [*rows, *rows]  # 0..n-1: free-running; n..2n-1: teacher-forced
    session = batched_session(model, batch, tokenizer=ctx.tokenizer)
    free_tokens, kls, top1 = [], [], []
    try:
        cache = session.new_cache()
        with torch.inference_mode():
            forward(model, prompt.expand(len(batch), -1), cache)
            logits = forward(model, first.expand(len(batch), 1), cache).logits[:, -1].float()
            for step in range(steps):
                logprobs = torch.log_softmax(logits, dim=-1)
                free, forced, full_step = logprobs[:n].argmax(dim=-1), logprobs[n:], reference_logprobs[step]
                kls.append((full_step.exp() * (full_step - forced)).sum(dim=-1))
                top1.append(forced.argmax(dim=-1) == reference[step])
                free_tokens.append(free)
                if step + 1 < steps:
                    step_ids = torch.cat([free, reference[step].expand(n)])[:, None]
                    logits = forward(model, step_ids, cache).logits[:, -1].float()
    finally:
        session.detach()
    same = torch.stack(free_tokens, dim=1) == reference[None, :]  # [n, steps]
    prefix = torch.where(same.all(dim=1), steps, (~same).int().argmax(dim=1))
    return torch.stack([
        same.double().mean(dim=1), prefix.double(), torch.stack(kls, 1).double().mean(dim=1),
        torch.stack(top1, 1).double().mean(dim=1),
    ])


def _full_continuation(ctx: Context, full: Row, prompt: torch.Tensor,
                       steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full cache's greedy continuation: (its first token [1], the ``steps`` tokens after it [steps], their
    log-probabilities [steps, vocab]). Every row is fed the same first token: see the module docstring."""
    session = batched_session(ctx.model, [full], tokenizer=ctx.tokenizer)
    tokens, logprobs = [], []
    try:
        cache = session.new_cache()
        with torch.inference_mode():
            first = forward(ctx.model, prompt[None], cache).logits[0, -1].argmax().reshape(1)
            logits = forward(ctx.model, first[None], cache).logits[0, -1].float()
            for step in range(steps):
                step_logprobs = torch.log_softmax(logits, dim=-1)
                tokens.append(step_logprobs.argmax())
                logprobs.append(step_logprobs)
                if step + 1 < steps:
                    logits = forward(ctx.model, tokens[-1].reshape(1, 1), cache).logits[0, -1].float()
    finally:
        session.detach()
    return first, torch.stack(tokens), torch.stack(logprobs)

"""Streaming perplexity with a bounded cache: feed token t, score token t+1 (StreamingLLM / H2O style).

The first ``--tokens`` tokens of the text are fed one at a time to every row of the
sweep at once (one batch, one row per recipe x budget), so each token is predicted from
the cache as its policy left it. A ratio budget is a share of the evaluated tokens:
``0.2`` with 1,000 tokens keeps 200 per (layer, KV head).

``--ppl-mode chunked`` feeds 64 tokens per forward pass instead: within a chunk the
queries also see the chunk's earlier tokens, and eviction runs once per chunk, so the
cache briefly holds up to budget + 63 tokens. It came out lower (optimistic) in every
case measured, by an amount that grows as the budget shrinks toward the chunk size.
Measured on SmolLM2-135M (pydoc topics, 1 thread), chunked vs token by token:

- 4,000 tokens (budgets of 400 and 800 tokens): ``full`` identical (10.764); window -1.5% /
  -0.9% at 10% / 20%, streaming -0.4% / -0.3%, H2O -2.0% / -0.1%; 239 s instead of 1,130 s.
- 768 tokens (budgets of 77, 154, 384): ``full`` identical; at 10% window -18%, streaming
  -9%, H2O -8%; at 20% -13%, -1.4%, -2.3%; at 50% under 0.5%.

So chunked is fine for budgets of several hundred tokens; for small budgets report token
by token (the default).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .base import Context, Row, batched_session, forward, kept_tokens

CHUNK = 64


class Perplexity:
    name = "ppl"
    description = "streaming perplexity over the text with the bounded cache"
    columns = [("ppl", "ppl", "{:.2f}")]
    plots = [("quality", "ppl", "perplexity (lower is better)")]

    def settings(self, ctx: Context) -> dict[str, Any]:
        return {"tokens": ctx.tokens, "mode": ctx.ppl_mode, "chunk": CHUNK if ctx.ppl_mode == "chunked" else 1}

    def tokens_needed(self, ctx: Context) -> int:
        return ctx.tokens

    def run(self, ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
        ids = ctx.text_ids[: ctx.tokens]
        nll, kept = streaming_nll(ctx, rows, ids, CHUNK if ctx.ppl_mode == "chunked" else 1)
        count = ids.numel() - 1
        return [
            {"ppl": math.exp(float(total) / count), "nll": float(total) / count, "scored_tokens": count, "kv_tokens": k}
            for total, k in zip(nll.tolist(), kept, strict=True)
        ]


def streaming_nll(ctx: Context, rows: list[Row], ids: torch.Tensor, step: int) -> tuple[torch.Tensor, list[float]]:
    """Summed NLL per row of ``ids[1:]`` given the earlier tokens, fed ``step`` at a time; kept tokens per row."""
    model, batch, count = ctx.model, len(rows), ids.numel()
    session = batched_session(model, rows, tokenizer=ctx.tokenizer)
    try:
        cache = session.new_cache(prompt_tokens=count)
        total = torch.zeros(batch, dtype=torch.float64)
        starts = range(0, count - 1, step)
        with torch.inference_mode():
            for start in ctx.track(starts, len(starts), f"ppl ({count} tokens)", rows=batch,
                                   unit="tokens" if step == 1 else "chunks", tokens=step * batch):
                chunk = ids[start : min(start + step, count - 1)]
                targets = ids[start + 1 : start + 1 + chunk.numel()]
                logits = forward(model, chunk.expand(batch, -1), cache).logits.float()
                logprobs = torch.log_softmax(logits, dim=-1)
                picked = logprobs.gather(-1, targets.expand(batch, -1)[..., None])[..., 0]
                total -= picked.sum(dim=1).double()
        kept = [kept_tokens(cache, row) for row in range(batch)]
    finally:
        session.detach()
    return total, kept

"""``kvtokens``: KV tokens each row keeps per layer right after a prefill of ``--prompt-tokens`` tokens.

All rows of the sweep run as rows of one batch: one forward pass over the first
``--prompt-tokens`` tokens of the text, then each layer's kept tokens are counted per
KV head and averaged. A cheap check that a recipe's budget (and its per-layer schedule)
does what it says, without decoding.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpolicy.tasks import Context, Row
from kvpolicy.tasks.base import batched_session, forward


class KVTokens:
    name = "kvtokens"
    description = "mean KV tokens kept per layer after a prefill of --prompt-tokens tokens"
    columns = [("kv_tokens_mean", "KV tok", "{:.1f}"), ("kv_kept_ratio", "kept", "{:.0%}")]
    plots = [("memory", "kv_tokens_mean", "KV tokens kept after prefill (mean over layers)")]

    def settings(self, ctx: Context) -> dict[str, Any]:
        return {"prompt_tokens": ctx.prompt_tokens}

    def tokens_needed(self, ctx: Context) -> int:
        return ctx.prompt_tokens

    def run(self, ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
        ids = ctx.text_ids[: ctx.prompt_tokens]
        session = batched_session(ctx.model, rows)
        try:
            cache = session.new_cache(prompt_tokens=ids.numel())
            with torch.inference_mode():
                forward(ctx.model, ids.expand(len(rows), -1), cache)
            per_layer = [
                [float(layer.valid[row].sum(dim=-1).float().mean()) if layer.is_initialized else 0.0
                 for layer in cache.layers]
                for row in range(len(rows))
            ]
        finally:
            session.detach()
        return [
            {"kv_tokens_per_layer": counts, "kv_tokens_mean": sum(counts) / len(counts),
             "kv_kept_ratio": sum(counts) / len(counts) / ids.numel(), "prompt_tokens": ids.numel()}
            for counts in per_layer
        ]

"""KV memory of each row alone: live and allocated bytes after the prefill and after decoding, and the process peak.

Each row runs by itself (batch of one, so its storage is its own): the first ``--tokens``
tokens of the text as the prompt, then 16 greedy tokens. When the speed task runs in the
same sweep (it runs first), its first run of each row is reused here. ``live`` counts the
tokens kept; ``allocated`` is the storage really held (the budget plus the slots kept free
for the next token). ``peak_rss`` is the process's peak resident memory so far
(``getrusage``): a high-water mark over the whole sweep, not a per-row figure.
``bytes_vs_16bit`` is ``live`` over the bytes a 16-bit cache of the same tokens (prompt and
decoded) takes: the axis of ``--budget-unit memory`` (2.0 for the full cache in fp32). Rows
that store tokens in several formats (precision tiers, transformers' QuantizedCache) also give
their bytes per tier or part in ``kv_tier_bytes``.
"""

from __future__ import annotations

import resource
import sys
from typing import Any

from .base import ALONE_DECODE_STEPS, Context, Row, alone_key, run_alone

MIB = 1024 * 1024


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


class Memory:
    name = "memory"
    description = "live and allocated KV bytes after prefill and decoding, process peak RSS"
    columns = [("kv_live_mib", "KV MiB", "{:.1f}"), ("kv_allocated_mib", "alloc MiB", "{:.1f}"),
               ("bytes_vs_16bit", "vs 16-bit", "{:.2f}")]
    plots = [
        ("memory", "kv_live_mib", "live KV after decoding, MiB"),
        ("memory", "kv_allocated_mib", "allocated KV after decoding, MiB"),
    ]

    def settings(self, ctx: Context) -> dict[str, Any]:
        return {"tokens": ctx.tokens, "decode_steps": ALONE_DECODE_STEPS}

    def tokens_needed(self, ctx: Context) -> int:
        return ctx.tokens

    def run(self, ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
        prompt = ctx.text_ids[: ctx.tokens]
        bytes_16bit = kv_bytes_16bit(ctx.model, prompt.numel() + ALONE_DECODE_STEPS)
        results = []
        for row in ctx.track(rows, len(rows), "memory (one row at a time)", unit="rows",
                             tokens=ctx.tokens + ALONE_DECODE_STEPS):
            run = ctx.memo.get(alone_key(row, prompt)) or run_alone(ctx.model, row.spec, prompt, tokenizer=ctx.tokenizer)
            prefill, end = run["prefill_memory"], run["end_memory"]
            results.append({
                "kv_live_prefill_bytes": prefill["live"],
                "kv_allocated_prefill_bytes": prefill["allocated"],
                "kv_live_bytes": end["live"],
                "kv_allocated_bytes": end["allocated"],
                "policy_state_bytes": end["metadata"],
                "kv_live_mib": end["live"] / MIB,
                "kv_allocated_mib": end["allocated"] / MIB,
                "bytes_vs_16bit": end["live"] / bytes_16bit,
                **({"kv_tier_bytes": end["tiers"]} if end.get("tiers") else {}),
                "peak_rss_bytes": peak_rss_bytes(),
                "prompt_tokens": prompt.numel(),
                "decode_steps": ALONE_DECODE_STEPS,
            })
        return results


def kv_bytes_16bit(model: Any, tokens: int) -> int:
    """The bytes of ``tokens`` tokens' keys and values at 16 bits, over every layer and KV head."""
    from ..hf.session import model_shape

    layers, heads = model_shape(model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return layers * heads * head_dim * 2 * 2 * tokens  # keys and values, 2 bytes each

"""Prefill seconds and decode ms/token of each row alone, against plain transformers in the same run.

Plain transformers is the model with SDPA attention and a ``DynamicCache``, without a
kvpolicy session. Each configuration (plain, then every row) prefills the first
``--tokens`` tokens of the text and decodes ``DECODE_STEPS`` greedy tokens, batch of
one. The configurations are interleaved (A B C, A B C, ...; the order rotates each
round) ``REPEATS`` times and the medians are reported, with ratios to plain (1.0 = as
fast as plain transformers; 2.0 = twice the time). The torch thread count is fixed by
``compare --threads`` and stored with the results: on a 2-core machine a second busy
process can slow multi-threaded torch many times over.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from .base import ALONE_DECODE_STEPS as DECODE_STEPS
from .base import Context, Row, alone_key, run_alone

REPEATS = 3


class Speed:
    name = "speed"
    description = "prefill s and decode ms/token vs plain transformers (SDPA + DynamicCache), medians"
    run_first = True  # before memory, which reuses these runs
    columns = [("prefill_ratio", "prefill x", "{:.2f}"), ("decode_ratio", "decode x", "{:.2f}")]
    plots = [
        ("speed", "prefill_ratio", "prefill time / plain transformers"),
        ("speed", "decode_ratio", "decode time per token / plain transformers"),
    ]

    def settings(self, ctx: Context) -> dict[str, Any]:
        return {"tokens": ctx.tokens, "decode_steps": DECODE_STEPS, "repeats": REPEATS, "threads": torch.get_num_threads()}

    def tokens_needed(self, ctx: Context) -> int:
        return ctx.tokens

    def run(self, ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
        prompt = ctx.text_ids[: ctx.tokens]
        configs: list[Row | None] = [None, *rows]  # None: plain transformers
        prefill: list[list[float]] = [[] for _ in configs]
        decode: list[list[float]] = [[] for _ in configs]
        run_alone(ctx.model, None, prompt[:32], 2)  # warm-up: first calls pay for allocations
        schedule = [(rep, (rep + i) % len(configs)) for rep in range(REPEATS) for i in range(len(configs))]
        for _, index in ctx.track(schedule, len(schedule), f"speed ({len(configs)} configurations x {REPEATS})",
                                 unit="runs", tokens=prompt.numel() + DECODE_STEPS):
            config = configs[index]
            run = run_alone(ctx.model, config.spec if config is not None else None, prompt, DECODE_STEPS,
                            tokenizer=ctx.tokenizer)
            ctx.memo.setdefault(alone_key(config, prompt), run)  # the memory task may reuse it
            prefill[index].append(run["prefill_s"])
            decode[index].append(run["decode_s"] * 1000 / DECODE_STEPS)
        plain_prefill, plain_decode = statistics.median(prefill[0]), statistics.median(decode[0])
        results = []
        for index in range(1, len(configs)):
            row_prefill, row_decode = statistics.median(prefill[index]), statistics.median(decode[index])
            results.append({
                "prefill_s": row_prefill,
                "decode_ms_per_token": row_decode,
                "prefill_ratio": row_prefill / plain_prefill,
                "decode_ratio": row_decode / plain_decode,
                "plain_prefill_s": plain_prefill,
                "plain_decode_ms_per_token": plain_decode,
                "threads": torch.get_num_threads(),
                "prompt_tokens": prompt.numel(),
            })
        return results

"""A RULER-style task as a ``kvpolicy compare`` task: its samples at one length, every sweep row as a batch row.

For each sample all rows read the same prompt in one batch (prefill through each row's
policy cache, eviction after it), then decode greedily from their own evicted caches until
an end-of-sequence token or the task's answer budget (RULER's tokens_to_generate). A row's
score is RULER's: the mean over samples of the share of expected items its answer holds.
"""

from __future__ import annotations

import statistics
from typing import Any

from ...errors import KVPolicyError
from ..base import Context, Row, greedy_continuations
from .haystack import TextHaystack
from .prompt import Sample
from .scoring import all_found, match_share

SAMPLES_PER_TRIAL = 5
#: bumped when a generator changes, so that a results file does not mix old and new samples
GENERATOR_VERSION = 1


class RulerTask:
    """One of RULER's synthetic tasks (``generator``) under its RULER name, e.g. ``niah_single_1``."""

    uses_prompt_tokens = True
    asks_question = True

    def __init__(self, name: str, generator: Any, header: str):
        self.name, self.generator = name, generator
        self.description = generator.description
        self.columns = [("score", header, "{:.0%}")]
        self.plots = [("ruler", "score", f"{name}: RULER score")]

    def settings(self, ctx: Context) -> dict[str, Any]:
        return {"length": ctx.prompt_tokens, "samples": SAMPLES_PER_TRIAL * ctx.trials, "seed": ctx.seed,
                "max_new_tokens": self.generator.max_new_tokens, "generator": GENERATOR_VERSION}

    def tokens_needed(self, ctx: Context) -> int:
        return 0  # the haystack text repeats as needed

    def samples(self, ctx: Context) -> list[Sample]:
        """The task's samples at ``ctx.prompt_tokens`` tokens, from ``ctx.seed`` and the haystack ``ctx.text``."""
        text = ctx.text or ctx.tokenizer.decode(ctx.text_ids.tolist())
        try:
            haystack = TextHaystack(text)
        except ValueError as error:
            raise KVPolicyError(f"{self.name}: {error}: give a --text-file with words in it") from None
        count = SAMPLES_PER_TRIAL * ctx.trials
        out = [self.generator.sample(self.name, ctx.tokenizer, haystack, ctx.prompt_tokens, index, count, ctx.seed)
               for index in range(count)]
        longest = max(len(sample.input_ids) for sample in out)
        if longest > ctx.prompt_tokens:
            raise KVPolicyError(f"{self.name}: --prompt-tokens {ctx.prompt_tokens} is too short for its instructions "
                                f"and needles ({longest} tokens at the least): give a larger --prompt-tokens")
        return out

    def run(self, ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
        samples = self.samples(ctx)
        outputs: list[list[str]] = [[] for _ in rows]
        described = f"{self.name} at {ctx.prompt_tokens} tokens"
        for sample in ctx.track(samples, len(samples), described, rows=len(rows), unit="samples",
                                tokens=lambda s: len(s.input_ids) * len(rows)):
            for row, answer in enumerate(greedy_continuations(ctx, rows, sample.input_ids, sample.max_new_tokens,
                                                                   sample.context_tokens[1])):
                outputs[row].append(answer)
        return [self._metrics(samples, outputs[row]) for row in range(len(rows))]

    def _metrics(self, samples: list[Sample], outputs: list[str]) -> dict[str, Any]:
        scores = [match_share(out, s.answers) for s, out in zip(samples, outputs, strict=True)]
        by_depth: dict[str, list[float]] = {}
        for sample, score in zip(samples, scores, strict=True):
            if sample.depth is not None:
                by_depth.setdefault(f"{sample.depth:g}", []).append(score)
        return {
            "score": statistics.fmean(scores),
            "all_found": statistics.fmean(all_found(o, s.answers) for s, o in zip(samples, outputs, strict=True)),
            "by_depth": {depth: statistics.fmean(values) for depth, values in by_depth.items()},
            "samples": len(samples),
            "prompt_tokens_real": round(statistics.fmean(len(s.input_ids) for s in samples)),
            "items": [{"index": s.index, "depth": s.depth, "needle_depths": [round(s.token_depth(n), 3) for n in s.needles],
                       "answers": s.answers, "output": out, "score": score}
                      for s, out, score in zip(samples, outputs, scores, strict=True)],
        }

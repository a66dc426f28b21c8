"""Passkey retrieval (Mohtashami & Jaggi, 2023): a random 5-digit key hidden in filler text, asked for at the end.

One prompt per (depth, trial), of about ``--prompt-tokens`` tokens, wrapped in the
tokenizer's chat template when it has one, and ending with "The pass key is" so the
answer comes first. All rows run as one batch: the prompt is prefilled (every token
sees the whole prompt; eviction follows), then a few tokens are generated greedily from
the evicted cache; a row passes a prompt when the key appears in its answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from .base import Context, Row, batched_session, forward, prefill

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key?"
ANSWER = "The pass key is"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
NEW_TOKENS = 7  # " 12345." is 7 tokens for digit-splitting tokenizers such as SmolLM2's


@dataclass(frozen=True)
class PasskeyPrompt:
    text: str
    input_ids: list[int]
    key: str
    depth: float
    char_index: int  # text[char_index : char_index + 5] == key (its first mention, inside the needle)
    token_index: int  # the first token whose characters include text[char_index]
    context_end: int  # the first token of the question (its blank line): the context is input_ids[:context_end]


def make_prompt(tokenizer: Any, target_tokens: int, depth: float, seed: Any) -> PasskeyPrompt:
    """A deterministic prompt for (``seed``, ``depth``) of about ``target_tokens`` tokens."""
    key = str(random.Random(f"passkey-{seed}").randint(10000, 99999))
    per_filler = max(1, len(_encode(tokenizer, FILLER)))
    overhead = len(_encode(tokenizer, _wrap(tokenizer, INTRO + NEEDLE.format(key=key))))
    fillers = max(1, (target_tokens - overhead) // per_filler)
    before = round(fillers * depth)
    context = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (fillers - before)
    text = _wrap(tokenizer, context)
    char_index = text.index(NEEDLE.format(key=key)) + NEEDLE.index("{key}")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ends = [end for _, end in encoded["offset_mapping"]]
    token_index = next(i for i, end in enumerate(ends) if end > char_index)
    question = text.rindex(f"\n\n{QUESTION}")
    context_end = next(i for i, end in enumerate(ends) if end > question)
    return PasskeyPrompt(text, list(encoded["input_ids"]), key, depth, char_index, token_index, context_end)


def _wrap(tokenizer: Any, context: str) -> str:
    question = f"{context}\n\n{QUESTION}"
    if getattr(tokenizer, "chat_template", None):
        chat = [{"role": "user", "content": question}]
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + ANSWER
    return f"{question} {ANSWER}"


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class Passkey:
    uses_prompt_tokens = True
    asks_question = True
    name = "passkey"
    description = "retrieve a 5-digit key hidden at several depths of filler text"
    columns = [("accuracy", "passkey", "{:.0%}")]
    plots = [("quality", "accuracy", "passkey accuracy")]

    def settings(self, ctx: Context) -> dict[str, Any]:
        return {"prompt_tokens": ctx.prompt_tokens, "depths": list(DEPTHS), "trials": ctx.trials, "seed": ctx.seed}

    def tokens_needed(self, ctx: Context) -> int:
        return 0

    def prompts(self, ctx: Context) -> list[PasskeyPrompt]:
        return [
            make_prompt(ctx.tokenizer, ctx.prompt_tokens, depth, f"{ctx.seed}-{trial}-{index}")
            for trial in range(ctx.trials)
            for index, depth in enumerate(DEPTHS)
        ]

    def run(self, ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
        prompts = self.prompts(ctx)
        hits = torch.zeros(len(rows), len(prompts), dtype=torch.bool)
        answers: list[list[str]] = [[] for _ in rows]
        for index, prompt in enumerate(ctx.track(prompts, len(prompts), "passkey", rows=len(rows),
                                                          unit="prompts", tokens=lambda p: len(p.input_ids) * len(rows))):
            for row, answer in enumerate(greedy_answers(ctx, rows, prompt.input_ids, NEW_TOKENS, prompt.context_end)):
                hits[row, index] = prompt.key in answer
                answers[row].append(answer)
        depths = torch.tensor([p.depth for p in prompts])
        return [
            {
                "accuracy": float(hits[row].float().mean()),
                "by_depth": {f"{d:g}": float(hits[row, depths == d].float().mean()) for d in DEPTHS},
                "prompts": len(prompts),
                "prompt_tokens_real": len(prompts[0].input_ids),
                "answers": answers[row],
            }
            for row in range(len(rows))
        ]


def greedy_answers(ctx: Context, rows: list[Row], input_ids: list[int], new_tokens: int,
                   context_end: int = 0) -> list[str]:
    """Each row's greedy continuation of the same prompt, decoded (``context_end``: where the question starts, read
    after the context is compressed when ``ctx.question`` is "after")."""
    model, batch = ctx.model, len(rows)
    session = batched_session(model, rows, tokenizer=ctx.tokenizer)
    try:
        cache = session.new_cache()
        ids = torch.tensor([input_ids]).expand(batch, -1)
        generated = []
        with torch.inference_mode():
            for step in range(new_tokens):
                logits = prefill(ctx, ids, cache, context_end) if step == 0 else forward(model, ids, cache).logits[:, -1]
                ids = logits.argmax(dim=-1, keepdim=True)
                generated.append(ids)
    finally:
        session.detach()
    tokens = torch.cat(generated, dim=1)
    return [ctx.tokenizer.decode(tokens[row], skip_special_tokens=True) for row in range(batch)]

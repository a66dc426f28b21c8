"""What every compare task shares: the rows of a sweep, the run context, the task interface, forward helpers.

A task measures every row of a sweep (one recipe at one budget) and returns one dict of
metrics per row, in the rows' order. Tasks that can, run all rows as rows of one batch
(`attach_rows`), so the sweep shares forward passes.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import KVPolicyError
from ..hf.session import attach, attach_rows, cache_keyword
from ..recipe.budget import Budget


@dataclass(frozen=True)
class Row:
    """One line of a sweep: a recipe (``spec``: a Recipe or Plan, budget applied) under a label.

    A ``spec`` with an ``open_session(model)`` method (transformers' QuantizedCache:
    `kvpolicy.tasks.quantized_baseline`) makes its own caches instead of a kvpolicy session's, in a batch of one.
    """

    recipe: str  # label shown in tables and plots
    # canonical budget text ("0.2" = 20%, "512" = tokens); None: no recipe budget applies (run once)
    budget: str | None
    spec: Any
    value: Budget | None = None
    # with no recipe budget: True if its policies still evict by budgets of their own (FastGen), else it keeps all
    evicts: bool = False
    # keeps every token, but some at lower precision (a budget with tiers and no amount: kivi)
    quantized: bool = False

    @property
    def is_full(self) -> bool:
        """The row keeps every token (a baseline), rather than evicting by a budget of the recipe's or its own."""
        return self.budget is None and not self.evicts and not self.quantized

    @property
    def label(self) -> str:
        return self.recipe if self.budget is None else f"{self.recipe}@{self.budget}"


@dataclass
class Context:
    """Everything a task may use: the model, the text's token ids, the sweep's sizes, progress bars."""

    model: Any
    tokenizer: Any
    text_ids: torch.Tensor  # [T] int64, the whole evaluation text
    tokens: int = 1024  # evaluation length: perplexity tokens; prompt length for memory and speed
    prompt_tokens: int = 512  # prompt length for passkey and fidelity
    new_tokens: int = 32  # tokens fidelity scores after each prompt (a long generation: e.g. 1,000)
    seed: int = 0
    trials: int = 1
    ppl_mode: str = "token"
    options: dict[str, Any] = field(default_factory=dict)  # extra settings for plugin tasks
    memo: dict[Any, Any] = field(default_factory=dict)  # results tasks share within one sweep (see `run_alone`)
    progress: Any = None  # a kvpolicy.tasks.progress.Progress, or None for silence
    text: str = ""  # the evaluation text itself (the haystack of the RULER-style tasks)
    #: where a task's question goes: "in-prompt" (inside the prompt that is compressed) or "after" (the context is
    #: prefilled and compressed first, then the question comes and is answered from the compressed cache)
    question: str = "in-prompt"

    def track(self, iterable: Iterable, total: int | None = None, description: str = "", *, rows: int = 1,
              unit: str = "steps", tokens: int | Callable[[Any], int] = 0) -> Iterator:
        """Iterate, reporting progress when the sweep shows it: steps done, ``rows`` in the batch, tokens/s
        (``tokens``: per step, or a function of the item) and the time left."""
        if self.progress is None:
            yield from iterable
            return
        with self.progress.task(description, total if total is not None else len(iterable), rows, unit) as task:
            for item in iterable:
                yield item
                task.advance(1, tokens(item) if callable(tokens) else tokens)


@runtime_checkable
class Task(Protocol):
    """A compare task. ``columns``: (metric, header, format) for the table; ``plots``: (figure, metric, axis label).

    Optional: ``run_first = True`` runs the task before the others (speed, so that memory
    can reuse its runs through ``Context.memo``).
    """

    name: str
    description: str
    columns: list[tuple[str, str, str]]
    plots: list[tuple[str, str, str]]

    def settings(self, ctx: Context) -> dict[str, Any]:
        """The settings its results depend on (stored with each row; a change reruns the task)."""
        ...

    def tokens_needed(self, ctx: Context) -> int:
        """How many tokens of the evaluation text it reads (0 for synthetic prompts)."""
        ...

    def run(self, ctx: Context, rows: list[Row]) -> list[dict[str, Any]]:
        """One dict of metrics per row, in the rows' order."""
        ...


# --- forward helpers ---------------------------------------------------------------------------------


def forward(model: Any, ids: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
    """``model(ids)`` continuing ``cache`` (a PolicyCache or DynamicCache).

    ``ids`` go to the model's device (``--device``) and the logits come back to the CPU, so tasks do their
    arithmetic on CPU tensors whatever device the model runs on.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        output = model(input_ids=ids.to(model.device), use_cache=True, **{cache_keyword(model): cache}, **kwargs)
    output.logits = output.logits.cpu()
    return output


def batched_session(model: Any, rows: list[Row], tokenizer: Any = None):
    """One kvpolicy session where batch row i follows ``rows[i]`` (``tokenizer``: for policies that read it).

    A row whose spec opens its own session (see `Row`) runs alone: its session, for a batch of one.
    """
    own = [row for row in rows if hasattr(row.spec, "open_session")]
    if own:
        if len(rows) > 1:
            raise KVPolicyError(f"{own[0].label} runs in a batch of its own, not with {len(rows) - 1} other rows")
        return own[0].spec.open_session(model)
    return attach_rows(model, [row.spec for row in rows], tokenizer=tokenizer)


def text_segments(ctx: Context, length: int, count: int) -> list[torch.Tensor]:
    """``count`` seeded, evenly spread segments of ``length`` tokens from the evaluation text."""
    total = ctx.text_ids.numel()
    span = max(0, total - length)
    generator = torch.Generator().manual_seed(ctx.seed)
    jitter = torch.randint(0, max(1, span // max(count, 1) // 4 + 1), (count,), generator=generator)
    starts = [min(span, i * span // max(count, 1) + int(jitter[i])) for i in range(count)]
    return [ctx.text_ids[start : start + length] for start in starts]


def kept_tokens(cache: Any, row: int) -> float:
    """Mean tokens kept per (layer, KV head) for batch row ``row`` of a PolicyCache (or of a cache that says)."""
    if hasattr(cache, "kept_tokens"):
        return cache.kept_tokens(row)
    counts = [layer.valid[row].sum(dim=-1).float().mean() for layer in cache.layers if layer.is_initialized]
    return float(torch.stack(counts).mean()) if counts else 0.0


ALONE_DECODE_STEPS = 16


def alone_key(row: Row | None, ids: torch.Tensor) -> tuple:
    """Memo key of a `run_alone` run of ``row`` (None: plain transformers) on ``ids``, for tasks to share."""
    return ("alone", row.label if row is not None else "plain", ids.numel(), ALONE_DECODE_STEPS)


def run_alone(
    model: Any, spec: Any, ids: torch.Tensor, steps: int = ALONE_DECODE_STEPS, tokenizer: Any = None
) -> dict[str, Any]:
    """Prefill ``ids`` then decode ``steps`` greedy tokens, batch of one, timed.

    ``spec`` is a recipe (a kvpolicy session with its PolicyCache) or None for plain
    transformers: SDPA attention and a DynamicCache. Returns the seconds of prefill and of
    decoding, and the cache (PolicyCache reports memory) after each phase.
    """
    from transformers import DynamicCache

    if spec is None:
        session = None
    elif hasattr(spec, "open_session"):  # a cache from outside kvpolicy (see `Row`)
        session = spec.open_session(model)
    else:
        session = attach(model, spec, tokenizer=tokenizer)
    previous = model.config._attn_implementation
    if session is None and previous != "sdpa":
        model.set_attn_implementation("sdpa")
    try:
        cache = session.new_cache() if session is not None else DynamicCache(config=model.config)
        with torch.inference_mode():
            started = time.perf_counter()
            token = forward(model, ids[None], cache).logits[:, -1].argmax(dim=-1, keepdim=True)
            prefill = time.perf_counter() - started
            after_prefill = memory_of(cache)
            started = time.perf_counter()
            for _ in range(steps):
                token = forward(model, token, cache).logits[:, -1].argmax(dim=-1, keepdim=True)
            decode = time.perf_counter() - started
        return {"prefill_s": prefill, "decode_s": decode, "prefill_memory": after_prefill, "end_memory": memory_of(cache)}
    finally:
        if session is not None:
            session.detach()
        elif previous != "sdpa":
            model.set_attn_implementation(previous)


def memory_of(cache: Any) -> dict[str, int]:
    """Live and allocated KV bytes of a PolicyCache (or a cache with a ``memory_report``, and its bytes per precision
    tier where it has tiers), or of a DynamicCache (where both are its tensors' bytes)."""
    if hasattr(cache, "memory_report"):
        report = cache.memory_report()
        tiers = report.tier_bytes() if hasattr(report, "tier_bytes") else {}
        return {"live": report.live_kv_bytes, "allocated": report.allocated_kv_bytes, "metadata": report.metadata_bytes,
                **({"tiers": tiers} if tiers else {})}
    size = sum(
        t.untyped_storage().nbytes()
        for layer in cache.layers
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    )
    return {"live": size, "allocated": size, "metadata": 0}


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The token ids that end an answer: the tokenizer's end of sequence and the model's generation config's."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    return {i for i in ids if isinstance(i, int)}


def prefill(ctx: Context, ids: torch.Tensor, cache: Any, context_end: int) -> torch.Tensor:
    """Read a prompt ``ids`` [B, n] into ``cache``; the last token's logits [B, V]. With ``ctx.question`` "after"
    (kvpress's protocol), the context (``ids[:, :context_end]``) is read and compressed first, then the rest (the
    question) is read and kept whole, as are the answer's tokens: nothing is evicted after the context."""
    if ctx.question == "in-prompt":
        return forward(ctx.model, ids, cache).logits[:, -1]
    if ctx.question != "after":
        raise KVPolicyError(f"unknown question track {ctx.question!r}: in-prompt or after")
    if not 0 < context_end < ids.shape[1]:
        raise KVPolicyError(f"the question of a prompt of {ids.shape[1]} tokens cannot start at token {context_end}")
    forward(ctx.model, ids[:, :context_end], cache, logits_to_keep=1)
    if hasattr(cache, "stop_evicting"):  # a cache from outside kvpolicy evicts nothing anyway
        cache.stop_evicting()
    return forward(ctx.model, ids[:, context_end:], cache).logits[:, -1]


def greedy_continuations(ctx: Context, rows: list[Row], input_ids: list[int], max_new_tokens: int,
                         context_end: int = 0) -> list[str]:
    """Each row's greedy continuation of the same prompt (one batch), decoded; a row stops at an end-of-sequence
    token, and decoding stops when every row has. ``context_end``: where the question starts (see `prefill`)."""
    model, batch = ctx.model, len(rows)
    stop = torch.tensor(sorted(eos_ids(model, ctx.tokenizer)) or [-1])
    session = batched_session(model, rows, tokenizer=ctx.tokenizer)
    generated: list[torch.Tensor] = []
    try:
        cache = session.new_cache()
        ids = torch.tensor([input_ids]).expand(batch, -1)
        finished = torch.zeros(batch, dtype=torch.bool)
        with torch.inference_mode():
            for step in range(max_new_tokens):
                logits = prefill(ctx, ids, cache, context_end) if step == 0 else forward(model, ids, cache).logits[:, -1]
                ids = logits.argmax(dim=-1, keepdim=True)
                generated.append(torch.where(finished[:, None], -1, ids))
                finished |= torch.isin(ids[:, 0], stop)
                if bool(finished.all()):
                    break
    finally:
        session.detach()
    tokens = torch.cat(generated, dim=1) if generated else torch.zeros(batch, 0, dtype=torch.long)
    return [ctx.tokenizer.decode([t for t in tokens[row].tolist() if t >= 0], skip_special_tokens=True)
            for row in range(batch)]

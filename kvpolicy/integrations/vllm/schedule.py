"""When a request evicts, and which of its blocks are then empty: one rule, run alike by vLLM's scheduler and worker.

A paged engine splits a request's KV blocks in two: the *arena*, its first ``ceil(budget / block_size)`` logical
blocks, whose first ``budget`` slots hold the tokens each KV head keeps (heads choose different tokens within the
same slots), and the blocks after it. An eviction, at the start of a step, ranks every token the request holds,
keeps each head's ``budget`` best at the arena's front, and packs the tokens that arrive after it right behind
them (`RequestSchedule.compact`), so the engine's own kernel reads every request through a block table and a
length. The blocks between the arena and the first one written since are then empty: the scheduler frees them at
the start of that step (the worker's compaction reads them in each layer before the step's tokens are written
there); the worker, which is never told which blocks were freed, works out the same layout from the same rule.

The rule is kvpolicy's own (`kvpolicy.cache.budgets.CellBudgets`): once a request holds more than ``budget + slack``
tokens it is cut back to ``budget``, and so is a request over budget whose step starts in a later block than its last
eviction did (``align``, the block size: `Budget.align`), so that what arrives between two evictions lies in one
block; a ratio budget resolves from the prompt's length, known once the prompt is in, or, with
``evict_during_prefill``, as soon as the request arrives (vLLM knows its prompt's length), so that a long prompt
evicts between the chunks of a chunked prefill as a token budget does. It is decided at step starts (before the step's
new tokens), which is where kvpolicy's transformers path stands after a forward pass. Both sides see the same step
starts: the tokens a request had processed each time it was scheduled (vLLM's ``num_computed_tokens``), and whether
its prompt was still coming in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...recipe.budget import Budget


def arena_blocks(budget: int, block_size: int) -> int:
    return -(-budget // block_size)


def evicts_during_prefill(rules: tuple[Budget, ...], evict_during_prefill: bool) -> bool:
    """Whether a request frees blocks while its prompt comes in: blocks are freed only once every rule has evicted,
    and a ratio budget without ``evict_during_prefill`` waits for the whole prompt."""
    return evict_during_prefill or all(rule.tokens is not None for rule in rules)


def most_blocks(rules: tuple[Budget, ...], slack: int, block_size: int, prompt_tokens: int, total_tokens: int,
                step_tokens: int | None = None, evict_during_prefill: bool = False, align: int = 0) -> int:
    """The most blocks a request ever holds, whatever vLLM's chunking: ``prompt_tokens`` come in at most
    ``step_tokens`` a step (vLLM's max_num_batched_tokens; None: at once), then one a step up to ``total_tokens``
    (the prompt and its ``max_tokens``, within max_model_len). Once every rule has evicted, a request holds the
    largest arena and the blocks spanned by what came in since the oldest of the rules' last evictions (at most
    the slack, as the step that passes it evicts) and one step's tokens: ``n`` tokens in a row touch at most
    ``ceil((n - 1) / block_size) + 1`` blocks. Before, or while a ratio budget waits for the whole prompt, it holds
    everything it has. `spec.KVPolicyManager` reserves this for each request."""
    whole = -(-total_tokens // block_size)
    budgets = [rule.limit_for(prompt_tokens) for rule in rules]
    if not budgets or any(budget is None for budget in budgets):
        return whole
    prompt_blocks = -(-prompt_tokens // block_size)
    prefill = (min(prompt_blocks, _evicting(budgets, slack, block_size, step_tokens or prompt_tokens))
               if evicts_during_prefill(rules, evict_during_prefill) else prompt_blocks)
    decode = decoding_blocks(rules, slack, block_size, prompt_tokens, total_tokens, align) \
        if total_tokens > prompt_tokens else 0
    return min(whole, max(prefill, decode))


def decoding_blocks(rules: tuple[Budget, ...], slack: int, block_size: int, prompt_tokens: int, total_tokens: int,
                    align: int = 0) -> int:
    """The most blocks a request holds once its prompt is in (see `most_blocks`). With
    evictions aligned to blocks (``align == block_size``) and every rule's first eviction made by the first decode
    step, the tokens since the last eviction lie in the block the step starts in: one block past the arena."""
    budgets = [rule.limit_for(prompt_tokens) for rule in rules]
    whole = -(-total_tokens // block_size)
    if not budgets or any(budget is None for budget in budgets):
        return whole
    settled = all(prompt_tokens > budget + slack and prompt_tokens >= arena_blocks(budget, block_size) * block_size
                  for budget in budgets)
    if align == block_size and settled:
        return min(whole, max(arena_blocks(budget, block_size) for budget in budgets) + 1)
    return min(whole, _evicting(budgets, slack, block_size, 1))


def _evicting(budgets: list[int], slack: int, block_size: int, step: int) -> int:
    """Blocks held once every rule has evicted, ``step`` tokens a step: the largest arena, and what came in since
    the oldest last eviction (at most the slack) and one step's tokens, ``n`` in a row touching at most
    ``ceil((n - 1) / block_size) + 1`` blocks."""
    arena = max(arena_blocks(budget, block_size) for budget in budgets)
    return arena + -(-(slack + step - 1) // block_size) + 1


@dataclass
class RuleState:
    budget: int | None = None
    held: int = 0  # tokens held right after the decision at the last step start
    evicted_at: int | None = None  # the step start of the last eviction


@dataclass
class RequestSchedule:
    """One request's evictions under every distinct layer budget of a recipe (``rules``: a `Budget` each, its
    amount only)."""

    rules: tuple[Budget, ...]
    slack: int
    block_size: int
    evict_during_prefill: bool = False  # take the prompt's length from the first step, not once the prompt is in
    align: int = 0  # also evict a request over budget whose step starts in a later block of this many positions
    prompt_tokens: int | None = None  # known at the first step start past the prompt (or at the first step)
    last_start: int = 0
    started: bool = False
    states: list[RuleState] = field(default_factory=list)
    last_decision: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        self.states = [RuleState() for _ in self.rules]
        self.last_decision = (False,) * len(self.rules)

    def start_step(self, start: int, prefilling: bool, prompt_tokens: int | None = None) -> tuple[bool, ...]:
        """Which rules evict at the step that starts with ``start`` tokens processed (asked again: the same answer).
        ``prompt_tokens``: the prompt's length, which both sides know, read with ``evict_during_prefill``."""
        if self.started and start == self.last_start:
            return self.last_decision
        if start < self.last_start:
            raise ValueError(f"a request's steps go forward: step start {start} after {self.last_start}")
        if self.prompt_tokens is None and self.evict_during_prefill and prompt_tokens is not None:
            self.prompt_tokens = prompt_tokens
        if self.prompt_tokens is None and not prefilling:
            self.prompt_tokens = start
        added = start - self.last_start
        decision = []
        for rule, state in zip(self.rules, self.states, strict=True):
            if state.budget is None:
                state.budget = rule.limit_for(self.prompt_tokens)
            count = state.held + added
            crossed = (self.align > 0 and state.evicted_at is not None
                       and start // self.align > state.evicted_at // self.align)
            evict = (state.budget is not None and (count > state.budget + self.slack or
                                                   (crossed and count > state.budget))
                     and start >= arena_blocks(state.budget, self.block_size) * self.block_size)
            state.held = state.budget if evict else count
            if evict:
                state.evicted_at = start
            decision.append(evict)
        self.started, self.last_start, self.last_decision = True, start, tuple(decision)
        return self.last_decision

    @property
    def decoding(self) -> bool:
        """Whether the request's prompt is in: its last step start is at or past it."""
        return self.prompt_tokens is not None and self.last_start >= self.prompt_tokens

    def arena(self, rule: int) -> int:
        """Arena blocks of a rule (0 while its budget is unknown)."""
        budget = self.states[rule].budget
        return arena_blocks(budget, self.block_size) if budget is not None else 0

    def compact(self, rule: int, end: int) -> tuple[list[int], int, int]:
        """How a rule's layers lay out a request's tokens for the engine's attention kernel when ``end`` tokens are
        in: (the logical blocks in the order the kernel reads them, the tokens they hold from their first slot on,
        the shift from a position to its slot). Hole-free: before the rule's first eviction, every token at its
        position; after one, the arena's first ``budget`` slots hold the kept tokens (each KV head its own) and
        the tokens since the eviction follow, position ``p`` at slot ``p - shift``, in the arena's free tail and
        then the blocks vLLM allocated for them. Those blocks are never among `empty_blocks` and vLLM has
        allocated them already: slot ``p - shift`` falls in a block no later than position ``p``'s own."""
        state = self.states[rule]
        if state.evicted_at is None:
            return list(range(-(-end // self.block_size))), end, 0
        shift = state.evicted_at - state.budget
        length = end - shift
        arena, first = self.arena(rule), state.evicted_at // self.block_size
        blocks = [j if j < arena else first + j - arena for j in range(-(-length // self.block_size))]
        return blocks, length, shift

    def empty_blocks(self) -> tuple[int, int]:
        """Logical blocks [lo, hi) that every rule has emptied (lo >= hi: none)."""
        if any(state.evicted_at is None for state in self.states):
            return 0, 0
        lo = max(self.arena(index) for index in range(len(self.rules)))
        hi = min(state.evicted_at for state in self.states) // self.block_size
        return lo, hi

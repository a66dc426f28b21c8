"""FastGen (Ge et al., "Model Tells You What to Discard: Adaptive KV Cache Compression for LLMs", ICLR 2024).

Each (layer, KV head) gets the cheapest *pattern* that still recovers a share ``threshold``
(T) of its attention on the prompt, and keeps to it while decoding. A pattern is a union of
components, or ``full``:

* ``special``: tokens whose id is a special token (``<|im_start|>``, BOS, ...);
* ``punct``: punctuation tokens (".", ",", ":", ")", ...);
* ``local``: the ``ceil(local_ratio x L)`` most recent tokens, L the tokens seen so far;
* ``frequency``: the ``ceil(frequency_ratio x L)`` tokens with the highest accumulated
  attention (H2O's score: prompt column sums, then one row per decode step), among the
  tokens the other components of the pattern do not already keep.

The candidates are tried in order of memory cost; the paper's list (the default) is
special, special+punct, special+punct+frequency, special+punct+frequency+local, full.

**Profiling** (the first attention call of each layer, i.e. the prompt). For each candidate C
and each query head, the recovery is the mean over the prompt's queries of the attention
that falls on the tokens C keeps *for that query*: sum_j A[i, j] M_C[i, j], with M_C[i, j]
the token-set components, plus ``local`` relative to query i itself (i - j < ceil(r_l n)),
plus the frequency set, chosen once from the column sums of the whole prompt as at decode
time. No T x T matrix is needed: the attention backend returns, per query head, the column
sums over all queries (``colsum_heads``) and over the queries within the local band of each
key (``near_colsum_heads``), both in its chunked pass. Then

    recovery(C) = (sum_j near[j] + sum_{j in X_C} (colsum[j] - near[j])) / n    when C has local,
    recovery(C) = sum_{j in X_C} colsum[j] / n                                 otherwise,

X_C being C's token sets (special, punct, frequency). With ``recovery: mass`` a candidate
passes when that is >= T (the operational reading of the paper: "accumulated attention
score > T"); with ``recovery: l1`` when the L1 distance of the renormalized rows to the
original ones, 2 (1 - mass), is <= 1 - T, i.e. mass >= (1 + T) / 2. Of the candidates that
pass, the one keeping the fewest tokens on this prompt wins (the list order breaks ties);
``full`` always passes.

**GQA** (the paper used MHA models only and left GQA open). A KV head's cache serves its G
query heads, so it gets one pattern, and each query head's recovery is measured on its own
attention. ``gqa: min`` (default) requires every query head of the group to reach T, so
that no head loses more than the target; ``gqa: mean`` averages the G recoveries, which picks
cheaper patterns but lets one head of a group lose much more than 1 - T. The frequency
ranking itself uses the group's mean column sums, as every other kvpolicy policy does.

**Decoding.** Each head keeps its pattern: special and punctuation tokens stay (and are
added only when one occurs), the local window slides, the frequency part keeps its top
share of the tokens outside the other components, ``full`` keeps everything. The budgets
are shares of the current length, so the cache grows with the sequence; the policy sets
each cell's budget at every eviction (``dynamic_budget``) and the cache stores each head
in memory sized to its own budget (ragged storage). A recipe's ``budget`` does not apply.

``pattern`` fixes one pattern for every head this policy owns and skips profiling:
``kvpolicy profile`` writes recipes that give each head its profiled pattern that way, so
a profile can ship with a model. Token sets come from the tokenizer (``attach(...,
tokenizer=...)``) unless ``special_tokens`` / ``punct_tokens`` list them (ids, or token
strings that the tokenizer turns into one id each). ``sinks`` counts the first tokens of
each row as special tokens: the paper's models start every prompt with ``<s>``, which is
also their attention sink; for tokenizers that add no such token the first token plays
that part (0 = the paper).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import KVPolicyError, did_you_mean
from .base import AttentionStats, Policy, TokenView, ranks

COMPONENTS = ("special", "punct", "frequency", "local")
SPECIAL, PUNCT, FREQUENCY, LOCAL, FULL = 1, 2, 4, 8, 16
BITS = {"special": SPECIAL, "punct": PUNCT, "frequency": FREQUENCY, "local": LOCAL}
PAPER_CANDIDATES = ("special", "special+punct", "special+punct+frequency", "special+punct+frequency+local", "full")


def parse_pattern(text: str) -> int:
    """``"special+punct"`` -> its bits; ``"full"`` -> FULL. Raises ValueError naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a pattern must be a name such as 'special+punct' or 'full', got {text!r}")
    if text.strip() == "full":
        return FULL
    bits = 0
    for part in (p.strip() for p in text.split("+")):
        if part not in BITS:
            hint = did_you_mean(part, (*COMPONENTS, "full"))
            raise ValueError(
                f"unknown pattern component {part!r} in {text!r}{hint}; "
                f"patterns join {', '.join(COMPONENTS)} with '+', or are 'full'"
            )
        if bits & BITS[part]:
            raise ValueError(f"pattern {text!r} names {part!r} twice")
        bits |= BITS[part]
    return bits


def pattern_name(bits: int) -> str:
    """The canonical name of a pattern's bits (components in the order special, punct, frequency, local)."""
    if bits & FULL or bits == 0:
        return "full" if bits & FULL else "unprofiled"
    return "+".join(name for name in COMPONENTS if bits & BITS[name])


def share(ratio: float, tokens: torch.Tensor) -> torch.Tensor:
    """ceil(ratio x tokens), at least 1 (int64); the tiny epsilon keeps 0.3 x 10 at 3, not 4."""
    return torch.ceil(tokens.double() * ratio - 1e-9).long().clamp(min=1)


def is_punctuation(text: str) -> bool:
    """A token's text is punctuation when it has some non-space character and all of them are punctuation."""
    text = text.strip()
    return bool(text) and all(unicodedata.category(ch).startswith("P") for ch in text)


def tokenizer_token_sets(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(special ids, punctuation ids) of a tokenizer: its special tokens; tokens whose text is all punctuation.

    Punctuation follows Unicode (category P: . , : ; ! ? ' " ( ) [ ] - _ ...), not symbols such as
    + = < > $. Decoding the whole vocabulary once takes about half a second for 49K tokens; the
    result is kept on the tokenizer.
    """
    cached = getattr(tokenizer, "_kvpolicy_token_sets", None)
    if cached is not None:
        return cached
    special = set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    for index, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            special.add(int(index))
    size = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(size)])
    punct = [i for i, text in enumerate(texts) if i not in special and is_punctuation(text)]
    result = (sorted(special), punct)
    try:
        tokenizer._kvpolicy_token_sets = result
    except AttributeError:  # a tokenizer that takes no attributes: recompute next time
        pass
    return result


@dataclass(frozen=True)
class FastGenParams:
    # T: the share of each head's prompt attention its pattern must recover (paper: 0.91 to 0.98)
    threshold: float = 0.95
    # r_l: the local component keeps the ceil(local_ratio x L) most recent tokens (paper: 0.3)
    local_ratio: float = 0.3
    # r_f: the frequency component keeps the ceil(frequency_ratio x L) most attended other tokens (paper: 0.3)
    frequency_ratio: float = 0.3
    # how recovery is measured: "mass" (attention kept >= T) or "l1" (L1 error of the renormalized rows
    # <= 1 - T, i.e. mass >= (1 + T) / 2)
    recovery: str = "mass"
    # how the G query heads of a KV head combine: "min" (every one reaches T) or "mean"
    gqa: str = "min"
    # patterns tried, each a '+'-joined set of special, punct, frequency, local, or "full"; the cheapest on
    # the prompt that reaches T wins (full is the fallback)
    candidates: tuple[str, ...] = PAPER_CANDIDATES
    # a fixed pattern for every head of this policy, no profiling (what `kvpolicy profile` writes)
    pattern: str | None = None
    # special token ids (or token strings); none: the tokenizer's special tokens
    special_tokens: tuple[int | str, ...] | None = None
    # punctuation token ids (or token strings); none: the tokenizer's tokens whose text is all punctuation
    punct_tokens: tuple[int | str, ...] | None = None
    # the first `sinks` tokens of each row count as special tokens (0: the paper)
    sinks: int = 0

    def validate(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError("threshold must be in (0, 1]")
        if not 0.0 < self.local_ratio <= 1.0:
            raise ValueError("local_ratio must be in (0, 1]")
        if not 0.0 < self.frequency_ratio <= 1.0:
            raise ValueError("frequency_ratio must be in (0, 1]")
        if self.recovery not in ("mass", "l1"):
            raise ValueError('recovery must be "mass" or "l1"')
        if self.gqa not in ("min", "mean"):
            raise ValueError('gqa must be "min" or "mean"')
        if not self.candidates:
            raise ValueError("candidates must list at least one")
        for candidate in self.candidates:
            parse_pattern(candidate)  # names the unknown component
        if self.pattern is not None:
            parse_pattern(self.pattern)
        if self.sinks < 0:
            raise ValueError("sinks must be >= 0")
        for token in (*(self.special_tokens or ()), *(self.punct_tokens or ())):
            if isinstance(token, bool) or not isinstance(token, (int, str)) or token == "" or (
                isinstance(token, int) and token < 0
            ):
                raise ValueError("special_tokens and punct_tokens list token ids >= 0 or non-empty token strings")


class FastGen(Policy):
    name = "fastgen"
    description = "per-head patterns profiled on the prompt: special, punctuation, local, frequent tokens, or full"
    Params = FastGenParams
    dynamic_budget = True  # the recipe's budget does not apply: the policy sets each head's budget
    needs = frozenset({"colsum"})
    profile_needs = frozenset({"colsum_heads", "near_colsum_heads"})
    needs_token_ids = True
    state = {"acc": torch.float32}
    cell_state = {"pattern": torch.int16, "recovery": torch.float32}

    def __init__(self, params: FastGenParams | None = None) -> None:
        super().__init__(params)
        params = self.params
        self.fixed = parse_pattern(params.pattern) if params.pattern is not None else None
        self.candidates = [parse_pattern(c) for c in params.candidates]
        if FULL not in self.candidates:
            self.candidates.append(FULL)  # the fallback: a head no candidate serves keeps everything
        self.near_ratio = params.local_ratio
        self.target = params.threshold if params.recovery == "mass" else (1.0 + params.threshold) / 2.0
        possible = self.candidates if self.fixed is None else [self.fixed]
        bits = 0
        for pattern in possible:
            bits |= pattern
        # what this instance really uses: a fixed pattern without frequency reads no statistics, one without
        # special/punct no token ids, and a fixed pattern needs no profile
        self.needs = frozenset({"colsum"}) if bits & FREQUENCY else frozenset()
        self.state = {"acc": torch.float32} if bits & FREQUENCY else {}
        self.profile_needs = type(self).profile_needs if self.fixed is None else frozenset()
        self.needs_token_ids = bool(bits & (SPECIAL | PUNCT))
        self.special_table: torch.Tensor | None = None  # [vocab] bool lookup tables, set by `prepare`
        self.punct_table: torch.Tensor | None = None
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    # --- setup -------------------------------------------------------------------------------------------
    def prepare(self, model: Any = None, tokenizer: Any = None) -> None:
        if not self.needs_token_ids:
            return
        params = self.params
        from_tokenizer = None
        if params.special_tokens is None or params.punct_tokens is None:
            if tokenizer is None:
                missing = [n for n in ("special_tokens", "punct_tokens") if getattr(params, n) is None]
                raise KVPolicyError(
                    "policy 'fastgen' needs the model's tokenizer to find its special and punctuation tokens: "
                    "attach(model, recipe, tokenizer=tokenizer), or list them in the recipe's params "
                    f"({', '.join(missing)})"
                )
            from_tokenizer = tokenizer_token_sets(tokenizer)
        special = self._ids(params.special_tokens, tokenizer, "special_tokens") if params.special_tokens is not None \
            else from_tokenizer[0]
        punct = self._ids(params.punct_tokens, tokenizer, "punct_tokens") if params.punct_tokens is not None \
            else from_tokenizer[1]
        size = max([len(tokenizer) if tokenizer is not None else 0, _vocab_size(model), *(i + 1 for i in special),
                    *(i + 1 for i in punct), 1])
        self.special_table = torch.zeros(size, dtype=torch.bool)
        self.special_table[special] = True
        self.punct_table = torch.zeros(size, dtype=torch.bool)
        self.punct_table[punct] = True
        self.special_ids, self.punct_ids = list(special), list(punct)
        self._tables = {}

    @staticmethod
    def _ids(tokens: tuple[int | str, ...], tokenizer: Any, name: str) -> list[int]:
        ids = []
        for token in tokens:
            if isinstance(token, int):
                ids.append(token)
                continue
            if tokenizer is None:
                raise KVPolicyError(
                    f"policy 'fastgen': {name} lists the token string {token!r}, which needs the tokenizer: "
                    "attach(model, recipe, tokenizer=tokenizer), or give token ids"
                )
            found = tokenizer.convert_tokens_to_ids(token)
            if not isinstance(found, int) or found == getattr(tokenizer, "unk_token_id", None):
                encoded = tokenizer(token, add_special_tokens=False)["input_ids"]
                if len(encoded) != 1:
                    raise KVPolicyError(
                        f"policy 'fastgen': {name} entry {token!r} is not one token of this tokenizer "
                        f"(it encodes to {len(encoded)} tokens: {encoded}); give token ids instead"
                    )
                found = encoded[0]
            ids.append(int(found))
        return ids

    def _lookup(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.special_table is None:
            raise KVPolicyError("policy 'fastgen' was not prepared: attach it with kvpolicy.attach(...)")
        if device not in self._tables:
            self._tables[device] = (self.special_table.to(device), self.punct_table.to(device))
        return self._tables[device]

    # --- the pattern's token sets ----------------------------------------------------------------------------
    def _patterns(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        """[B, Hkv] pattern bits of each cell (0: not profiled yet, which keeps everything)."""
        if self.fixed is not None:
            return torch.full(view.budget.shape, self.fixed, dtype=torch.int16, device=view.valid.device)
        return state["pattern"]

    def _token_sets(self, view: TokenView) -> tuple[torch.Tensor, torch.Tensor]:
        """(special, punct) [B, Hkv, T] bool over the valid slots."""
        if not self.needs_token_ids:
            empty = torch.zeros_like(view.valid)
            return empty, empty
        if view.token_ids is None:
            raise KVPolicyError("policy 'fastgen' reads token ids but the cache kept none")
        special_table, punct_table = self._lookup(view.valid.device)
        size = special_table.numel()
        known = view.valid & (view.token_ids < size)  # ids past the tables (past every listed id) are in no set
        ids = view.token_ids.long().clamp(0, size - 1)
        special = special_table[ids] & known
        if self.params.sinks:
            special |= view.valid & (view.positions < self.params.sinks)
        return special, punct_table[ids] & known

    def _fixed_and_candidates(self, bits: torch.Tensor, view: TokenView) -> tuple[torch.Tensor, torch.Tensor]:
        """(kept whatever the scores, frequency candidates), [B, Hkv, T] bool, for pattern bits [B, Hkv]."""
        special, punct = self._token_sets(view)

        def has(bit: int) -> torch.Tensor:
            return ((bits & bit) != 0)[..., None]

        window = share(self.params.local_ratio, view.seen)[:, None].expand(bits.shape)
        fixed = (special & has(SPECIAL)) | (punct & has(PUNCT)) | (view.recent_mask(window) & has(LOCAL))
        fixed |= view.valid & (has(FULL) | (bits == 0)[..., None])
        candidates = view.valid & ~fixed & has(FREQUENCY)
        return fixed, candidates

    # --- the policy contract ---------------------------------------------------------------------------------
    def budgets(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        fixed, candidates = self._fixed_and_candidates(self._patterns(state, view), view)
        frequent = torch.minimum(share(self.params.frequency_ratio, view.seen)[:, None], candidates.sum(dim=2))
        return fixed.sum(dim=2) + frequent

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        fixed, candidates = self._fixed_and_candidates(self._patterns(state, view), view)
        acc = state["acc"] if "acc" in state else torch.zeros_like(view.positions, dtype=torch.float32)
        return torch.where(fixed, torch.inf, torch.where(candidates, acc, -torch.inf))

    def observe(self, state: dict[str, torch.Tensor], stats: AttentionStats) -> None:
        if "acc" in state:
            state["acc"] += stats.colsum

    def profile(self, state: dict[str, torch.Tensor], stats: AttentionStats, view: TokenView) -> None:
        """Choose each cell's pattern from the prompt's attention (see the module docstring)."""
        if self.fixed is not None:
            return
        heads_sum, near = stats.colsum_heads, stats.near_colsum_heads  # [B, Hkv, G, T]
        far = heads_sum - near
        queries = stats.queries.to(heads_sum.device).double().clamp(min=1)[:, None, None]  # [B, 1, 1]
        valid = view.valid
        special, punct = self._token_sets(view)
        window = share(self.params.local_ratio, view.seen)[:, None].expand(valid.shape[:2])
        newest = view.recent_mask(window)
        frequent_count = share(self.params.frequency_ratio, view.seen)  # [B]
        attended = heads_sum.mean(dim=2)  # the column sums, from the statistic the profile asks for
        rank_of = ranks(attended.masked_fill(~valid, -torch.inf), dim=2, descending=True)  # 0 = most attended
        near_total = near.sum(dim=3).double()
        recoveries, costs = [], []
        for bits in self.candidates:  # a handful of candidates; everything inside is vectorized
            if bits & FULL:
                recoveries.append(torch.ones(valid.shape[:2], dtype=torch.float64, device=valid.device))
                costs.append(valid.sum(dim=2))
                continue
            kept = torch.zeros_like(valid)
            if bits & SPECIAL:
                kept |= special
            if bits & PUNCT:
                kept |= punct
            if bits & FREQUENCY:
                excluded = kept | (newest if bits & LOCAL else torch.zeros_like(valid))
                pool = valid & ~excluded
                # the top `frequent_count` of the pool by column sum: ranks among pool members only
                pool_rank = (ranks(attended.masked_fill(~pool, -torch.inf), dim=2, descending=True)
                             if bool(excluded.any()) else rank_of)
                kept |= pool & (pool_rank < frequent_count[:, None, None])
            if bits & LOCAL:
                mass = near_total + (far * kept[:, :, None]).sum(dim=3).double()
                cost = (kept | newest).sum(dim=2)
            else:
                mass = (heads_sum * kept[:, :, None]).sum(dim=3).double()
                cost = kept.sum(dim=2)
            mass = mass / queries  # [B, Hkv, G]: mean over the prompt's queries, per query head
            recoveries.append(mass.amin(dim=2) if self.params.gqa == "min" else mass.mean(dim=2))
            costs.append(cost)
        recovery = torch.stack(recoveries, dim=2)  # [B, Hkv, C]
        cost = torch.stack(costs, dim=2).double()
        cost = torch.where(recovery >= self.target - 1e-9, cost, torch.inf)
        choice = cost.argmin(dim=2)  # the first of equal costs: the list order breaks ties
        codes = torch.tensor(self.candidates, dtype=torch.int16, device=choice.device)
        state["pattern"].copy_(codes[choice])
        state["recovery"].copy_(recovery.gather(2, choice[..., None])[..., 0].float())

    def cell_labels(self, state: dict[str, torch.Tensor]) -> list[list[str]] | None:
        rows = state["pattern"].tolist()
        if self.fixed is not None:
            return [[pattern_name(self.fixed)] * len(row) for row in rows]
        return [[pattern_name(int(bits)) for bits in row] for row in rows]


def _vocab_size(model: Any) -> int:
    config = getattr(model, "config", None)
    if config is None:
        return 0
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "vocab_size", 0) or 0)

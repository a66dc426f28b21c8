"""The policy contract: a policy scores cached tokens, the cache decides how many to keep.

A policy never touches K/V storage. It declares the attention statistics it reads
(`needs`), the per-token state it keeps (`state`, stored by the cache as
``[batch, kv_heads, slots]`` tensors that move with K/V on compaction), updates that
state in `observe`, and returns keep-priorities in `score`: higher is kept, ``+inf``
pins a token, ``-inf`` drops it whatever the budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

#: The statistics the shared attention backend can return (docs/architecture.md, "Attention statistics").
STAT_NAMES = frozenset({"colsum", "colsum_sq", "below_uniform", "last_rows", "colsum_heads", "near_colsum_heads",
                        "colmax", "query_moments"})
#: Statistics returned as several `AttentionStats` fields (each other statistic is the field of its name).
STAT_FIELDS = {"query_moments": ("query_count", "query_sum", "query_outer")}


@dataclass
class AttentionStats:
    """Statistics of one attention call, reduced over the query heads of each KV head.

    All are fp32 probabilities over the layer's storage slots (``T`` = slots in use);
    slots that are empty or masked get 0. ``queries`` counts the real (non-pad) queries
    of the call per batch row.

    ``colsum_heads`` and ``near_colsum_heads`` keep the G query heads of each KV head apart
    (``[B, Hkv, G, T]``), for policies that reduce over them another way than the mean
    (FastGen's profile takes the minimum). ``near_colsum_heads`` sums only the (query, key)
    pairs whose positions are less than ``ceil(near_ratio x n)`` apart, ``n`` being the real
    tokens the row has seen, so a query's own key is always near: with ``colsum_heads`` it
    gives, without any T x T matrix, the attention that stays within a local window of
    each query and the part that falls outside it.

    ``colmax`` is the most attention any real query of the call, in any of the G query heads
    of a KV head, gave each slot (KVzip's score, read by a probe).

    ``query_moments`` is not about attention but about the queries themselves, times the
    call's scaling and without their rotary rotation (as if at position 0): ``query_count`` [B]
    of them were summed (the real queries at positions >= the policy's ``query_moments_skip``),
    ``query_sum`` their sum and ``query_outer`` the sum of their outer products, per query head
    (expected attention's query distribution).
    """

    queries: torch.Tensor  # [B] int64
    colsum: torch.Tensor | None = None  # [B, Hkv, T]
    colsum_sq: torch.Tensor | None = None  # [B, Hkv, T]
    below_uniform: torch.Tensor | None = None  # [B, Hkv, T]
    last_rows: torch.Tensor | None = None  # [B, Hkv, W, T]
    colsum_heads: torch.Tensor | None = None  # [B, Hkv, G, T]
    near_colsum_heads: torch.Tensor | None = None  # [B, Hkv, G, T]
    colmax: torch.Tensor | None = None  # [B, Hkv, T]
    query_count: torch.Tensor | None = None  # [B] float32 (with query_moments)
    query_sum: torch.Tensor | None = None  # [B, Hkv, G, D]
    query_outer: torch.Tensor | None = None  # [B, Hkv, G, D, D]


@dataclass(frozen=True)
class CellArray:
    """A per-cell state entry with trailing dimensions (`Policy.cell_state`): ``dims`` name them, each ``"groups"``
    (the query heads per KV head) or ``"head_dim"``; the cache stores it as ``[batch, kv_heads, *dims]``."""

    dtype: torch.dtype
    dims: tuple[str, ...]


@dataclass
class TokenView:
    """What a policy may know about the cached tokens when it scores them.

    ``positions`` is each slot's index among the real tokens of its batch row (pads
    excluded, so the first real token is 0); empty slots hold -1 and ``valid`` False.
    ``seen`` is the number of real tokens each row has seen so far; ``budget`` is the
    number of tokens each (row, KV head) may keep at full precision: its limit, or on a
    layer with precision tiers the 16-bit tier's size, so that what a policy pins there
    (sinks, a recent window) stays at 16 bits.
    """

    positions: torch.Tensor  # [B, Hkv, T] int64
    valid: torch.Tensor  # [B, Hkv, T] bool
    seen: torch.Tensor  # [B] int64
    budget: torch.Tensor  # [B, Hkv] int64
    token_ids: torch.Tensor | None = None  # [B, Hkv, T] int32, when a policy asked for them (`needs_token_ids`)
    #: [B] float, for policies that weigh layers (`weighs_layers`): this layer's `layer_weight` over the mean weight of
    #: the model's layers that gave one so far (1.0 for a layer alone); None for every other policy
    layer_share: torch.Tensor | None = None
    #: [B, Hkv, T, D] each, the cached keys (after RoPE, at their original positions) and values, for policies that
    #: read them (`reads_kv`); None for every other policy
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    #: [D / 2] float, the model's RoPE inverse frequencies, for policies that read `query_moments`; else None
    inv_freq: torch.Tensor | None = None
    #: [B, Hkv, T] float32 on a layer with a merging policy (`Policy.merges`): how many evicted tokens each slot has
    #: absorbed, directly or through the tokens merged into it (0: the slot is its own token alone); else None
    merged: torch.Tensor | None = None

    def recent_mask(self, count: torch.Tensor) -> torch.Tensor:
        """Slots holding one of the ``count`` (per row/head, [B, Hkv]) most recent real tokens."""
        age = self.seen[:, None, None] - self.positions  # 1 for the newest token
        return self.valid & (age <= count[..., None])


@dataclass
class MergePlan:
    """What a merging policy (`Policy.merges`) does with the tokens the cache is about to evict.

    For each slot, ``target`` is the kept slot of the same cell it merges into, or -1 (dropped);
    ``weight`` its weight. A kept slot that receives merges weighs ``self_weight``; its new K and
    V are the weighted mean of its own and those merged into it (the weights normalized to sum
    to 1), so a token merged with itself is unchanged. Entries of kept slots are ignored.
    """

    target: torch.Tensor  # [B, Hkv, T] int64, -1: drop
    weight: torch.Tensor  # [B, Hkv, T] float >= 0
    self_weight: torch.Tensor  # [B, Hkv, T] float > 0


@dataclass(frozen=True)
class NoParams:
    """For policies that take no parameters."""


class Policy:
    """Base class of every eviction policy (built-in or plugin).

    Subclasses set ``name``, ``Params`` (a dataclass whose field names are the YAML
    ``params`` keys), ``needs`` and ``state``, and implement ``score`` (and
    ``observe`` when they keep state).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    #: Attention statistics read by ``observe``; empty means plain SDPA, no tracking cost.
    needs: ClassVar[frozenset[str]] = frozenset()
    #: Per-token state: name -> dtype; new tokens start at 0.
    state: ClassVar[dict[str, torch.dtype]] = {}
    #: False for policies that never evict (``full``): budgets do not apply to them. (Named ``bounded``
    #: before; a plugin that still sets ``bounded`` sets this.)
    evicts: ClassVar[bool] = True
    #: True if ``score`` may give ``-inf`` to valid tokens (drop now, whatever the budget); lets the
    #: cache skip that check on the decode fast path for every other policy.
    drops_early: ClassVar[bool] = False
    #: True if observing several queries in one call leaves the same state as observing them one by one, and
    #: ``score`` is the only reader of that state (sums over queries: H2O, RoCo). A paged engine may then store a
    #: request's decode queries and observe them together right before it evicts (one pass over the keys, not one
    #: per step).
    additive: bool = False
    #: Rows W of ``last_rows`` the policy needs (only read when "last_rows" in needs).
    last_rows_window: int = 0
    #: Tokens the cache lets in past the budget before it evicts (at least this slack on the policy's layers): a
    #: policy that evicts in bulk once every ``lag + 1`` tokens (LazyEviction's window) sets it.
    lag: int = 0
    #: True if the policy splits a batch row's budget among its KV heads itself (``allocate``, e.g.
    #: AdaKV); the recipe's per-head budgets then only fix each row's total over the policy's heads.
    allocates: ClassVar[bool] = False
    #: True if the policy sets the budget of each of its (row, KV head) cells itself at every eviction
    #: (``budgets``), e.g. FastGen's shares of the current length; a recipe's budget does not apply to it.
    dynamic_budget: ClassVar[bool] = False
    #: Statistics read only by ``profile``, at a layer's first attention call (the prompt); later calls skip them.
    profile_needs: frozenset[str] = frozenset()
    #: The local band of ``near_colsum_heads``: keys less than ceil(near_ratio x tokens seen) positions back.
    near_ratio: float = 0.0
    #: True if ``score``/``budgets``/``profile`` read ``view.token_ids``: the cache then keeps each slot's token id
    #: (the session records each forward pass's ``input_ids``). Policies that leave it False pay nothing for it.
    needs_token_ids: bool = False
    #: Per-cell state: name -> dtype, stored by the cache as ``[batch, kv_heads]`` tensors (not per token; they do
    #: not move on compaction), passed in the same ``state`` dict; they start at 0. A `CellArray` instead of a dtype
    #: adds trailing dimensions (``[batch, kv_heads, groups, head_dim]``, ...).
    cell_state: ClassVar[dict[str, torch.dtype | CellArray]] = {}
    #: True if ``score`` reads the cached keys and values (``view.keys``, ``view.values``).
    reads_kv: ClassVar[bool] = False
    #: With "query_moments" in ``needs``: queries at the first this-many positions of a row stay out of the moments
    #: (attention sinks' outlier queries).
    query_moments_skip: int = 0
    #: True if the cache re-rotates this policy's keys (and queries) to their index within the cache at every
    #: call (StreamingLLM's in-cache positions) instead of keeping their original RoPE positions.
    in_cache_positions: bool = False
    #: True if the policy merges the tokens the cache evicts into kept ones (``merge``) instead of dropping them.
    merges: ClassVar[bool] = False
    #: With ``merges``: True if a slot that stands for n tokens (itself and ``view.merged`` more) draws attention as
    #: n tokens with its key would: every backend adds log n to its logits (`AttentionCall.key_bias`). Without it a
    #: merged key counts once in softmax, and the attention its tokens drew together is lost.
    proportional_attention: bool = False
    #: True if ``layer_weight`` says how much of the model's budget this layer needs; ``view.layer_share`` then
    #: carries it, relative to the other layers, to ``allocate``.
    weighs_layers: ClassVar[bool] = False
    #: True (with ``weighs_layers``) if a layer's share comes from ranking ``score`` over the whole model instead of
    #: ``layer_weight``: the layer weighs the count of its tokens among the model's best, every layer's scores ranked
    #: together against the model's total budget (`LayerLedger.report_scores`). The scores must compare across
    #: layers (KVzip's are attention probabilities); pinned tokens score +inf.
    ranks_across_layers: ClassVar[bool] = False
    #: Statistics read by ``observe_probe``. Not empty: the policy scores the prompt by a *probe*, extra tokens
    #: (``probe_chunks``) that the session runs through the model right after the prompt's forward pass, before
    #: anything is evicted (KVzip's context reconstruction). The probe's tokens then leave the cache as if never
    #: seen; the prompt is evicted once the probe is over (`kvpolicy.hf.probe`).
    probe_needs: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "bounded" in vars(cls) and "evicts" not in vars(cls):
            # hook API version 1 named `evicts` `bounded`: a plugin written then still says what it means
            cls.evicts = bool(vars(cls)["bounded"])

    def __init__(self, params: Any = None) -> None:
        self.params = params if params is not None else self.Params()

    @classmethod
    def param_fields(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls.Params)}

    def observe(self, state: dict[str, torch.Tensor], stats: AttentionStats) -> None:
        """Update per-token state after an attention call (prefill chunk or decode step)."""

    def score(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        """Keep-priority per slot, ``[B, Hkv, T]``; higher is kept."""
        raise NotImplementedError

    def allocate(self, state: dict[str, torch.Tensor], view: TokenView, cells: torch.Tensor) -> torch.Tensor | None:
        """Per-(row, KV head) budgets ``[B, Hkv]`` (int64) for ``cells`` (``[B, Hkv]`` bool), only if ``allocates``.

        The cache calls it once per batch row, at the row's first eviction (the prefill when
        the prompt is over budget), with ``view.budget`` holding the recipe's budgets and
        ``cells`` this policy's (row, KV head) cells of the rows being allocated. Entries
        outside ``cells`` are ignored. None means not yet (D2O waiting for every layer's
        weight): the cells evict to the recipe's budgets and are asked again at their next
        eviction. The budgets returned are fixed from then on; the cache
        then keeps each cell's top ``score`` tokens as usual, and stores each cell in memory
        sized to its own budget (ragged storage) when the cells of a layer differ enough.
        """
        return view.budget

    def budgets(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        """Per-(row, KV head) budgets ``[B, Hkv]`` (int64), only if ``dynamic_budget``: called at every eviction.

        The cache keeps each of the policy's cells at this many tokens (its top ``score`` ones) and
        sizes their storage to it, so budgets may differ per cell and change as the sequence grows.
        """
        raise NotImplementedError

    def profile(self, state: dict[str, torch.Tensor], stats: AttentionStats, view: TokenView) -> None:
        """Called once per layer, after its first attention call (the prompt), with ``profile_needs`` in ``stats``.

        Runs before ``observe`` of the same call.
        """

    def merge(self, state: dict[str, torch.Tensor], view: TokenView, keys: torch.Tensor,
              kept: torch.Tensor) -> MergePlan:
        """Only if ``merges``: where the tokens leaving the cache go, given the layer's ``keys`` [B, Hkv, T, D] (the slots
        in use) and ``kept`` [B, Hkv, T] bool (what stays). Called at every eviction, before the store compacts."""
        raise NotImplementedError

    def layer_weight(self, state: dict[str, torch.Tensor], view: TokenView) -> torch.Tensor:
        """Only if ``weighs_layers``: [B] float > 0, how much this layer needs relative to others (higher: more). Asked
        after each attention call until the layer's budgets are allocated."""
        raise NotImplementedError

    def probe_chunks(self, prompt_ids: list[int]) -> list[list[int]]:
        """Only with ``probe_needs``: the probe's forward passes for one batch row whose prompt's real tokens are
        ``prompt_ids``, each a list of token ids (words to ids with the tokenizer `prepare` got). The cache drops
        each pass's tokens before the next one, so every pass sees the prompt alone, its tokens at the positions
        right after the prompt's."""
        raise NotImplementedError

    def observe_probe(self, state: dict[str, torch.Tensor], stats: AttentionStats, view: TokenView) -> None:
        """Only with ``probe_needs``: read one probe pass's statistics (``probe_needs`` in ``stats``) over every slot,
        the prompt's and the pass's own (``view.positions`` >= the prompt's length), which leave right after."""

    def prepare(self, model: Any = None, tokenizer: Any = None) -> None:
        """Called by `attach` with the model and the tokenizer (None when not given): resolve what depends on them."""

    def cell_labels(self, state: dict[str, torch.Tensor]) -> list[list[str]] | None:
        """A label per (row, KV head) cell for the memory report (e.g. FastGen's pattern); None: the policy's name."""
        return None


# --- ranking ------------------------------------------------------------------------------------------------


def sort_order(key: torch.Tensor, by: torch.Tensor | None = None, *, dim: int = -1,
               descending: bool = False) -> torch.Tensor:
    """The indices that sort ``key`` along ``dim``: by ``key``, equal keys by ``by`` (e.g. the tokens' positions,
    so that ties go by age), still equal ones by index (the lower first).

    ``descending`` sorts both ``key`` and ``by`` from the highest (the index order stays ascending). Two stable
    sorts, ``by`` first: the same permutation as a sort on the pair (key, by), with no packing of the two.
    """
    if by is None:
        return key.argsort(dim=dim, descending=descending, stable=True)
    first = by.argsort(dim=dim, descending=descending, stable=True)
    return first.gather(dim, key.gather(dim, first).argsort(dim=dim, descending=descending, stable=True))


def ranks(key: torch.Tensor, by: torch.Tensor | None = None, *, dim: int = -1, descending: bool = False,
          dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Each element's place in `sort_order` (0 = first), as ``dtype``: with ``descending`` rank 0 is the highest
    key, else the lowest. A policy that returns ranks as its score keeps the last places (the cache keeps the
    top scores)."""
    order = sort_order(key, by, dim=dim, descending=descending)
    shape = [1] * order.dim()
    shape[dim] = order.shape[dim]
    places = torch.arange(order.shape[dim], device=order.device, dtype=dtype).view(shape).expand(order.shape)
    return torch.empty_like(places).scatter_(dim, order, places)

"""`PolicyLayer`: one layer of a policy cache, whatever engine runs the model.

It owns the layer's policies (`LayerPolicies`: one `PolicyGroup` per distinct policy and params),
their budgets (`CellBudgets`) and a storage format (`storage.KVStore`: dense, switching to ragged
when its cells' budgets differ enough). An engine integration drives it per forward pass:

    keys, values = layer.append(k, v)          # this pass's keys (after RoPE) and values
    call = layer.begin_call(query_valid, ...)  # an `AttentionCall` for the backends
    result = backend.attend(query, call)
    layer.end_call(result.stats)               # policies observe, then eviction

Keys are stored after RoPE at their original positions; StreamingLLM's in-cache positions
re-rotate keys and queries at each call instead of storing pre-RoPE copies. A compiled engine
takes the fixed-shape decode step instead (`static_step`, ``layer.static_step``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backend.call import AttentionCall
from ..backend.rotary import in_cache_deltas, rotate
from ..errors import KVPolicyError
from ..policies.base import AttentionStats, CellArray, TokenView
from ..recipe.plan import LayerPlan
from ..storage.base import KVStore, storage_bytes
from ..storage.dense import DenseStore
from ..storage.ragged import RaggedStore, ragged_pays
from ..storage.tiered import TieredStore
from .budgets import CellBudgets
from .layer_shares import LayerLedger
from .memory_report import LayerMemory, layer_memory
from .merging import MERGED_TOKENS, merge_evicted
from .policy_group import LayerPolicies, PolicyGroup, call_policy, checked
from .static_step import StaticStep


@dataclass
class TokenFeed:
    """The ``input_ids`` [B, q] of the forward pass in progress, for layers that keep token ids (set by the engine)."""

    ids: torch.Tensor | None = None


class PolicyLayer:
    def __init__(self, layer_idx: int, rows: list[LayerPlan], policies: LayerPolicies,
                 prompt_tokens: int | None = None, backend: str = "torch", inv_freq: torch.Tensor | None = None,
                 ledger: LayerLedger | None = None, query_groups: int | None = None):
        """``rows``: the layer's plan for every batch row (one `LayerPlan` shared by all rows, or one per row);
        ``policies``: the layer's policies over those cells (`LayerPolicies.of_rows`); ``ledger``: shared by the
        layers of one cache when a policy weighs layers (`Policy.weighs_layers`); ``inv_freq``: the model's RoPE
        inverse frequencies, for in-cache positions and query moments; ``query_groups``: query heads per KV head,
        for a policy whose per-cell state has a ``"groups"`` dimension (`CellArray`)."""
        self.layer_idx, self.policies, self.backend = layer_idx, policies, backend
        groups = policies.groups
        instances = [g.policy for g in groups]
        self.profiling = [g for g in groups if g.policy.profile_needs]
        self.near_ratio = torch.zeros(len(rows), len(rows[0].heads), dtype=torch.float64)  # per cell
        for g in groups:
            if "near_colsum_heads" in g.policy.needs | g.policy.profile_needs:
                self.near_ratio[g.cells] = g.policy.near_ratio
        self.drops_early = any(p.drops_early for p in instances)
        self.probing = [g for g in groups if g.policy.probe_needs]
        self.probe_needs = frozenset().union(*(g.policy.probe_needs for g in self.probing))
        #: set by a cache that runs a probe (`kvpolicy.hf.probe`): every layer then evicts only once it is over
        self.probed_cache = False
        self.merging = [g for g in groups if g.policy.merges]
        # cells whose merged slots attend in proportion to the tokens they stand for (`Policy.proportional_attention`)
        proportional = [g.cells for g in self.merging if g.policy.proportional_attention]
        self.proportional_cells = torch.stack(proportional).any(dim=0) if proportional else None
        self.weighing = [g for g in groups if g.policy.weighs_layers]
        self.ledger = ledger if self.weighing else None
        if self.weighing and ledger is None:
            raise KVPolicyError(f"layer {layer_idx}: policy {self.weighing[0].policy.name!r} weighs layers against each "
                                "other, which needs the ledger its cache shares among its layers (LayerLedger)")
        # per-slot token ids, kept only when a policy reads them (FastGen's special/punctuation tokens)
        self.token_id_policies = [p.name for p in instances if p.needs_token_ids]
        self.token_feed: TokenFeed | None = None
        # cells whose keys move to in-cache RoPE positions (StreamingLLM), or None
        in_cache = [g.cells for g in groups if g.policy.in_cache_positions]
        self.in_cache_cells = torch.stack(in_cache).any(dim=0) if in_cache else None
        if self.in_cache_cells is not None and inv_freq is None:
            raise KVPolicyError("in-cache positions need the model's RoPE inverse frequencies (inv_freq)")
        moment_readers = [p for p in instances if "query_moments" in p.needs]
        if moment_readers and inv_freq is None:
            raise KVPolicyError(f"policy {moment_readers[0].name!r} models the queries to come from the queries seen, "
                                "which needs a RoPE model (its inverse frequencies, inv_freq); this model has none")
        self.reads_query_moments = bool(moment_readers)
        self.moments_skip = max((p.query_moments_skip for p in moment_readers), default=0)
        self.reads_kv = any(p.reads_kv for p in instances)
        self.inv_freq, self.query_groups = inv_freq, query_groups
        self.budgets = CellBudgets(rows, groups, prompt_tokens)
        self.kernel_reads_tiers = False  # set when a tiered store is made (`_initialize`)
        if self.budgets.tiers:
            refused = [(p.name, why) for p in instances for flag, why in (
                (p.merges, "merges evicted tokens into kept ones"), (p.allocates, "splits budgets among its heads"), (p.dynamic_budget, "sets its own budgets"),
                (p.in_cache_positions, "re-rotates keys to in-cache positions")) if flag]
            if refused:
                raise KVPolicyError(f"layer {layer_idx}: policy {refused[0][0]!r} {refused[0][1]}, which precision tiers "
                                    "do not support yet: drop the budget's tiers/memory for it, or use h2o, tova, snapkv")
        self.evictions = 0
        self.static_step = StaticStep(self)
        self.reset()

    def reset(self) -> None:
        self.store: KVStore | None = None
        self.budgets.reset()
        self.slots_seen = 0  # slots' worth of tokens seen, pads included (what `generate` counts)
        self.pending: tuple[int, int] | None = None  # (first slot, count) of the tokens this pass appended
        self.pass_has_pads = False
        self.profiled = not self.profiling
        self.awaits_probe = self.probed_cache
        self.evicting = True  # False once the owner stops it (`PolicyCache.stop_evicting`): every token then stays
        self.has_merged = False  # a merging eviction ran: slots may stand for several tokens (`key_bias`)
        self.evicted_block: torch.Tensor | None = None  # [B] tokens seen // align at each row's last eviction (-1: none)
        # while a probe runs: what the layer held before its first pass (used slots, slots seen, tokens seen,
        # packed tokens, pads in the last pass), restored after each pass
        self.probe_mark: tuple | None = None
        # a layer's weight (`Policy.layer_weight`) is read over the tokens it saw before it first evicted, so that
        # weights given after one forward pass over the prompt compare across layers
        self.weighs_tokens_seen = True
        if self.ledger is not None:
            self.ledger.forget(self.layer_idx)

    @property
    def is_initialized(self) -> bool:
        return self.store is not None

    # --- the metadata, for the engine and for inspection ------------------------------------------------
    @property
    def used(self) -> int:
        return self.store.used if self.store is not None else 0

    @property
    def valid(self) -> torch.Tensor:
        return self.store.slots.valid

    @property
    def positions(self) -> torch.Tensor:
        return self.store.slots.positions

    @property
    def ragged(self) -> bool:
        return isinstance(self.store, RaggedStore)

    # --- a forward pass ---------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this pass's K/V ([B, Hkv, q, D]); return the layer's K/V as attention reads them."""
        if self.store is None:
            self._initialize(keys, values)
        count = keys.shape[2]
        start = self.store.append(keys, values)
        if self.token_id_policies:
            self._append_token_ids(start, count)
        self.slots_seen += count
        self.pending = (start, count)
        return self._attention_kv()

    def _attention_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V attention reads: shape-only placeholders when the Triton kernels read the tiers in place."""
        return self.store.placeholder_kv() if self.kernel_reads_tiers else self.store.attention_kv()

    def _initialize(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        batch, heads, device = keys.shape[0], keys.shape[1], keys.device
        token_state = self.policies.token_state()
        if self.token_id_policies:
            token_state["token_ids"] = torch.int32
        if self.merging:
            token_state[MERGED_TOKENS] = torch.float32
        self.cell_state = {
            f"{g.prefix}{name}": self._cell_tensor(g.policy.name, kind, batch, heads, keys.shape[-1], device)
            for g in self.policies.groups for name, kind in g.policy.cell_state.items()
        }
        tiers = self.budgets.tiers
        if tiers:
            self.store = TieredStore(keys, values, token_state, self.budgets, self.layer_idx, tiers)
            self.budgets.price_tiers(self.store.costs(self.cell_state))
            # the Triton kernels read the codes in place; the torch path decodes the layer (workspace)
            self.kernel_reads_tiers = self.backend == "triton"
        else:
            self.store = DenseStore(keys, values, token_state, self.budgets)
        # the per-cell masks each call reads, on the layer's device once rather than copied there at every call
        for name in ("in_cache_cells", "proportional_cells", "near_ratio"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))
        self.tokens_seen = torch.zeros(batch, dtype=torch.long, device=device)  # real tokens per row

    def _cell_tensor(self, policy: str, kind: torch.dtype | CellArray, batch: int, heads: int, head_dim: int,
                     device: torch.device) -> torch.Tensor:
        """One per-cell state entry, zeros: ``[batch, heads]``, or with a `CellArray`'s trailing dimensions."""
        if not isinstance(kind, CellArray):
            return torch.zeros((batch, heads), dtype=kind, device=device)
        sizes = {"groups": self.query_groups, "head_dim": head_dim}
        unknown = [d for d in kind.dims if d not in sizes]
        if unknown:
            raise KVPolicyError(f"policy {policy!r} asks for per-cell state over {unknown[0]!r}; the dimensions a "
                                "CellArray may name are 'groups' and 'head_dim'")
        if "groups" in kind.dims and self.query_groups is None:
            raise KVPolicyError(f"policy {policy!r} keeps state per query head, but this engine did not say how many "
                                "query heads each KV head has (PolicyLayer's query_groups)")
        return torch.zeros((batch, heads, *(sizes[d] for d in kind.dims)), dtype=kind.dtype, device=device)

    def _append_token_ids(self, start: int, count: int) -> None:
        ids = self.token_feed.ids if self.token_feed is not None else None
        if ids is None:
            raise KVPolicyError(
                f"policy {self.token_id_policies[0]!r} reads the token ids of the cached tokens, but this forward pass "
                "gave none: call the model with input_ids (not inputs_embeds alone), on the model the session was "
                "attached to, with the cache made by session.new_cache()"
            )
        if ids.shape != (self.valid.shape[0], count):
            raise KVPolicyError(
                f"the forward pass's input_ids have shape {tuple(ids.shape)} but layer {self.layer_idx} got "
                f"{count} new tokens for {self.valid.shape[0]} rows"
            )
        self.store.slots.token_state["token_ids"][:, :, start : start + count] = ids.to(self.valid.device, torch.int32)[:, None, :]

    def begin_call(self, query_valid: torch.Tensor | None, scaling: float, sliding_window: int | None = None) -> AttentionCall:
        """Mark this pass's pads and positions; the record the attention backends get for it."""
        start, count = self.pending
        device = self.valid.device
        if query_valid is None:
            query_positions = self.tokens_seen[:, None]
            if count > 1:
                query_positions = query_positions + torch.arange(count, device=device)
        else:
            query_valid = query_valid.to(device)
            ranks = torch.cumsum(query_valid.long(), dim=1) - 1
            query_positions = torch.where(query_valid, self.tokens_seen[:, None] + ranks, -1)
            self.valid[:, :, start : start + count] &= query_valid[:, None, :]
            self.store.mark_pads()
        self.positions[:, :, start : start + count] = query_positions[:, None, :]
        self.pass_has_pads = query_valid is not None
        self.tokens_seen = self.tokens_seen + (count if query_valid is None else query_valid.sum(dim=1))
        if self.budgets.limits is None:  # the first pass: the prompt's length is known now, pads aside
            self.budgets.set_limits(self.tokens_seen, count)
        keys, values = self._attention_kv()
        used = keys.shape[2]
        valid, key_positions = self.valid[:, :, :used], self.positions[:, :, :used]
        query_rotation = None
        if self.in_cache_cells is not None:
            key_delta, query_delta = in_cache_deltas(key_positions, valid, slice(start, start + count), query_positions)
            cells = self.in_cache_cells.to(device)[:, :, None]
            keys = rotate(keys, torch.where(cells, key_delta, 0), self.inv_freq)
            query_rotation = (torch.where(cells, query_delta, 0), self.inv_freq)
        needs = self.policies.needs if self.profiled else self.policies.needs | self.policies.profile_needs
        if self.probe_mark is not None:
            needs = self.probe_needs
        near_band = None
        if "near_colsum_heads" in needs:
            ratio = self.near_ratio.to(device)
            near_band = torch.ceil(self.tokens_seen[:, None].double() * ratio - 1e-9).long().clamp(min=1)
        return AttentionCall(
            keys=keys, values=values, valid=valid, key_positions=key_positions, query_positions=query_positions,
            query_valid=query_valid, past_slots=start, scaling=scaling, needs=needs,
            last_rows_window=self.policies.last_rows_window, sliding_window=sliding_window, backend=self.backend,
            causal_only=query_valid is None and sliding_window is None and self.store.past_packed,
            near_band=near_band, query_rotation=query_rotation,
            regions=self.store.kernel_regions() if self.kernel_reads_tiers else None,
            decode_kv=self.store.attention_kv if self.kernel_reads_tiers else None,
            inv_freq=self.inv_freq if "query_moments" in needs else None, moments_skip=self.moments_skip,
            key_bias=self._key_bias(used),
        )

    def _key_bias(self, used: int) -> torch.Tensor | None:
        """log of the tokens each of the first ``used`` slots stands for, on the cells that attend in proportion to
        them (`Policy.proportional_attention`), 0 elsewhere; None while no slot stands for more than itself."""
        if self.proportional_cells is None or not self.has_merged:
            return None
        merged = self.store.slots.token_state[MERGED_TOKENS][:, :, :used]
        return torch.where(self.proportional_cells.to(merged.device)[:, :, None], torch.log1p(merged), 0.0)

    def end_call(self, stats: AttentionStats | None) -> None:
        """Let the policies observe this call, then evict what is over budget."""
        if self.probe_mark is not None:  # a probe's pass: its policies read it, nothing else happens
            view = self.token_view()
            for group in self.probing:
                call_policy(group.policy, "observe_probe", group.policy.observe_probe, self.group_state(group), stats,
                            view)
            self.pending = None
            self.store.end_pass()
            return
        if not self.profiled:
            view = self.token_view()
            for group in self.profiling:
                call_policy(group.policy, "profile", group.policy.profile, self.group_state(group), stats, view)
            self.profiled = True
        self.observe(stats)
        # a layer awaiting its probe weighs itself once the probe is over (`weigh_probe`), not from the prompt alone
        if (self.ledger is not None and self.weighs_tokens_seen and not self.awaits_probe
                and self.budgets.allocation_pending()):
            self._report_weight()
        self.pending = None
        self.store.end_pass()
        self._evict()

    # --- a probe (`kvpolicy.hf.probe`): passes whose tokens leave once their policies have read them -------------
    def begin_probe(self) -> None:
        if not self.awaits_probe or self.store is None:
            raise KVPolicyError(f"layer {self.layer_idx}: a probe runs once, right after the prompt's forward pass")
        self.probe_mark = (self.store.used, self.slots_seen, self.tokens_seen, self.store.packed_tokens,
                           self.pass_has_pads)

    def end_probe_pass(self) -> None:
        """Forget the pass's tokens: the layer is as the prompt left it, the policies' reading of it aside."""
        used, self.slots_seen, self.tokens_seen, packed, self.pass_has_pads = self.probe_mark
        self.store.truncate(used, packed)

    def weigh_probe(self) -> None:
        """The probe is over: a layer that weighs itself against the others says so now, from the probe's scores
        (every layer does, before any evicts)."""
        if self.ledger is not None and self.budgets.allocation_pending():
            self._report_weight()

    def end_probe(self) -> None:
        """The probe is over: evict the prompt as its scores now say."""
        self.probe_mark, self.awaits_probe = None, False
        self._evict()

    def observe(self, stats: AttentionStats | None) -> None:
        """Each policy that reads statistics observes this call's."""
        self.policies.observe(self.group_state, stats)

    def _report_weight(self) -> None:
        view = self.token_view()
        open_rows = ~self.budgets.allocated.any(dim=1) if self.budgets.allocated is not None else None
        ranking = [g for g in self.weighing if g.policy.ranks_across_layers]
        if ranking:  # the layer's scores, ranked with every other layer's by the ledger
            if len(ranking) != len(self.weighing):
                raise KVPolicyError(f"layer {self.layer_idx}: policies that rank tokens across layers cannot share a "
                                    "layer with policies that weigh layers otherwise; give the layer one of them")
            scores = torch.full_like(view.positions, -torch.inf, dtype=torch.float32)
            for group in ranking:
                given = call_policy(group.policy, "score", group.policy.score, self.group_state(group), view)
                cells = group.cells.to(scores.device)[..., None]
                scores = torch.where(cells & view.valid, given.float(), scores)
            budget = torch.stack([torch.where(g.cells.to(view.budget.device), view.budget, 0) for g in ranking]).sum(0)
            self.ledger.report_scores(self.layer_idx, scores.flatten(1), budget.sum(dim=1), open_rows)
            return
        weights = [call_policy(g.policy, "layer_weight", g.policy.layer_weight, self.group_state(g), view)
                   for g in self.weighing]
        rows = view.seen.shape
        for group, weight in zip(self.weighing, weights, strict=True):
            weight = checked(group.policy, "layer weights", weight, rows, "batch")
            if not bool((weight > 0).all()):
                raise KVPolicyError(f"policy {group.policy.name!r} gave layer {self.layer_idx} a weight <= 0 (or NaN); "
                                    "layer weights must be > 0")
        # each row's weight from the policies of its own cells (rows of a sweep may weigh layers by different
        # policies or parameters), as the mean over its cells; 1 for a row whose cells weigh nothing (unread)
        held = torch.stack([g.cells.to(view.seen.device).expand(rows[0], -1).sum(dim=1) for g in self.weighing]).float()
        total = torch.stack([w.float() for w in weights]).mul(held).sum(dim=0)
        self.ledger.report(self.layer_idx, torch.where(held.sum(0) > 0, total / held.sum(0).clamp(min=1), 1.0),
                           open_rows)

    def group_state(self, group: PolicyGroup) -> dict[str, torch.Tensor]:
        """A policy's state: its per-token tensors over the slots in use, and its per-cell ones."""
        token_state, used = self.store.slots.token_state, self.used
        state = {name: token_state[f"{group.prefix}{name}"][:, :, :used] for name in group.policy.state}
        state.update((name, self.cell_state[f"{group.prefix}{name}"]) for name in group.policy.cell_state)
        return state

    def token_view(self) -> TokenView:
        ids, used = self.store.slots.token_state.get("token_ids"), self.used
        merged = self.store.slots.token_state.get(MERGED_TOKENS)
        keys, values = self.store.slot_kv() if self.reads_kv else (None, None)
        return TokenView(
            positions=self.positions[:, :, :used], valid=self.valid[:, :, :used], seen=self.tokens_seen,
            budget=self.budgets.view_limits, token_ids=ids[:, :, :used] if ids is not None else None,
            layer_share=self.ledger.share(self.layer_idx) if self.ledger is not None else None,
            keys=keys, values=values, inv_freq=self.inv_freq, merged=merged[:, :, :used] if merged is not None else None,
        )

    # --- eviction ---------------------------------------------------------------------------------------
    def _scores(self) -> torch.Tensor:
        """Every group's scores for its cells, invalid slots at -inf."""
        return self.policies.scores(self.group_state, self.token_view())

    def _evict(self) -> None:
        if self.awaits_probe:  # the prompt's scores are not all in yet (its store is dense: nothing evicted so far)
            return
        budgets, store = self.budgets, self.store
        if not self.evicting:  # every token stays; a format still settles this pass's tokens (ragged segments)
            count = self.valid[:, :, : self.used].sum(dim=2)
            store.evict(None, count, count)
            return
        if budgets.dynamic:
            budgets.set_by_policies(self.group_state, self.token_view())
        # python-side facts let a packed decode step skip tensor reductions (and their syncs)
        if store.packed_tokens is not None and not self.drops_early:
            if not budgets.any_limited:
                return
            if budgets.uniform_limit is not None:
                over = store.packed_tokens - budgets.uniform_limit
                if over <= budgets.slack and not (over > 0 and self._crossed_block()):
                    return
                if over == 1 and not self.merging:
                    store.drop_one(self._scores().argmin(dim=2))  # the decode step: one token out per cell
                    self.evictions += 1
                    if budgets.align:
                        self._note_eviction(torch.ones_like(self.tokens_seen, dtype=torch.bool))
                    return
        count = self.valid[:, :, : self.used].sum(dim=2)
        if budgets.allocation_pending():
            budgets.allocate(self.group_state, self.token_view(), count)
        limit = budgets.effective(count)
        scores = None
        if budgets.thresholded:  # what a threshold keeps depends on the scores: they are read at every pass
            scores = self._scores()
            limit = budgets.under_threshold(limit, scores, self.tokens_seen)
        over = count - limit
        if (not self.pass_has_pads and int(over.max()) <= budgets.slack and not store.wants_scores()
                and not self._crossed_block(over)):
            store.evict(None, count, count)  # nothing to drop; a format may still settle this pass's tokens
            return
        scores = self._scores() if scores is None else scores
        keep = torch.minimum(limit, (scores > -torch.inf).sum(dim=2))
        if self.merging:
            scores = merge_evicted(store, self.merging, self.group_state, self.token_view(), scores, keep)
            self.has_merged = True
        self.evictions += 1
        self.weighs_tokens_seen = False
        if budgets.align:
            self._note_eviction((count > keep).any(dim=1))
        store.evict(scores, keep, count)
        if isinstance(store, DenseStore) and budgets.any_limited:
            if ragged_pays(budgets.segment_sizes(keep)):
                self.store = RaggedStore.from_dense(store, keep)
            else:
                store.fit(int(keep.max()))

    def _crossed_block(self, over: torch.Tensor | None = None) -> bool:
        """Whether a row over budget (``over`` [B, Hkv] > 0; None: every row) has its next token in a later block of
        `CellBudgets.align` positions than its last eviction: it evicts now (a sync, only with an alignment)."""
        align = self.budgets.align
        if not align or self.evicted_block is None:
            return False
        crossed = (self.tokens_seen // align > self.evicted_block) & (self.evicted_block >= 0)
        if over is not None:
            crossed &= (over > 0).any(dim=1)
        return bool(crossed.any())

    def _note_eviction(self, rows: torch.Tensor) -> None:
        """The block each row that drops tokens now (``rows`` [B] bool) evicts in."""
        if self.evicted_block is None:
            self.evicted_block = torch.full_like(self.tokens_seen, -1)
        self.evicted_block = torch.where(rows, self.tokens_seen // self.budgets.align, self.evicted_block)

    # --- inspection -------------------------------------------------------------------------------------
    def kept_positions(self) -> list[list[list[int]]]:
        """Sorted real-token positions kept per [batch row][KV head] (for tests and reports)."""
        if self.store is None:
            return []
        positions, valid = self.positions[:, :, : self.used], self.valid[:, :, : self.used]
        return [[sorted(positions[b, h][valid[b, h]].tolist()) for h in range(positions.shape[1])]
                for b in range(positions.shape[0])]

    def cell_labels(self) -> list[list[str]]:
        """A label per [batch row][KV head]: the policy's own (FastGen: the head's pattern), else its name."""
        batch, heads = self.valid.shape[:2]
        labels = [[""] * heads for _ in range(batch)]
        for group in self.policies.groups:
            given = call_policy(group.policy, "cell_labels", group.policy.cell_labels, self.group_state(group))
            owned = group.cells.expand(batch, heads).tolist()
            for b in range(batch):
                for h in range(heads):
                    if owned[b][h]:
                        labels[b][h] = given[b][h] if given is not None else group.policy.name
        return labels

    def memory(self) -> LayerMemory:
        """Live and allocated K/V bytes, metadata bytes, token counts, per cell label (`memory_report.layer_memory`)."""
        return layer_memory(self)

    def bytes_per_token(self) -> int:
        """K/V bytes of one token of one cell."""
        return self.store.bytes_per_token()

    def nbytes(self) -> int:
        """Every byte the layer holds: K/V, per-slot metadata, per-cell state, the format's bookkeeping."""
        if self.store is None:
            return 0
        tensors = [*self.store.slots.tensors(), *self.cell_state.values(), *self.store.bookkeeping()]
        return self.store.kv_bytes() + sum(storage_bytes(t) for t in tensors)

"""The static decode step: one token in, one token out, for a layer whose every cell keeps the same number of tokens.

Once a layer holds exactly its budget L in every cell (batch row, KV head), packed in slots
[0, L) of dense storage, a decode step is always the same: the new token goes to slot L,
attention reads slots [0, L] (all valid, so no mask), the policies observe and score, and each
cell's lowest-scoring slot takes slot L's token (drop one by argmin, a gather and a scatter).
Shapes never change and nothing is read back to the host, so ``torch.compile(fullgraph=True)``
captures the step of every such layer, and with them the whole model step, which CUDA graphs
can replay. The step's attention is the torch path's (`backend.torch_ref`: SDPA, or the few ops of
a tracked decode step), whatever backend the layer's other calls run: a compiler fuses those ops
itself, and Triton kernels launched by hand would be opaque to it.

What must not happen inside the step: Python counters that change from step to step (the
compiled graph would be specialized on them and recompiled at every step) and reading a device
value on the host (``.item()``, ``int()``, ``bool()``). So the step leaves the layer's counters
(tokens seen as slots, evictions) to `StaticStep.after_steps`, called outside the
compiled region, and NaN checks of the scores accumulate on the device (`NaNCheck.accumulate`),
read by the caller every few steps.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..backend.call import AttentionCall
from ..policies.base import AttentionStats, TokenView
from ..storage.base import KVStore
from ..storage.dense import DenseStore
from .budgets import CellBudgets
from .policy_group import LayerPolicies, PolicyGroup


class SteppedLayer(Protocol):
    """What the static step reads and writes of its layer (`kvpolicy.cache.layer.PolicyLayer`)."""

    store: KVStore | None
    budgets: CellBudgets
    policies: LayerPolicies
    cell_state: dict[str, torch.Tensor]
    tokens_seen: torch.Tensor  # [B] real tokens per row: the step reads and advances it on the device
    pending: tuple[int, int] | None  # (first slot, count) of the tokens this pass appended
    slots_seen: int
    evictions: int
    # what rules the step out
    drops_early: bool
    merging: list[PolicyGroup]
    token_id_policies: list[str]
    in_cache_cells: torch.Tensor | None
    profiled: bool

    @property
    def valid(self) -> torch.Tensor: ...

    @property
    def positions(self) -> torch.Tensor: ...

    def group_state(self, group: PolicyGroup) -> dict[str, torch.Tensor]: ...

    def token_view(self) -> TokenView: ...


class StaticStep:
    """The static decode step of one layer: whether it applies, and its append, call and eviction.

    It reads and writes only what `SteppedLayer` names: the layer's store and budgets, its policies,
    ``tokens_seen``, the per-cell policy state and the facts that rule the step out; it writes back the
    store's slots, ``tokens_seen``, ``pending``, and, after the steps, ``slots_seen`` and ``evictions``.
    """

    def __init__(self, layer: SteppedLayer):
        self.layer = layer
        #: set by the engine while a compiled step runs: the layer's append, call and end take this path
        self.active = False

    def blocker(self) -> str | None:
        """Why the layer cannot take a static decode step now, or None when it can (Python facts only, no sync)."""
        layer = self.layer
        budgets, store = layer.budgets, layer.store
        if store is None:
            return "the layer has seen no tokens yet"
        if not isinstance(store, DenseStore):
            return "its cells keep different numbers of tokens (ragged storage)"
        if budgets.dynamic or budgets.allocating:
            return "its policies set their own budgets"
        if budgets.uniform_limit is None:
            return "its cells have no one common budget"
        if budgets.align:
            return f"its evictions align to blocks of {budgets.align} (their steps vary)"
        if budgets.slack:
            return f"its budget has slack {budgets.slack} (compaction every slack + 1 steps changes shapes)"
        if layer.drops_early or layer.token_id_policies or layer.in_cache_cells is not None or not layer.profiled:
            return "a policy drops tokens early, reads token ids, moves positions in the cache or profiles the prompt"
        if layer.merging:
            return "a policy merges the tokens it evicts (a merge's targets vary)"
        if layer.reads_kv or layer.reads_query_moments:
            return "a policy reads the cached keys or the queries' moments"
        if store.packed_tokens != budgets.uniform_limit:
            return "the cache is not full to its budget yet"
        if store.capacity < store.used + 1:
            return "no free slot past the budget"
        return None

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's token ([B, Hkv, 1, D]) to slot L; return K/V of slots [0, L]."""
        layer = self.layer
        store, slot = layer.store, layer.store.used
        store.keys[:, :, slot : slot + 1] = keys
        store.values[:, :, slot : slot + 1] = values
        store.slots.valid[:, :, slot] = True
        store.slots.positions[:, :, slot] = layer.tokens_seen[:, None]
        for tensor in store.slots.token_state.values():
            tensor[:, :, slot] = 0
        store.used = slot + 1
        layer.pending = (slot, 1)
        return store.attention_kv()

    def call(self, scaling: float) -> AttentionCall:
        """The step's attention call: one query per row at the row's next position, every slot visible."""
        layer = self.layer
        start = layer.pending[0]
        keys, values = layer.store.attention_kv()
        used = keys.shape[2]
        query_positions = layer.tokens_seen[:, None].clone()
        layer.tokens_seen.add_(1)
        return AttentionCall(
            keys=keys, values=values, valid=layer.valid[:, :, :used], key_positions=layer.positions[:, :, :used],
            query_positions=query_positions, query_valid=None, past_slots=start, scaling=scaling,
            needs=layer.policies.needs, last_rows_window=layer.policies.last_rows_window, backend="torch",
            causal_only=True,
        )

    def end_call(self, stats: AttentionStats | None) -> None:
        """The policies observe the step, then each cell's lowest-scoring slot takes slot L's token."""
        layer = self.layer
        layer.policies.observe(layer.group_state, stats)
        layer.pending = None
        scores = layer.policies.scores(layer.group_state, layer.token_view(), defer_nan_check=True)
        layer.store.drop_one(scores.argmin(dim=2))

    def tensors(self) -> list[torch.Tensor]:
        """The tensors a static step writes in place (K/V, slot metadata, policy state, tokens seen, NaN flags): the
        same objects at every step, so an engine can pin their addresses (CUDA graphs replay on fixed addresses)."""
        layer = self.layer
        store = layer.store
        return [store.keys, store.values, *store.slots.tensors(), *layer.cell_state.values(), layer.tokens_seen,
                *layer.policies.nan_check.flags.values()]

    def prime(self, device: torch.device) -> None:
        """A NaN flag on ``device`` for each policy before compiled steps run, so every step sees the same objects."""
        self.layer.policies.nan_check.prime(self.layer.policies.names, device)

    def raise_noted(self) -> None:
        """Raise for a policy whose scores held NaN in the compiled steps since the last check (reads the device)."""
        self.layer.policies.nan_check.raise_noted()

    def after_steps(self, steps: int) -> None:
        """The counters the compiled steps left alone: ``steps`` tokens seen, ``steps`` evictions."""
        self.layer.slots_seen += steps
        self.layer.evictions += steps

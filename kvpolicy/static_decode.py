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
(tokens seen as slots, evictions) to `StaticDecode.after_static_steps`, called outside the
compiled region, and NaN checks of the scores accumulate on the device (`NaNCheck.accumulate`),
read by the caller every few steps.
"""

from __future__ import annotations

import torch

from .backend.call import AttentionCall
from .policies.base import AttentionStats
from .storage.dense import DenseStore


class StaticDecode:
    """The static decode step of a `PolicyLayer` (mixed into it): readiness, append, the attention call, eviction."""

    #: set by the engine while a compiled step runs: `append`, `begin_call` and `end_call` take the static path
    static: bool = False

    def static_blocker(self) -> str | None:
        """Why this layer cannot take a static decode step now, or None when it can (Python facts only, no sync)."""
        budgets, store = self.budgets, self.store
        if store is None:
            return "the layer has seen no tokens yet"
        if not isinstance(store, DenseStore):
            return "its cells keep different numbers of tokens (ragged storage)"
        if budgets.dynamic or budgets.allocating:
            return "its policies set their own budgets"
        if budgets.uniform_limit is None:
            return "its cells have no one common budget"
        if budgets.slack:
            return f"its budget has slack {budgets.slack} (compaction every slack + 1 steps changes shapes)"
        if self.drops_early or self.token_id_policies or self.in_cache_cells is not None or not self.profiled:
            return "a policy drops tokens early, reads token ids, moves positions in the cache or profiles the prompt"
        if store.packed_tokens != budgets.uniform_limit:
            return "the cache is not full to its budget yet"
        if store.capacity < store.used + 1:
            return "no free slot past the budget"
        return None

    def static_append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's token ([B, Hkv, 1, D]) to slot L; return K/V of slots [0, L]."""
        store, slot = self.store, self.store.used
        store.keys[:, :, slot : slot + 1] = keys
        store.values[:, :, slot : slot + 1] = values
        store.slots.valid[:, :, slot] = True
        store.slots.positions[:, :, slot] = self.tokens_seen[:, None]
        for tensor in store.slots.token_state.values():
            tensor[:, :, slot] = 0
        store.used = slot + 1
        self.pending = (slot, 1)
        return store.attention_kv()

    def static_call(self, scaling: float) -> AttentionCall:
        """The step's attention call: one query per row at the row's next position, every slot visible."""
        start = self.pending[0]
        keys, values = self.store.attention_kv()
        used = keys.shape[2]
        query_positions = self.tokens_seen[:, None].clone()
        self.tokens_seen.add_(1)
        return AttentionCall(
            keys=keys, values=values, valid=self.valid[:, :, :used], key_positions=self.positions[:, :, :used],
            query_positions=query_positions, query_valid=None, past_slots=start, scaling=scaling, needs=self.needs,
            last_rows_window=self.last_rows_window, backend="torch", causal_only=True,
        )

    def static_end_call(self, stats: AttentionStats | None) -> None:
        """The policies observe the step, then each cell's lowest-scoring slot takes slot L's token."""
        self.observe(stats)
        self.pending = None
        scores = self._scores(defer_nan_check=True)
        self.store.drop_one(scores.argmin(dim=2))

    def static_tensors(self) -> list[torch.Tensor]:
        """The tensors a static step writes in place (K/V, slot metadata, policy state, tokens seen, NaN flags): the
        same objects at every step, so an engine can pin their addresses (CUDA graphs replay on fixed addresses)."""
        store = self.store
        return [store.keys, store.values, *store.slots.tensors(), *self.cell_state.values(), self.tokens_seen,
                *self._nan_check.flags.values()]

    def after_static_steps(self, steps: int) -> None:
        """The counters the compiled steps left alone: ``steps`` tokens seen, ``steps`` evictions."""
        self.slots_seen += steps
        self.evictions += steps

"""Merging evicted tokens into kept ones, for policies that ask (`Policy.merges`, e.g. D2O).

At an eviction the layer knows which slots stay; each merging policy says, for its cells,
where the others go (`MergePlan`); the store then rewrites the targets' K/V as weighted means
(`KVStore.merge`) before it drops the sources. One store operation serves every merging policy.
The layer counts, per slot, the evicted tokens merged into it (`MERGED_TOKENS`, `TokenView.merged`), so that a
policy can weigh a slot by what it stands for and attention can count it as that many tokens (`key_bias`).
"""

from __future__ import annotations

import torch

from ..errors import KVPolicyError
from ..policies.base import MergePlan, TokenView
from ..storage.base import KVStore, top_kept
from .policy_group import PolicyGroup, StateOf, call_policy, checked

#: the slot table's entry, on a layer with a merging policy, of the evicted tokens each slot has absorbed
MERGED_TOKENS = "merged_tokens"


def merge_evicted(store: KVStore, groups: list[PolicyGroup], state_of: StateOf, view: TokenView,
                  scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Merge what ``groups`` ask of the tokens outside each cell's ``keep`` [B, Hkv] best ``scores``; return the scores
    with those tokens at -inf, so that the store drops exactly the tokens the policies saw leave (no tie decided twice)."""
    kept = top_kept(scores, keep)
    leaving = view.valid & ~kept
    if not bool(leaving.any()):
        return scores
    keys = store.slot_keys()
    shape = tuple(scores.shape)
    target = torch.full(shape, -1, dtype=torch.long, device=scores.device)
    weight = torch.zeros(shape, device=scores.device)
    self_weight = torch.ones(shape, device=scores.device)
    for group in groups:
        policy = group.policy
        plan = call_policy(policy, "merge", policy.merge, state_of(group), view, keys, kept)
        if not isinstance(plan, MergePlan):
            raise KVPolicyError(f"policy {policy.name!r} merge returned {type(plan).__name__}; expected a MergePlan")
        dims = "batch, kv_heads, slots"
        cells = group.cells.to(scores.device)[:, :, None]
        target = torch.where(cells, checked(policy, "merge targets", plan.target, shape, dims).long(), target)
        weight = torch.where(cells, checked(policy, "merge weights", plan.weight, shape, dims).float(), weight)
        self_weight = torch.where(cells, checked(policy, "merge self weights", plan.self_weight, shape, dims).float(),
                                  self_weight)
        moving = leaving & cells & (target >= 0) & (weight > 0)
        lands = kept.gather(2, target.clamp(0, shape[2] - 1)) & (target < shape[2])
        if bool((moving & ~lands).any()):
            raise KVPolicyError(f"policy {policy.name!r} merges a token into a slot that is not kept; merge targets "
                                "must be slots the cache keeps (kept[b, h, target] true)")
        if bool((moving & ~(self_weight.gather(2, target.clamp(min=0)) > 0)).any()):
            raise KVPolicyError(f"policy {policy.name!r} gave a merge target a self weight <= 0; it must be > 0")
    moving = leaving & (target >= 0) & (weight > 0)
    counts = moving.sum(dim=2, keepdim=True)
    width = int(counts.max())
    if width:
        source = torch.sort((~moving).to(torch.int8), dim=2, stable=True).indices[..., :width]
        present = torch.arange(width, device=scores.device) < counts
        into = target.gather(2, source).clamp(min=0)
        store.merge(source, into, torch.where(present, weight.gather(2, source), 0.0), self_weight.gather(2, into))
        merged = store.slots.token_state[MERGED_TOKENS][:, :, : shape[2]]  # a view: the counts move with their slots
        merged.scatter_add_(2, into, torch.where(present, 1.0 + merged.gather(2, source), 0.0))
    return torch.where(kept, scores, -torch.inf)

"""A layer's policies, as both engines run them: grouped by cell, shown their statistics, called safely.

`make_policies` makes one policy instance per distinct (policy, params) of a plan and prepares it;
`LayerPolicies` is one layer's share of them (a `PolicyGroup` per policy, each owning some cells),
what they read, and the two calls a cache makes of them: observe a call's statistics, score the
tokens. The transformers layer (`layer.PolicyLayer`) and vLLM's paged layer
(`kvpolicy.integrations.vllm.paged`) both go through it. A policy may be a third-party plugin:
its outputs are checked here (shape, NaN) so that a bug in one gives an error naming it rather
than silently evicting the wrong tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..errors import KVPolicyError, first_line
from ..policies.base import AttentionStats, Policy, TokenView

if TYPE_CHECKING:
    from ..recipe.plan import LayerPlan, Plan
    from ..registry import Registry

T = TypeVar("T")
StateOf = Callable[["PolicyGroup"], dict[str, torch.Tensor]]


@dataclass
class PolicyGroup:
    """The cells (batch row, KV head) of one layer that share one policy instance, and so its state."""

    policy: Policy
    cells: torch.Tensor  # [rows, Hkv] bool; rows is 1 (every batch row alike) or B
    prefix: str  # namespace of its state tensors in the layer


def group_cells(cell_keys: list[list[tuple[str, str]]], policies: dict[tuple[str, str], Policy]) -> list[PolicyGroup]:
    """One PolicyGroup per distinct key among ``cell_keys`` [row][KV head] (a `HeadPlan.policy_key` each)."""
    masks: dict[tuple[str, str], torch.Tensor] = {}
    for row_index, row in enumerate(cell_keys):
        for head_index, key in enumerate(row):
            mask = masks.setdefault(key, torch.zeros(len(cell_keys), len(row), dtype=torch.bool))
            mask[row_index, head_index] = True
    return [PolicyGroup(policies[key], mask, f"{index}.") for index, (key, mask) in enumerate(masks.items())]


def make_policies(plans: list[Plan], registry: Registry, model: Any = None, tokenizer: Any = None,
                  known: dict[tuple[str, str], Policy] | None = None,
                  check: Callable[[Policy, int], None] | None = None) -> dict[tuple[str, str], Policy]:
    """One prepared instance per distinct `HeadPlan.policy_key` of ``plans`` (heads with equal keys share it), besides
    the ``known`` ones, which are kept. ``check(policy, layer)``: an engine's refusal, before the policy prepares."""
    policies: dict[tuple[str, str], Policy] = dict(known or {})
    for plan in plans:
        for index, layer in enumerate(plan.layers):
            for head in layer.heads:
                if head.policy_key not in policies:
                    cls = registry.get(head.policy)
                    policy = call_policy(cls, "__init__", cls, head.params)
                    if check is not None:
                        check(policy, index)
                    call_policy(policy, "prepare", policy.prepare, model=model, tokenizer=tokenizer)
                    policies[head.policy_key] = policy
    return policies


class LayerPolicies:
    """One layer's policies: a `PolicyGroup` per distinct policy among its cells, and what they read."""

    def __init__(self, groups: list[PolicyGroup]):
        self.groups = groups
        policies = [g.policy for g in groups]
        self.needs = frozenset().union(*(p.needs for p in policies))
        # statistics only the first attention call reads (a policy's `profile` of the prompt, e.g. FastGen)
        self.profile_needs = frozenset().union(*(p.profile_needs for p in policies)) - self.needs
        self.last_rows_window = max([p.last_rows_window for p in policies if "last_rows" in p.needs] or [0])
        self.nan_check = NaNCheck()

    @classmethod
    def of_rows(cls, rows: list[LayerPlan], policies: dict[tuple[str, str], Policy]) -> LayerPolicies:
        """The policies of one layer whose batch rows follow ``rows`` (one `LayerPlan` for every row, or one each)."""
        return cls(group_cells([[head.policy_key for head in row.heads] for row in rows], policies))

    @property
    def names(self) -> list[str]:
        return [g.policy.name for g in self.groups]

    def token_state(self) -> dict[str, torch.dtype]:
        """The per-token state tensors a cache keeps for these policies: name (the group's prefix + the policy's
        name for it) -> dtype."""
        return {f"{g.prefix}{name}": dtype for g in self.groups for name, dtype in g.policy.state.items()}

    def observe(self, state_of: StateOf, stats: AttentionStats | None) -> None:
        """Each policy that reads statistics observes ``stats`` (cut to what it asked for)."""
        observe_all(self.groups, state_of, stats)

    def scores(self, state_of: StateOf, view: TokenView, defer_nan_check: bool = False) -> torch.Tensor:
        """Every group's scores for its cells, empty slots at -inf. ``defer_nan_check``: a NaN is only noted on the
        device (a compiled step reads nothing back; `NaNCheck.raise_noted` reads it later)."""
        note = self.nan_check.accumulate if defer_nan_check else self.nan_check.note
        return combined_scores(self.groups, state_of, view, note)


def stats_for(policy: Policy, stats: AttentionStats) -> AttentionStats:
    """``stats`` as ``policy`` asked for them: ``last_rows`` holds the layer's widest window, so cut it to the policy's."""
    rows = stats.last_rows
    if rows is None or "last_rows" not in policy.needs or rows.shape[2] <= policy.last_rows_window:
        return stats
    return dataclasses.replace(stats, last_rows=rows[:, :, rows.shape[2] - policy.last_rows_window :])


def checked(policy: Policy, what: str, value: object, shape: tuple[int, ...], dims: str) -> torch.Tensor:
    """A tensor a policy returned (``what``: "returned scores", "allocated budgets", ...), or a clear error naming it."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise KVPolicyError(f"policy {policy.name!r} {what} of shape {got}; expected [{dims}] = {tuple(shape)}")
    return value


def combined_scores(groups: list[PolicyGroup], state_of: StateOf,
                    view: TokenView, note: Callable[[Policy, torch.Tensor], None]) -> torch.Tensor:
    """Each group's keep-priorities on its own cells, checked (shape; ``note``: NaN) and merged into one
    [rows, Hkv, slots] tensor, empty slots at -inf: what a cache ranks its tokens by."""
    scores = None
    for group in groups:
        given = call_policy(group.policy, "score", group.policy.score, state_of(group), view)
        group_scores = checked(group.policy, "returned scores", given, view.valid.shape, "batch, kv_heads, slots").float()
        note(group.policy, group_scores)
        if scores is None:
            scores = group_scores  # its cells, and every other cell until a later group claims it
        else:
            scores = torch.where(group.cells.to(group_scores.device)[:, :, None], group_scores, scores)
    return torch.where(view.valid, scores, -torch.inf)


def observe_all(groups: list[PolicyGroup], state_of: StateOf, stats: AttentionStats | None) -> None:
    """Each group whose policy reads statistics observes ``stats`` (cut to what it asked for)."""
    if stats is None:
        return
    for group in groups:
        if group.policy.needs:
            call_policy(group.policy, "observe", group.policy.observe, state_of(group), stats_for(group.policy, stats))


class NaNCheck:
    """Raises when a policy's scores hold NaN (a plugin bug that would otherwise evict arbitrary tokens).

    On CPU every call is checked. On a GPU, reading a flag back waits for the device to drain
    its queue, once per layer and step: there the flags accumulate on the device and are
    read every ``every`` calls, so a bad policy is stopped within that many evictions.
    """

    def __init__(self, every: int = 32):
        self.every = every
        self.calls = 0
        self.flags: dict[str, torch.Tensor] = {}

    def note(self, policy: Policy, scores: torch.Tensor) -> None:
        if scores.device.type == "cpu":
            # one reduction where two would do: the sum is NaN for any NaN (and for +inf next to -inf, which the exact
            # test then clears); a decode step's few ops cost more in dispatch than in arithmetic
            if math.isnan(scores.sum().item()) and bool(torch.isnan(scores).any()):
                self._raise(policy.name)
            return
        nan = torch.isnan(scores).any()
        flag = self.flags.get(policy.name)
        self.flags[policy.name] = nan if flag is None else flag | nan
        self.calls += 1
        if self.calls % self.every == 0:
            for name, flag in self.flags.items():
                if bool(flag):
                    self._raise(name)

    def prime(self, names: list[str], device: torch.device) -> None:
        """A flag on ``device`` for each policy before compiled steps run, so every step sees the same objects."""
        for name in names:
            self.flags.setdefault(name, torch.zeros((), dtype=torch.bool, device=device))

    def accumulate(self, policy: Policy, scores: torch.Tensor) -> None:
        """Note a NaN on the device only, never read here (a compiled step); `raise_noted` reads the flags."""
        nan = torch.isnan(scores).any()
        flag = self.flags.get(policy.name)
        if flag is None:
            self.flags[policy.name] = nan
        else:
            flag.logical_or_(nan)  # in place: the same tensor from step to step (no new Python object in a graph)

    def raise_noted(self) -> None:
        """Raise for a policy whose scores held NaN since the flags were last read (one host sync per policy)."""
        for name, flag in self.flags.items():
            if bool(flag):
                self._raise(name)

    @staticmethod
    def _raise(name: str) -> None:
        raise KVPolicyError(f"policy {name!r} returned NaN scores; use -inf to drop a token, +inf to pin it")


def call_policy(policy: Policy | type[Policy], hook: str, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)``, a policy's ``hook`` (``score``, ``observe``, ...); a failure names the policy.

    A policy may be a third-party plugin: an exception it raises becomes a KVPolicyError
    that says which policy and hook failed and why (the original is its ``__cause__``).
    KVPolicyError passes through as it is; running out of memory is not the policy's fault
    and passes through too.
    """
    try:
        return function(*args, **kwargs)
    except (KVPolicyError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        name = getattr(policy, "name", None) or getattr(policy, "__name__", repr(policy))
        where = _source_of(policy)
        raise KVPolicyError(
            f"policy {name!r}{where} failed in {hook}: {type(exc).__name__}: {first_line(exc) or '(no message)'}; "
            "this is a bug in the policy: fix it, or use another policy"
        ) from exc


def _source_of(policy: Policy | type[Policy]) -> str:
    cls = policy if isinstance(policy, type) else type(policy)
    module = getattr(cls, "__module__", "") or ""
    return "" if module.startswith("kvpolicy.") else f" (from {module})"

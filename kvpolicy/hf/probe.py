"""Probes: the forward passes a policy scores a prompt by (`Policy.probe_needs`), run right after the prompt.

KVzip scores each prompt token by the attention it gets while the model repeats the prompt; that
needs forward passes the user never asked for, at a point only the cache can see: the end of the
prompt's own pass. A session whose recipe has such a policy hooks the model's forward (`session`):
the prompt's pass is recorded on its way in (`arm`), nothing is evicted at its end, and once it
returns, `run` feeds each row's probe passes (`Policy.probe_chunks`) through the model on the same
cache. Every layer takes each pass's tokens back before the next (`PolicyLayer.end_probe_pass`),
so positions, lengths and what later passes see are the prompt's alone; then every layer evicts.

The rows of a batch run their probe passes together, left-padded to a common length; a row with
fewer passes than another (a shorter prompt, or no probing policy) gets passes of pads only, which
add nothing to any statistic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import KVPolicyError


@dataclass
class Probe:
    """A cache's probe: ``waiting`` for the prompt, ``armed`` while the prompt's pass runs, then ``running``, ``done``."""

    state: str = "waiting"
    prompt_ids: list[list[int]] = field(default_factory=list)  # each row's real prompt tokens


def arm(cache: Any, ids: torch.Tensor | None, mask: torch.Tensor | None) -> None:
    """Before a forward pass on ``cache`` with ``input_ids`` ``ids`` and ``attention_mask`` ``mask``: if it is the
    prompt's, record each row's real tokens."""
    probe = cache.probe
    if probe is None or probe.state != "waiting":
        return
    if not isinstance(ids, torch.Tensor):
        raise KVPolicyError(f"policy {cache.probe_policy_names()} scores the prompt by running it again, but the "
                            "prompt's forward pass gave no input_ids (inputs_embeds alone): call the model with "
                            "input_ids")
    rows = ids.cpu().tolist()
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        real = mask[:, -ids.shape[1]:].bool().cpu().tolist()
        rows = [[t for t, keep in zip(row, keeps, strict=True) if keep] for row, keeps in zip(rows, real, strict=True)]
    probe.prompt_ids, probe.state = rows, "armed"


def run(model: Any, cache: Any, keyword: str) -> None:
    """After the prompt's forward pass on ``cache`` (a PolicyCache, passed to the model as ``keyword``): run every row's
    probe passes, then let every layer evict."""
    probe = cache.probe
    if probe is None or probe.state != "armed":
        return
    probe.state = "running"
    passes = [_row_passes(cache, row, ids) for row, ids in enumerate(probe.prompt_ids)]
    layers = [layer for layer in cache.layers if layer.is_initialized]
    for layer in layers:
        layer.begin_probe()
    device = next(model.parameters()).device
    prompt = torch.tensor([len(row) for row in probe.prompt_ids])
    past = torch.ones(len(passes), cache.layers[0].slots_seen, dtype=torch.long)  # restored after every pass
    with torch.no_grad():
        for index in range(max((len(p) for p in passes), default=0)):
            chunks = [p[index] if index < len(p) else [] for p in passes]
            width = max(1, max(len(chunk) for chunk in chunks))
            ids = torch.zeros(len(chunks), width, dtype=torch.long)
            new = torch.zeros(len(chunks), width, dtype=torch.long)
            for row, chunk in enumerate(chunks):
                if chunk:
                    ids[row, width - len(chunk):] = torch.tensor(chunk)
                    new[row, width - len(chunk):] = 1
            positions = prompt[:, None] + (new.cumsum(dim=1) - 1).clamp(min=0)
            model(input_ids=ids.to(device), attention_mask=torch.cat([past, new], dim=1).to(device),
                  position_ids=positions.to(device), use_cache=True, logits_to_keep=1, **{keyword: cache})
            for layer in layers:
                layer.end_probe_pass()
    for layer in layers:  # every layer's weight first, then every layer evicts: shares see the whole model
        layer.weigh_probe()
    for layer in layers:
        layer.end_probe()
    probe.state = "done"


def _row_passes(cache: Any, row: int, prompt_ids: list[int]) -> list[list[int]]:
    """The probe passes of batch row ``row``: its probing policy's, none if it has none."""
    policies = {id(g.policy): g.policy for layer in cache.layers for g in layer.probing
                if bool(g.cells.expand(len(cache.probe.prompt_ids), -1)[row].any())}
    passes = [policy.probe_chunks(prompt_ids) for policy in policies.values()]
    if any(p != passes[0] for p in passes[1:]):
        names = sorted({policy.name for policy in policies.values()})
        raise KVPolicyError(f"batch row {row} has policies that probe the prompt differently ({', '.join(names)} "
                            "with their params): a row runs one probe; give its probing entries the same policy and "
                            "params")
    return passes[0] if passes else []

"""Re-assigning RoPE positions of cached keys (StreamingLLM's in-cache positions).

Keys are cached after RoPE at their original positions. Rotating a key by
``delta`` more positions gives the key RoPE would have produced at ``position + delta``,
so keys can move to their index within the cache without storing pre-RoPE copies.
"""

from __future__ import annotations

import torch

from ..errors import KVPolicyError


def find_inv_freq(model: torch.nn.Module, head_dim: int) -> torch.Tensor:
    """The model's RoPE inverse frequencies [head_dim / 2]; a clear error if it has none we can use."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor):
            if inv_freq.numel() * 2 != head_dim:
                raise KVPolicyError(
                    "in-cache positions and query moments (expected attention) need RoPE over the whole head "
                    f"(rotate-half layout); this model rotates {inv_freq.numel() * 2} of {head_dim} dims. Use "
                    "positions: original, or a policy that reads attention (h2o, tova, snapkv)"
                )
            return inv_freq.detach().float()
    raise KVPolicyError("in-cache positions and query moments (expected attention) need a RoPE model (no `inv_freq` "
                        "found); use positions: original, or a policy that reads attention (h2o, tova, snapkv)")


def rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate post-RoPE vectors ``x`` [..., T, D] by ``delta`` [..., T] positions (rotate-half layout)."""
    angle = delta[..., None].float() * inv_freq.to(x.device)
    cos, sin = torch.cat([angle.cos()] * 2, dim=-1), torch.cat([angle.sin()] * 2, dim=-1)
    first, second = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-second, first], dim=-1) * sin).to(x.dtype)


def in_cache_deltas(
    positions: torch.Tensor, valid: torch.Tensor, query_slots: slice, query_positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(key deltas [B, H, T], query deltas [B, H, q]) moving each token to its rank among the valid slots."""
    slots = positions.shape[-1]
    order = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max).argsort(dim=-1)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(slots, device=order.device).expand_as(order))
    key_delta = torch.where(valid, ranks - positions, 0)
    query_delta = ranks[..., query_slots] - query_positions[:, None, :]
    return key_delta, torch.where(query_positions[:, None, :] >= 0, query_delta, 0)

"""`attend`: hand an `AttentionCall` to the backend it names."""

from __future__ import annotations

import torch

from . import torch_ref
from .call import AttentionCall, AttentionResult


def attend(query: torch.Tensor, call: AttentionCall) -> AttentionResult:
    """Run ``call`` on its backend (``call.backend``, resolved by `select.select_backend`)."""
    if call.backend == "triton":  # lazy imports: importing triton is slow
        if call.regions is not None:
            from . import triton_tiered

            return triton_tiered.attend(query, call)
        from . import triton_kernels

        return triton_kernels.attend(query, call)
    return torch_ref.attend(query, call)

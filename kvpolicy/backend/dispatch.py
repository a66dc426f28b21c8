"""`attend`: hand an `AttentionCall` to the backend it names."""

from __future__ import annotations

from dataclasses import replace

import torch

from . import torch_ref
from .call import AttentionCall, AttentionResult
from .query_moments import with_query_moments


def attend(query: torch.Tensor, call: AttentionCall) -> AttentionResult:
    """Run ``call`` on its backend (``call.backend``, resolved by `select.select_backend`); the query moments, which
    read no attention, are computed here for every backend."""
    if "query_moments" in call.needs:
        result = _attend(query, replace(call, needs=call.needs - {"query_moments"}))
        return AttentionResult(result.output, with_query_moments(result.stats, query, call))
    return _attend(query, call)


def _attend(query: torch.Tensor, call: AttentionCall) -> AttentionResult:
    if call.backend == "triton":  # lazy imports: importing triton is slow
        if call.regions is not None:
            from . import triton_tiered

            return triton_tiered.attend(query, call)
        from . import triton_kernels

        return triton_kernels.attend(query, call)
    return torch_ref.attend(query, call)

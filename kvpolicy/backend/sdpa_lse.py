"""A causal prompt's attention output and log-sum-exp from PyTorch's own fused kernels (FlashAttention & co.).

For a fresh prompt (every key is one of the call's queries, no pads, no window) the fastest
exact attention there is computes the output; the statistics then need only the log-sum-exp of
each query row, which those kernels return anyway, and one extra pass over Q K^T
(`triton_kernels._prefill_stats_kernel`). So the prefill pays FlashAttention plus that pass,
not a hand-written forward.

Which kernel: on CUDA, FlashAttention for fp16/bf16 and the memory-efficient kernel for fp32
(both return the log-sum-exp); on CPU, ATen's flash kernel for CPU (what the tests check
under ``TRITON_INTERPRET=1``). A kernel that refuses the inputs (an old GPU, a head size it
does not take) gives None, and the caller runs its own forward.
"""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634


def causal_attention_with_lse(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                              scaling: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(output [B, q, Hq, D] in the query's dtype, base-2 log-sum-exp [B, Hq, q] fp32) of causal attention of
    ``query`` [B, Hq, q, D] over ``keys``/``values`` [B, Hkv, q, D] (the same q tokens), or None where no fused
    kernel takes them."""
    groups = query.shape[1] // keys.shape[1]
    if groups > 1:  # the fused kernels want one K/V head per query head: a transient copy for the prompt
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    try:
        out, lse = _fused(query, keys, values, float(scaling))
    except (RuntimeError, NotImplementedError):  # this kernel does not take these inputs here
        return None
    queries = query.shape[2]
    return out.transpose(1, 2), lse[..., :queries].float() * LOG2E


def _fused(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    aten = torch.ops.aten
    if query.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, keys, values, 0.0, True, scale=scaling)
        return out, lse
    if query.device.type != "cuda":
        raise NotImplementedError(query.device.type)
    if query.dtype in (torch.float16, torch.bfloat16):
        result = aten._scaled_dot_product_flash_attention(query, keys, values, 0.0, True, False, scale=scaling)
        return result[0], result[1]
    result = aten._scaled_dot_product_efficient_attention(query, keys, values, None, True, 0.0, True,
                                                          scale=scaling)
    return result[0], result[1]  # (its log-sum-exp may be padded past q: the caller cuts it)

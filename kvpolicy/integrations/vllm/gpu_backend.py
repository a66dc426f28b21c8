"""The GPU side: vLLM's FlashAttention and Triton attention backends, subclassed as the CPU one is (`backend.py`).

Without a ``kvpolicy`` entry every method defers to the stock backend. With one, the same two mixins
(`compact_step.CompactBuilder`, `compact_step.CompactImpl`) keep each request compact, so the backend's own kernel
(FlashAttention's varlen kernel, vLLM's unified Triton kernel) reads it through a block table and a length; the
score pass and the compaction run in kvpolicy's Triton kernels (`backend/triton_paged.py`).

Both backends see a layer's cache as ``[blocks, Hkv, bs, 2 * D]``, keys in the first half of each slot and values
in the second (any physical order: the views keep vLLM's strides). Each step's layers run Python (compaction,
the score pass), so the builders tell vLLM that no CUDA graph may capture attention (vLLM then captures the rest
of the model piecewise) and that a metadata built for one KV cache group may not be reused for another.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from .compact_step import CompactBackend, CompactBuilder, CompactImpl
from .engine import engine_from_config


class _SlotHalves(CompactImpl):
    def cache_views(self, layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) ``[blocks, Hkv, bs, D]``: the halves of each slot of the cache ``[blocks, Hkv, bs, 2D]``."""
        dim = kv_cache.shape[-1] // 2
        return kv_cache[..., :dim], kv_cache[..., dim:]


class _NoCudaGraphs(CompactBuilder):
    supports_update_block_table = False

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if engine_from_config(vllm_config).active:
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)


class KVPolicyFlashAttentionBuilder(_NoCudaGraphs, FlashAttentionMetadataBuilder):
    pass


class KVPolicyFlashAttentionImpl(_SlotHalves, FlashAttentionImpl):
    pass


class KVPolicyFlashAttentionBackend(CompactBackend, FlashAttentionBackend):
    builder_class, impl_class = KVPolicyFlashAttentionBuilder, KVPolicyFlashAttentionImpl


class KVPolicyTritonBuilder(_NoCudaGraphs, TritonAttentionMetadataBuilder):
    pass


class KVPolicyTritonImpl(_SlotHalves, TritonAttentionImpl):
    pass


class KVPolicyTritonBackend(CompactBackend, TritonAttentionBackend):
    builder_class, impl_class = KVPolicyTritonBuilder, KVPolicyTritonImpl

"""The CPU side: vLLM's CPU attention backend, subclassed so that kvpolicy's policies run in it.

Without a ``kvpolicy`` entry in vLLM's ``additional_config`` every method defers to the stock backend. With one,
the two mixins of `compact_step` keep each request compact, so that vLLM's CPU kernel computes every output from
a block table and a length, and add the score pass and the compaction. vLLM's CPU kernel stores each block's keys
transposed (`paged.cpu_cache_views`); its layout depends on the CPU's instruction set, so it is checked once per
process against vLLM's own write (`check_cpu_layout`).
"""

from __future__ import annotations

import functools

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from ...errors import KVPolicyError
from .compact_step import CompactBackend, CompactBuilder, CompactImpl
from .paged import cpu_cache_views


class KVPolicyMetadataBuilder(CompactBuilder, CPUAttentionMetadataBuilder):
    pass


class KVPolicyImpl(CompactImpl, CPUAttentionBackendImpl):
    def cache_views(self, layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        check_cpu_layout(kv_cache, layer.isa)
        return cpu_cache_views(kv_cache)


class KVPolicyCPUBackend(CompactBackend, CPUAttentionBackend):
    builder_class = KVPolicyMetadataBuilder
    impl_class = KVPolicyImpl


def check_cpu_layout(kv_cache: torch.Tensor, isa: str) -> None:
    """vLLM's own write (its kernel's layout, which depends on the CPU's instruction set) puts keys and values where
    `paged.cpu_cache_views` reads them; else one clear line."""
    _check_cpu_layout(tuple(kv_cache.shape[1:]), kv_cache.dtype, isa)


@functools.cache  # once per process and cache shape
def _check_cpu_layout(shape: tuple[int, int, int], dtype: torch.dtype, isa: str) -> None:
    from vllm import _custom_ops as ops

    heads, block_size, both = shape
    dim = both // 2
    scratch = torch.zeros(1, heads, block_size, both, dtype=dtype)
    # small whole numbers, exact in every dtype the kernel takes
    keys = (torch.arange(block_size * heads * dim) % 61).view(block_size, heads, dim).to(dtype)
    values = (torch.arange(block_size * heads * dim) % 59).view(block_size, heads, dim).to(dtype)
    key_cache, value_cache = scratch.view(1, heads, 2 * block_size, dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, torch.arange(block_size), isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    read_keys, read_values = cpu_cache_views(scratch)
    if not (torch.equal(read_keys[0].transpose(0, 1), keys) and torch.equal(read_values[0].transpose(0, 1), values)):
        raise KVPolicyError(f"kvpolicy: vLLM's CPU attention kernel ({isa}, {dtype}) lays out its KV cache in a way "
                            "kvpolicy does not read yet; serve without the kvpolicy entry, or in float32")

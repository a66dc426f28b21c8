"""On GPU platforms: vLLM's default CUDA attention backends, unchanged, except that an engine whose config asks
for kvpolicy stops at start instead of silently serving the full cache: the GPU path (a paged score pass from
FlashAttention's log-sum-exp) is not written yet (docs/vllm.md, "The GPU plan").
"""

from __future__ import annotations

from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from ...errors import KVPolicyError
from .settings import PREFIX, read_settings


def refuse_if_configured() -> None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is not None and read_settings(getattr(config, "additional_config", None)) is not None:
        raise KVPolicyError(f"{PREFIX}: kvpolicy's vLLM integration runs on vLLM's CPU backend so far; on a GPU "
                            "engine it is not written yet (docs/vllm.md, 'The GPU plan'): serve without the entry, "
                            "or use kvpolicy's transformers path (kvpolicy.attach)")


class GuardedFlashAttentionImpl(FlashAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        refuse_if_configured()
        super().__init__(*args, **kwargs)


class GuardedFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[GuardedFlashAttentionImpl]:
        return GuardedFlashAttentionImpl


class GuardedTritonAttentionImpl(TritonAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        refuse_if_configured()
        super().__init__(*args, **kwargs)


class GuardedTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[GuardedTritonAttentionImpl]:
        return GuardedTritonAttentionImpl

"""kvpolicy inside vLLM: a recipe evicts from vLLM's paged KV cache, and the blocks it empties go back to the pool.

Installed with ``pip install "kvpolicy[vllm]"`` next to vLLM; vLLM finds `register` through its
``vllm.general_plugins`` entry point and calls it in every process. It overrides the CPU attention backend
and registers a KV cache spec; both defer to the stock ones unless the engine's config has a ``kvpolicy`` entry:

    LLM(model, additional_config={"kvpolicy": {"recipe": "h2o"}}, enable_prefix_caching=False)

See docs/vllm.md. `settings`, `schedule`, `paged` and `engine` import no vLLM; `spec` and `backend` do.
"""

from __future__ import annotations

BACKEND_CLASS = "kvpolicy.integrations.vllm.backend.KVPolicyCPUBackend"
GPU_GUARDS = {"FLASH_ATTN": "kvpolicy.integrations.vllm.gpu_guard.GuardedFlashAttentionBackend",
              "TRITON_ATTN": "kvpolicy.integrations.vllm.gpu_guard.GuardedTritonAttentionBackend"}


def register() -> None:
    """vLLM's plugin hook: cheap, and safe to call many times and in every process."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if not current_platform.is_cpu():
        # no GPU path yet (docs/vllm.md, "The GPU plan"): the default CUDA backends refuse a kvpolicy entry at start
        for name, path in GPU_GUARDS.items():
            register_backend(AttentionBackendEnum[name], path)
        return
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from .spec import KVPolicyManager, KVPolicySpec

    # the registry fills itself with vLLM's own specs only while it is empty: let it, then add ours
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(KVPolicySpec, KVPolicyManager, uniform_type_base_spec=FullAttentionSpec)
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_CLASS)

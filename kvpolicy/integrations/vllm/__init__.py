"""kvpolicy inside vLLM: a recipe evicts from vLLM's paged KV cache, and the blocks it empties go back to the pool.

Installed with ``pip install "kvpolicy[vllm]"`` next to vLLM; vLLM finds `register` through its
``vllm.general_plugins`` entry point and calls it in every process. It overrides the attention backends (CPU;
on CUDA, FlashAttention and Triton) and registers a KV cache spec; all defer to the stock ones unless the
engine's config has a ``kvpolicy`` entry:

    LLM(model, additional_config={"kvpolicy": {"recipe": "h2o"}}, enable_prefix_caching=False)

See docs/vllm.md. `settings`, `schedule`, `paged`, `score_pass`, `deferred`, `engine` and `compact_step` import no
vLLM; `spec`, `frontend`, `backend` and `gpu_backend` do (`frontend` when called).
"""

from __future__ import annotations

CPU_BACKEND = "kvpolicy.integrations.vllm.backend.KVPolicyCPUBackend"
GPU_BACKENDS = {"FLASH_ATTN": "kvpolicy.integrations.vllm.gpu_backend.KVPolicyFlashAttentionBackend",
                "TRITON_ATTN": "kvpolicy.integrations.vllm.gpu_backend.KVPolicyTritonBackend"}


def register() -> None:
    """vLLM's plugin hook: cheap, and safe to call many times and in every process."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from .frontend import check_before_engines_start
    from .spec import KVPolicyManager, KVPolicySpec

    check_before_engines_start()  # in the process that makes the configuration: a bad entry fails in seconds
    # the registry fills itself with vLLM's own specs only while it is empty: let it, then add ours
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(KVPolicySpec, KVPolicyManager, uniform_type_base_spec=FullAttentionSpec)
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
        return
    for name, path in GPU_BACKENDS.items():  # CUDA: the two backends vLLM picks for a Llama-like model
        register_backend(AttentionBackendEnum[name], path)

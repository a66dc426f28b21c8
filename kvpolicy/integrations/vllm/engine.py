"""The recipe a vLLM engine runs, resolved once per process from its config, and the engine features it refuses.

Every vLLM process that runs layers (the workers) builds one `Engine` from the ``VllmConfig`` it was started
with; the attention backend, its metadata builder and its KV cache spec all read the same one. It imports no
vLLM: the config is read by attribute, so the checks are tested without an engine.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from ...errors import KVPolicyError
from .schedule import evicts_during_prefill
from .settings import PREFIX, PagedLayer, PagedPlan, Settings, paged_plan, read_settings

logger = logging.getLogger("vllm.kvpolicy")

_ENGINE: Engine | None = None


class Engine:
    """``active`` when the config has a kvpolicy entry whose recipe evicts; ``plan`` is then the paged plan."""

    def __init__(self, settings: Settings | None, plan: PagedPlan | None, fingerprint: Any = None):
        self.settings, self.plan, self.fingerprint = settings, plan, fingerprint

    @property
    def active(self) -> bool:
        return self.plan is not None

    def layer(self, layer_name: str) -> PagedLayer:
        """The plan of the decoder layer a vLLM attention module belongs to ("model.layers.7.self_attn.attn")."""
        numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
        if len(numbers) != 1 or not 0 <= numbers[0] < len(self.plan.layers):
            raise KVPolicyError(f"kvpolicy: cannot tell which of the model's {len(self.plan.layers)} layers the "
                                f"attention module {layer_name!r} belongs to")
        return self.plan.layers[numbers[0]]


def engine_from_config(vllm_config: Any) -> Engine:
    """This process's engine for ``vllm_config`` (built at the first call; the same config gives the same one)."""
    global _ENGINE
    parallel = vllm_config.parallel_config
    fingerprint = (id(vllm_config), getattr(parallel, "rank", 0))
    if _ENGINE is not None and _ENGINE.fingerprint == fingerprint:
        return _ENGINE
    settings = read_settings(getattr(vllm_config, "additional_config", None))
    plan = None
    if settings is not None:
        check_engine(vllm_config)
        model = vllm_config.model_config
        total_heads = model.get_total_num_kv_heads()
        tp_size = getattr(parallel, "tensor_parallel_size", 1)
        heads = rank_heads(total_heads, tp_size, getattr(parallel, "rank", 0) % tp_size)
        plan = paged_plan(settings, model.get_total_num_hidden_layers(), total_heads,
                          vllm_config.cache_config.block_size, heads=heads)
        if plan is not None:
            plan.step_tokens = getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None)
            check_prefix_caching(plan, settings.recipe, vllm_config.cache_config)
        if plan is None:
            logger.info("kvpolicy: recipe %r evicts nothing; vLLM runs with its full cache", settings.recipe)
        else:
            logger.info("kvpolicy: %s (block size %d)", plan.describe(), vllm_config.cache_config.block_size)
            for reason in load_dependence(plan, vllm_config.scheduler_config):
                logger.warning("kvpolicy: answers may depend on load: %s", reason)
    _ENGINE = Engine(settings, plan, fingerprint)
    return _ENGINE


def load_dependence(plan: PagedPlan, scheduler_config: Any) -> list[str]:
    """Why a greedy answer could differ from the same request's answer alone under this configuration (none: it
    cannot). Said at start-up: the guarantee holds only where both the admission and the eviction points are
    independent of what else the engine runs."""
    reasons = []
    if plan.preemption == "recompute":
        reasons.append("preemption: recompute; a request vLLM preempts is recomputed from its prompt and output and "
                       "evicted anew, which keeps other tokens than its run alone (the default, preemption: never, "
                       "admits requests so that none is preempted)")
    if evicts_during_prefill(plan.rules, plan.evict_during_prefill) and getattr(scheduler_config, "enable_chunked_prefill", True):
        reasons.append("evictions between a prompt's chunks (evict_during_prefill, or budgets in tokens) fall where "
                       "vLLM's chunked prefill splits the prompt, which depends on the other requests of the step; "
                       "a ratio budget without evict_during_prefill, or --no-enable-chunked-prefill, evicts a "
                       "prompt only once it is in")
    return reasons


def check_prefix_caching(plan: PagedPlan, recipe: str, cache_config: Any) -> None:
    """Prefix caching runs with policies that read no attention statistics, or only sums over queries: a request
    that finds its prompt's start in the cache never ran those tokens' queries, and gets their state as a full
    prefill leaves it there (`PagedLayerCache.save_snapshot`), which only a sum can be continued from."""
    if not getattr(cache_config, "enable_prefix_caching", False) or plan.prefix_cacheable:
        return
    readers = sorted({group.policy.name for layer in plan.layers for group in layer.policies.groups
                      if group.policy.needs and not group.policy.additive})
    raise KVPolicyError(
        f"{PREFIX}: prefix caching is on, but recipe {recipe!r} ranks tokens by attention statistics that are not "
        f"sums over queries ({', '.join(readers) or 'in the KV heads of other ranks'}), which a request reusing a cached prefix cannot rebuild; turn it "
        "off (LLM(..., enable_prefix_caching=False) or vllm serve --no-enable-prefix-caching), or serve a recipe "
        "that reads none or only sums (streaming, window, h2o without decay, roco)")


def rank_heads(total: int, tp_size: int, tp_rank: int) -> range:
    """The KV heads a tensor-parallel rank holds, as vLLM splits them: a run of ``total / tp_size`` each, or, with
    fewer heads than ranks, one head that ``tp_size / total`` neighbouring ranks hold alike."""
    if total >= tp_size:
        per_rank = total // tp_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    head = tp_rank // (tp_size // total)
    return range(head, head + 1)


def process_engine() -> Engine | None:
    """The engine this process built, if any (a KV cache spec is customized without the config in hand)."""
    if _ENGINE is not None:
        return _ENGINE
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    config = get_current_vllm_config_or_none()
    return engine_from_config(config) if config is not None else None


def check_engine(vllm_config: Any) -> None:
    """Refuse, in one line each, the engine features a paged kvpolicy cache cannot run with."""
    cache = vllm_config.cache_config
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise KVPolicyError(f"{PREFIX}: speculative decoding is on; kvpolicy's eviction schedule counts one "
                            "accepted token per step: serve without speculative_config")
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        raise KVPolicyError(f"{PREFIX}: pipeline parallelism is not supported yet; serve with "
                            "pipeline_parallel_size=1 (tensor parallelism works)")
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        raise KVPolicyError(f"{PREFIX}: decode context parallelism splits a request's tokens between ranks, which "
                            "evict them as one; serve with decode_context_parallel_size=1 (tensor parallelism works)")
    kv_dtype = str(getattr(cache, "cache_dtype", "auto"))
    if kv_dtype != "auto":
        raise KVPolicyError(f"{PREFIX}: kv_cache_dtype={kv_dtype!r}; the kvpolicy cache stores K/V in the model's "
                            "dtype: leave kv_cache_dtype at 'auto'")
    if re.search(r"sliding", str(getattr(vllm_config.model_config.hf_text_config, "layer_types", "") or "")):
        raise KVPolicyError(f"{PREFIX}: the model has sliding-window layers; kvpolicy's vLLM integration runs "
                            "models whose layers are all full attention")

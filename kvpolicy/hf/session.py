"""`attach`: a recipe on a transformers model, as a `Session` that makes its caches.

`attach` resolves the recipe for the model's layers and KV heads, registers kvpolicy's
attention function (`attention.py`) and switches the model to it; `Session.new_cache`
builds a `PolicyCache` whose layers share the session's policy instances.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from ..backend.rotary import find_inv_freq
from ..backend.select import select_backend
from ..cache.layer_shares import LayerLedger
from ..cache.policy_group import LayerPolicies, make_policies
from ..errors import KVPolicyError
from ..policies.base import Policy
from ..recipe import Recipe, load_recipe
from ..recipe.plan import Plan
from ..recipe.schema import MAX_TOKENS
from ..registry import Registry, get_registry
from . import probe
from .attention import ATTENTION_NAME, no_cache_warning_off, register
from .cache import CacheLayer, PolicyCache, cache_keyword
from .compiled import CompiledDecoder, generate_arguments


@dataclass
class Session:
    """A model with a recipe attached. ``new_cache()`` makes the cache to pass to ``generate``."""

    model: PreTrainedModel
    plan: Plan
    registry: Registry
    previous_attention: str
    #: the model's tokenizer, for policies that need it (FastGen's special and punctuation tokens); may be None
    tokenizer: Any = None
    #: one plan per batch row (`attach_rows`), or empty: ``plan`` applies to every row
    row_plans: list[Plan] = field(default_factory=list)
    last_cache: PolicyCache | None = None
    #: set by `compile`: decode steps run through one compiled model step
    compiled: CompiledDecoder | None = None
    #: the model's detach count when this session was attached: it is live while they match
    _epoch: int = 0
    _policies: dict[tuple[str, str], Policy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._policies = make_policies([self.plan, *self.row_plans], self.registry, self.model, self.tokenizer,
                                       known=self._policies)

    def _check_attached(self, what: str) -> None:
        if self.model.__dict__.get(_EPOCH, 0) != self._epoch:
            raise KVPolicyError(
                f"cannot {what}: this session was detached from the model (by its own detach(), or by the detach() of "
                "another session on the same model), so its cache would evict nothing; attach the recipe again: "
                "session = kvpolicy.attach(model, recipe)"
            )
        current = self.model.config._attn_implementation
        if current != ATTENTION_NAME:
            raise KVPolicyError(
                f"cannot {what}: the model runs {current!r} attention, not kvpolicy's, so its cache would evict "
                f"nothing; switch back with model.set_attn_implementation({ATTENTION_NAME!r}) or attach the recipe again"
            )

    def new_cache(self, prompt_tokens: int | None = None) -> PolicyCache:
        """A fresh cache; ratio budgets resolve from the first forward's real tokens, or ``prompt_tokens``.

        Raises KVPolicyError if the session is no longer attached (see `detach`).
        """
        self._check_attached("make a cache")
        if prompt_tokens is not None and (not isinstance(prompt_tokens, int) or isinstance(prompt_tokens, bool)
                                          or not 1 <= prompt_tokens <= MAX_TOKENS):
            raise KVPolicyError(f"prompt_tokens={prompt_tokens!r}: give the prompt's length, a whole number >= 1")
        plans = self.row_plans or [self.plan]
        layer_rows = [[plan.layers[index] for plan in plans] for index in range(len(self.plan.layers))]
        layer_policies = [LayerPolicies.of_rows(rows, self._policies) for rows in layer_rows]
        weighing = {index for index, policies in enumerate(layer_policies)
                    if any(g.policy.weighs_layers for g in policies.groups)}
        ledger = LayerLedger(weighing) if weighing else None
        layers, query_groups = [], self._query_groups()
        for index, (rows, policies) in enumerate(zip(layer_rows, layer_policies, strict=True)):
            rotary = any(g.policy.in_cache_positions or "query_moments" in g.policy.needs for g in policies.groups)
            inv_freq = self._inv_freq() if rotary else None
            layers.append(CacheLayer(index, rows, policies, prompt_tokens, self.plan.backend, inv_freq, ledger,
                                     query_groups=query_groups))
        config = self.model.config
        self.last_cache = PolicyCache(layers, attention=lambda: config._attn_implementation)
        if self.last_cache.token_feed is not None or self.last_cache.probe is not None:
            _install_hooks(self.model)
        return self.last_cache

    def _query_groups(self) -> int | None:
        """Query heads per KV head, from the model's config (None where it does not say)."""
        config = self.model.config.get_text_config()
        q_heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
        return q_heads // kv_heads if isinstance(q_heads, int) and isinstance(kv_heads, int) and kv_heads else None

    def _inv_freq(self) -> torch.Tensor:
        if "inv_freq" not in self.__dict__:
            config = self.model.config.get_text_config()
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            self.__dict__["inv_freq"] = find_inv_freq(self.model, head_dim)
        return self.__dict__["inv_freq"]

    def generate(self, *args: Any, prompt_tokens: int | None = None, **kwargs: Any) -> torch.Tensor:
        """``model.generate`` with a fresh kvpolicy cache (available afterwards as ``last_cache``).

        With ``use_cache=False`` (as an argument or in the generation config) there is no cache
        to evict from: the call runs plain attention over every token, so it gives the full
        cache's tokens, says so in a warning, and leaves ``last_cache`` None. Raises
        KVPolicyError if the session is no longer attached (see `detach`).
        """
        self._check_attached("generate")
        config = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        use_cache = kwargs.get("use_cache", getattr(config, "use_cache", True))
        if use_cache is False:
            warnings.warn(
                f"session.generate(use_cache=False): without a KV cache nothing can be evicted, so recipe "
                f"{self.plan.name!r} does not apply and the tokens are the full cache's; drop use_cache=False "
                "to evict", stacklevel=2,
            )
            self.last_cache = None
            with no_cache_warning_off():
                return self.model.generate(*args, **kwargs)
        if self.compiled is not None:
            chosen = generate_arguments(args, kwargs, self.model)
            return self.compiled.generate(self.new_cache(prompt_tokens), **chosen)
        kwargs[cache_keyword(self.model)] = self.new_cache(prompt_tokens)
        return self.model.generate(*args, **kwargs)

    def compile(self, **options: Any) -> Session:
        """Decode through a compiled model step from now on: ``torch.compile(fullgraph=True, dynamic=False,
        **options)`` of the whole model step, eviction included (e.g. ``mode="reduce-overhead"`` for CUDA graphs,
        ``backend="aot_eager"`` to check a graph without inductor). Returns the session.

        `generate` then prefills eagerly and decodes greedily, each step compiled once every layer keeps one common
        budget in every cell with no slack (`kvpolicy.cache.static_step`; steps before the cache is full run eagerly).
        A layer that never gets there (a `full` layer, per-head budgets, AdaKV, FastGen, slack) keeps every step
        eager: `kvpolicy.hf.compiled.static_blockers(cache)` says why. ``session.compiled.step(cache, tokens)`` is the
        step alone, for a decoding loop of one's own.
        """
        self.compiled = CompiledDecoder(self.model, **options)
        return self

    def detach(self) -> None:
        """Give the model back its attention implementation from before the first attach (and drop kvpolicy's hooks).

        Every session on the model is detached with it (they share the model's attention):
        their ``generate`` and ``new_cache`` then raise KVPolicyError rather than silently
        evict nothing; attach again for a new session. Detaching twice does nothing.
        """
        if self.model.__dict__.get(_EPOCH, 0) != self._epoch:
            return  # already detached, by itself or by another session: the model may belong to a newer one
        self.model.__dict__[_EPOCH] = self._epoch + 1
        self.model.set_attn_implementation(self.model.__dict__.pop(_ORIGINAL, self.previous_attention))
        for handle in self.model.__dict__.pop(_HOOKS, ()):
            handle.remove()


#: model.__dict__ keys: how many detaches the model has seen (a session is live while it matches the
#: count at its attach), the attention from before the first attach, and the forward hooks
_EPOCH = "_kvpolicy_epoch"
_ORIGINAL = "_kvpolicy_original_attention"
_HOOKS = "_kvpolicy_forward_hooks"


def _install_hooks(model: PreTrainedModel) -> None:
    """Hooks on ``model`` that hand each forward pass's ``input_ids`` to its PolicyCache and run a cache's probe
    right after its prompt's pass (`probe`), once per model.

    Only sessions whose policies read token ids (FastGen) or probe the prompt (KVzip) install them; calls with
    ``inputs_embeds`` alone leave the cache without ids, and such a policy then says so.
    """
    if _HOOKS in model.__dict__:
        return

    def cache_of(kwargs: dict[str, Any]) -> PolicyCache | None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        wants = isinstance(cache, PolicyCache) and (cache.token_feed is not None or cache.probe is not None)
        return cache if wants else None

    def before(module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        cache = cache_of(kwargs)
        if cache is not None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            ids = ids if isinstance(ids, torch.Tensor) else None
            if cache.token_feed is not None:
                cache.token_feed.ids = ids
            probe.arm(cache, ids, kwargs.get("attention_mask"))

    def after(module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        cache = cache_of(kwargs)
        if cache is not None:
            if cache.token_feed is not None:
                cache.token_feed.ids = None  # never reused by a later call that brings none
            probe.run(module, cache, cache_keyword(module))

    model.__dict__[_HOOKS] = (
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    )


def model_shape(model: PreTrainedModel) -> tuple[int, int]:
    """(decoder layers, KV heads) of a transformers causal LM."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    if layers is None or heads is None:
        raise KVPolicyError(f"cannot tell the number of layers and KV heads of {type(model).__name__}")
    return checked_shape(layers, heads, type(model).__name__)


def checked_shape(layers: object, heads: object, what: str) -> tuple[int, int]:
    """(layers, KV heads) of a model's config, each a whole number >= 1, or a KVPolicyError naming ``what``."""
    for name, value in (("num_hidden_layers", layers), ("num_key_value_heads", heads)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KVPolicyError(f"{what} has {name} = {value!r} in its config: it must be a whole number >= 1")
    return layers, heads


def attach(
    model: PreTrainedModel, recipe: Any, *, backend: str | None = None, registry: Registry | None = None,
    tokenizer: Any = None,
) -> Session:
    """Attach a recipe (a Recipe, a Plan, a YAML path or a built-in recipe name) to ``model``.

    ``tokenizer``: the model's tokenizer, needed by policies that read it (FastGen takes its
    special and punctuation tokens from it unless the recipe lists them).
    """
    registry = registry or get_registry()
    num_layers, num_kv_heads = model_shape(model)
    if isinstance(recipe, Plan):
        plan = recipe
    else:
        if not isinstance(recipe, Recipe):
            recipe = load_recipe(recipe if not isinstance(recipe, Path) else str(recipe), registry=registry)
        plan = recipe.resolve(num_layers, num_kv_heads)
    if len(plan.layers) != num_layers:
        raise KVPolicyError(f"the plan has {len(plan.layers)} layers but the model has {num_layers}")
    device = next(model.parameters()).device
    # precedence: the explicit argument, then $KVPOLICY_BACKEND, then the recipe's `backend:`
    plan.backend = select_backend(backend, device, use_env=False) if backend else select_backend(plan.backend, device)
    register()
    previous = model.config._attn_implementation or "sdpa"
    if previous == ATTENTION_NAME:
        previous = model.__dict__.get(_ORIGINAL, "sdpa")
    session = Session(model=model, plan=plan, registry=registry, previous_attention=previous, tokenizer=tokenizer,
                      _epoch=model.__dict__.get(_EPOCH, 0))
    model.__dict__.setdefault(_ORIGINAL, previous)
    model.set_attn_implementation(ATTENTION_NAME)
    return session


def attach_rows(
    model: PreTrainedModel, recipes: list[Any], *, registry: Registry | None = None, tokenizer: Any = None
) -> Session:
    """Attach one recipe per batch row: row i of every batch follows ``recipes[i]``.

    Lets a sweep run several recipes (or budgets) as rows of one forward pass.
    """
    if not recipes:
        raise KVPolicyError("attach_rows needs at least one recipe")
    sessions = [attach(model, recipe, registry=registry, tokenizer=tokenizer) for recipe in recipes]
    first = sessions[0]
    first.row_plans = [session.plan for session in sessions]
    first.__post_init__()
    return first

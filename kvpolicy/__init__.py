"""kvpolicy: per-layer, per-head KV-cache eviction policies for Hugging Face transformers.

    model, tok = kvpolicy.load_model("smollm2")
    session = kvpolicy.attach(model, kvpolicy.load_recipe("h2o"))
    out = model.generate(**tok(prompt, return_tensors="pt"), cache=session.new_cache())
    print(session.last_cache.memory_report())

The names below load on first use (PEP 562), so ``import kvpolicy.recipe`` and the rest of the policy side
never import transformers; ``kvpolicy.attach`` and the other transformers names import it when first read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "AttentionStats": "kvpolicy.policies.base",
    "Budget": "kvpolicy.recipe.budget",
    "KVPolicyError": "kvpolicy.errors",
    "MemoryReport": "kvpolicy.cache.memory_report",
    "Plan": "kvpolicy.recipe.plan",
    "Policy": "kvpolicy.policies.base",
    "PolicyCache": "kvpolicy.hf.cache",
    "Recipe": "kvpolicy.recipe",
    "RecipeError": "kvpolicy.errors",
    "Session": "kvpolicy.hf.session",
    "TokenView": "kvpolicy.policies.base",
    "attach": "kvpolicy.hf.session",
    "attach_rows": "kvpolicy.hf.session",
    "get_registry": "kvpolicy.registry",
    "hookimpl": "kvpolicy.hookspecs",
    "load_model": "kvpolicy.hf.models",
    "load_recipe": "kvpolicy.recipe",
    "with_budget": "kvpolicy.recipe",
}

__all__ = [
    "AttentionStats", "Budget", "KVPolicyError", "MemoryReport", "Plan", "Policy", "PolicyCache", "Recipe",
    "RecipeError", "Session", "TokenView", "attach", "attach_rows", "get_registry", "hookimpl", "load_model",
    "load_recipe", "with_budget",
]

if TYPE_CHECKING:
    from .cache.memory_report import MemoryReport
    from .errors import KVPolicyError, RecipeError
    from .hf.cache import PolicyCache
    from .hf.models import load_model
    from .hf.session import Session, attach, attach_rows
    from .hookspecs import hookimpl
    from .policies.base import AttentionStats, Policy, TokenView
    from .recipe import Recipe, load_recipe, with_budget
    from .recipe.budget import Budget
    from .recipe.plan import Plan
    from .registry import get_registry


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None and not name.startswith("__"):
        # a submodule not imported yet (kvpolicy.recipe after a bare `import kvpolicy`), as the eager package gave
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

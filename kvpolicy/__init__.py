"""kvpolicy: per-layer, per-head KV-cache eviction policies for Hugging Face transformers.

    model, tok = kvpolicy.load_model("smollm2")
    session = kvpolicy.attach(model, kvpolicy.load_recipe("h2o"))
    out = model.generate(**tok(prompt, return_tensors="pt"), cache=session.new_cache())
    print(session.last_cache.memory_report())
"""

from __future__ import annotations

from .attach import Session, attach, attach_rows
from .cache import MemoryReport, PolicyCache
from .errors import KVPolicyError, RecipeError
from .hookspecs import hookimpl
from .models import load_model
from .plan import Budget, Plan
from .policies.base import AttentionStats, Policy, TokenView
from .recipe import Recipe, load_recipe, with_budget
from .registry import get_registry

__version__ = "0.1.0"

__all__ = [
    "AttentionStats", "Budget", "KVPolicyError", "MemoryReport", "Plan", "Policy", "PolicyCache", "Recipe",
    "RecipeError", "Session", "TokenView", "attach", "attach_rows", "get_registry", "hookimpl", "load_model",
    "load_recipe", "with_budget",
]

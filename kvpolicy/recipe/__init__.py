"""Recipes: a YAML file (or mapping) read, checked and resolved into a `Plan` for a model's shape.

`load` reads a recipe (`load_recipe`, `with_budget`) and `resolve` spreads its rules and budgets over
layers and KV heads; `budget` is the one budget object, from the YAML to a layer's limits; `plan` is what
resolving gives; `schema`, `checks` and `selectors` are the keys, the line-aware checks and the
layer/head selectors. Nothing here imports an engine.
"""

from .load import Recipe, builtin_recipe_names, load_recipe, with_budget

__all__ = ["Recipe", "builtin_recipe_names", "load_recipe", "with_budget"]

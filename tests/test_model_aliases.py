"""Model aliases from plugins (`kvpolicy_register_model_aliases`): load_model resolves them through the registry."""

from __future__ import annotations

import types

import pytest

from kvpolicy import hookimpl
from kvpolicy.errors import KVPolicyError
from kvpolicy.hf.models import load_model, model_aliases, resolve_alias
from kvpolicy.registry import Registry


def alias_plugin(aliases: object) -> types.ModuleType:
    module = types.ModuleType("alias_plugin")

    @hookimpl
    def kvpolicy_register_model_aliases():
        if isinstance(aliases, Exception):
            raise aliases
        return aliases

    module.kvpolicy_register_model_aliases = kvpolicy_register_model_aliases
    return module


def registry_with(**plugins: object) -> Registry:
    registry = Registry(load_entry_points=False)
    for name, aliases in plugins.items():
        registry.add_plugin(alias_plugin(aliases), name)
    return registry


def test_load_model_resolves_a_plugin_alias_to_its_folder(tiny):
    folder, _ = tiny
    registry = registry_with(lab={"Tiny-Llama": folder, "tiny2": "tiny-llama"})
    assert model_aliases(registry)["tiny-llama"] == f"{folder} (plugin lab)"
    assert "smollm2" in model_aliases(registry)
    assert resolve_alias("tiny2", registry) == folder  # an alias may name another alias
    model, tokenizer = load_model("tiny2", registry=registry)
    assert model.config.num_hidden_layers == 3 and tokenizer.padding_side == "left"


def test_an_alias_to_a_missing_folder_names_both(tmp_path):
    registry = registry_with(lab={"gone": str(tmp_path / "nothing")})
    with pytest.raises(KVPolicyError, match=r'alias "gone" -> ".*nothing"\).*gone \(.*plugin lab\)'):
        load_model("gone", registry=registry)


def test_alias_loops_and_builtin_names_are_refused():
    registry = registry_with(lab={"a": "b", "b": "a", "smollm2": "/elsewhere"})
    with pytest.raises(KVPolicyError, match="loop: a -> b -> a"):
        resolve_alias("a", registry)
    assert resolve_alias("smollm2", registry) == "smollm2"  # built-in aliases cannot be redirected
    assert "/elsewhere" not in model_aliases(registry)["smollm2"]


@pytest.mark.parametrize("bad", [RuntimeError("boom"), ["not", "a", "dict"], {"x": 3}])
def test_a_broken_alias_hook_is_reported_and_others_still_work(tiny, bad):
    folder, _ = tiny
    registry = registry_with(broken=bad, lab={"tiny": folder})
    assert resolve_alias("tiny", registry) == folder
    assert "model aliases failed" in registry.broken["broken"]
    assert registry.get("h2o")


def test_a_repeated_alias_keeps_the_first_plugin():
    registry = registry_with(first={"m": "/one"}, second={"m": "/two"})
    assert resolve_alias("m", registry) == "/one"
    assert "already defined by first" in registry.broken["second"]

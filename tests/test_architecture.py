"""The package's shape: imports between kvpolicy's modules run one way, down the layers, with no circle.

Every module under kvpolicy/ is read with `ast` (imports at module level and inside functions, relative ones
resolved; nothing is imported), which gives the import graph between kvpolicy's modules. The tests fail on:

- a circle of imports between kvpolicy modules;
- an import that runs up the layers below (a policy importing the cache, the cache importing a command);
- a third-party package where it does not belong (transformers on the policy side, triton outside the kernels);
- a module that no layer claims: add it to LAYERS.

The package itself (kvpolicy/__init__.py) stands outside the layers: it names everything, and imports it only
when first read (PEP 562), which a subprocess test checks.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "kvpolicy"

# Each entry covers the module of that name and every module under it (a package). A module may import from its own
# layer and the layers below. Every layer is folders, except the three modules of the plugin system at the top.
LAYERS: dict[int, tuple[str, ...]] = {
    0: (  # the policy side: recipes and plans, policies and their contract, the plugin registry; no engine
        "kvpolicy.recipe", "kvpolicy.policies", "kvpolicy.registry", "kvpolicy.hookspecs", "kvpolicy.errors",
    ),
    1: (  # kernels and storage: attention with statistics, storage formats; torch only
        "kvpolicy.backend", "kvpolicy.storage",
    ),
    2: (  # the cache layer: one layer's policies, budgets and store, whatever the engine
        "kvpolicy.cache",
    ),
    3: (  # engine integrations
        "kvpolicy.hf", "kvpolicy.integrations", "kvpolicy.lmeval",
    ),
    4: (  # commands
        "kvpolicy.commands", "kvpolicy.tasks",
    ),
}
LAYER_NAMES = {0: "policy side", 1: "kernels and storage", 2: "cache layer", 3: "engine integrations", 4: "commands"}
ENGINE_LAYER = 3
#: the only modules at the package's top besides __init__.py (the rest live in the folders above)
TOP_MODULES = ("kvpolicy.registry", "kvpolicy.hookspecs", "kvpolicy.errors")

# third-party packages the lower layers never import (the extras: an engine that installs the core has none)
NOT_BELOW_ENGINES = {"transformers", "rich", "matplotlib", "gguf", "accelerate", "safetensors", "vllm"}
TRITON_ONLY_IN = "kvpolicy.backend"

# Edges that break the rules today, in files being rewritten by the cache refactor (issue #13); each goes when
# that refactor lands. (importer, imported module or third-party package)
KNOWN_UNTIL_CACHE_REFACTOR: set[tuple[str, str]] = set()


# --- reading the imports -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a kvpolicy module, or a third-party top-level package
    line: int
    internal: bool  # target is a kvpolicy module
    type_only: bool  # under `if TYPE_CHECKING:`: no import at run time


def module_files(root: Path = ROOT / PACKAGE) -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, type_only: bool = False):
    """(import node, under TYPE_CHECKING) for every import in ``node``, at any depth."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, type_only
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for part in child.body:
                yield from _walk(ast.Module(body=[part], type_ignores=[]), True)
            for part in child.orelse:
                yield from _walk(ast.Module(body=[part], type_ignores=[]), type_only)
        else:
            yield from _walk(child, type_only)


def package_exports(modules: dict[str, Path]) -> dict[str, str]:
    """The package's lazily exported names -> the module defining each (its `_EXPORTS` table)."""
    tree = ast.parse(modules[PACKAGE].read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in targets):
                return ast.literal_eval(node.value)
    return {}


def read_imports(modules: dict[str, Path]) -> list[Import]:
    exports = package_exports(modules)
    out = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node, type_only in _walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = []
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in modules:  # from kvpolicy.policies import builtin: the submodule
                        targets.append(sub)
                    elif source == PACKAGE and alias.name in exports:  # from kvpolicy import attach
                        targets.append(exports[alias.name])
                    else:
                        targets.append(source)
            for target in targets:
                internal = target == PACKAGE or target.startswith(f"{PACKAGE}.")
                if internal:
                    while target not in modules and "." in target:  # `import kvpolicy.x.name`: the module
                        target = target.rpartition(".")[0]
                else:
                    target = target.split(".")[0]
                out.append(Import(name, target, node.lineno, internal, type_only))
    return out


# --- the rules ------------------------------------------------------------------------------------------------


def layer_of(module: str, layers: dict[int, tuple[str, ...]] = LAYERS) -> int | None:
    """The layer whose entries cover ``module`` (the longest matching entry wins), or None."""
    best: tuple[int, int] | None = None
    for layer, entries in layers.items():
        for entry in entries:
            if (module == entry or module.startswith(f"{entry}.")) and (best is None or len(entry) > best[0]):
                best = (len(entry), layer)
    return None if best is None else best[1]


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a path that returns to its start) per strongly connected part of ``graph`` that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == node:
                    break
            if len(part) > 1 or node in graph.get(node, ()):
                parts.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    cycles = []
    for part in parts:
        members, start = set(part), part[0]
        # shortest way back to start inside the part (breadth first)
        previous: dict[str, str] = {}
        frontier, found = [start], None
        while frontier and found is None:
            following = []
            for node in frontier:
                for nxt in sorted(graph.get(node, ())):
                    if nxt == start:
                        found = node
                        break
                    if nxt in members and nxt not in previous:
                        previous[nxt] = node
                        following.append(nxt)
                if found is not None:
                    break
            frontier = following
        path = [start]
        node = found
        while node is not None and node != start:
            path.insert(1, node)
            node = previous.get(node)
        cycles.append(path + [start])
    return cycles


def wrong_way(imports: list[Import], layers: dict[int, tuple[str, ...]] = LAYERS) -> list[str]:
    """Every import between kvpolicy modules that runs up the layers."""
    problems = []
    for imp in imports:
        if not imp.internal or PACKAGE in (imp.importer, imp.target):
            continue
        mine, theirs = layer_of(imp.importer, layers), layer_of(imp.target, layers)
        if mine is None or theirs is None or theirs <= mine:
            continue
        problems.append(f"{imp.importer} (layer {mine}, {LAYER_NAMES.get(mine, mine)}) imports {imp.target} "
                        f"(layer {theirs}, {LAYER_NAMES.get(theirs, theirs)}) at line {imp.line}")
    return problems


def misplaced_packages(imports: list[Import], layers: dict[int, tuple[str, ...]] = LAYERS) -> list[str]:
    problems = []
    for imp in imports:
        if imp.internal:
            continue
        layer = layer_of(imp.importer, layers)
        if imp.target in NOT_BELOW_ENGINES and layer is not None and layer < ENGINE_LAYER:
            problems.append(f"{imp.importer} (layer {layer}, {LAYER_NAMES[layer]}) imports {imp.target} at line "
                            f"{imp.line}: only the engine integrations and the commands may")
        if imp.target == "triton" and not (imp.importer == TRITON_ONLY_IN
                                           or imp.importer.startswith(f"{TRITON_ONLY_IN}.")):
            problems.append(f"{imp.importer} imports triton at line {imp.line}: only {TRITON_ONLY_IN} may")
    return problems


def runtime_graph(imports: list[Import]) -> dict[str, set[str]]:
    """Who imports whom at run time, between kvpolicy's modules (the package itself left out: see the docstring)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.internal and not imp.type_only and PACKAGE not in (imp.importer, imp.target) \
                and imp.importer != imp.target:
            graph.setdefault(imp.importer, set()).add(imp.target)
    return graph


def _not_known(imports: list[Import]) -> list[Import]:
    return [imp for imp in imports if (imp.importer, imp.target) not in KNOWN_UNTIL_CACHE_REFACTOR]


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return read_imports(module_files())


# --- the package's tests --------------------------------------------------------------------------------------


def test_every_module_has_a_layer():
    missing = [name for name in module_files() if name != PACKAGE and layer_of(name) is None]
    assert not missing, (f"modules in no layer: {', '.join(missing)}. Add each to LAYERS in "
                         "tests/test_architecture.py, in the layer of what it does (see docs/architecture.md)")


def test_the_folders_are_the_layers():
    """A layer is its folders (a newcomer reads the architecture from the listing): no loose module at the package's
    top but the plugin system's, and every folder under kvpolicy/ in exactly the layer its entry names."""
    modules = module_files()
    loose = [name for name, path in modules.items() if name.count(".") == 1 and path.name != "__init__.py"
             and name not in TOP_MODULES]
    assert not loose, f"modules at kvpolicy's top: {loose}; move each into the folder of its layer"
    folders = [entry for entries in LAYERS.values() for entry in entries if entry not in TOP_MODULES]
    not_folders = [entry for entry in folders if not (modules.get(entry) and modules[entry].name == "__init__.py")]
    assert not not_folders, f"layer entries that are not folders: {not_folders}"


def test_no_import_circle(imports):
    cycles = find_cycles(runtime_graph(imports))
    assert not cycles, "import circles between kvpolicy modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_run_down_the_layers(imports):
    problems = wrong_way(_not_known(imports))
    assert not problems, "imports that run up the layers:\n" + "\n".join(problems)


def test_third_party_packages_stay_in_their_layers(imports):
    problems = misplaced_packages(_not_known(imports))
    assert not problems, "\n".join(problems)


def test_known_exceptions_still_exist(imports):
    """An exception that no longer happens is taken out of KNOWN_UNTIL_CACHE_REFACTOR, so it cannot come back."""
    edges = {(imp.importer, imp.target) for imp in imports}
    gone = sorted(KNOWN_UNTIL_CACHE_REFACTOR - edges)
    assert not gone, f"remove from KNOWN_UNTIL_CACHE_REFACTOR, these imports are gone: {gone}"


def test_the_package_imports_its_names_lazily(imports):
    """kvpolicy/__init__.py imports no kvpolicy module when it runs (only for type checkers)."""
    eager = [imp for imp in imports if imp.importer == PACKAGE and imp.internal and not imp.type_only]
    assert not eager, f"kvpolicy/__init__.py imports at run time: {eager}"


def test_the_policy_side_imports_without_transformers():
    code = ("import kvpolicy.recipe, kvpolicy.registry, kvpolicy.recipe.plan, kvpolicy.policies.builtin, sys; "
            "from kvpolicy.recipe import load_recipe; load_recipe('h2o').resolve(4, 2); "
            "import kvpolicy; kvpolicy.Budget, kvpolicy.Policy, kvpolicy.load_recipe; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{sorted(NOT_BELOW_ENGINES | {'triton'})!r}); "
            "assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_package_exports_every_name_it_lists():
    code = ("import kvpolicy, sys; missing = [n for n in kvpolicy.__all__ if getattr(kvpolicy, n, None) is None]; "
            "assert not missing, missing; assert callable(kvpolicy.attach), kvpolicy.attach; "
            "import kvpolicy.hf.session; assert callable(kvpolicy.attach), kvpolicy.attach")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr


# --- the checker catches what it should -----------------------------------------------------------------------


def _fake(edges: list[tuple[str, str]]) -> list[Import]:
    return [Import(a, b, i + 1, b.startswith(PACKAGE), False) for i, (a, b) in enumerate(edges)]


def test_checker_finds_a_circle():
    graph = runtime_graph(_fake([("kvpolicy.commands.cli", "kvpolicy.commands.compare"),
                                 ("kvpolicy.commands.compare", "kvpolicy.commands.bench"),
                                 ("kvpolicy.commands.bench", "kvpolicy.commands.cli"),
                                 ("kvpolicy.commands.bench", "kvpolicy.recipe"),
                                 ("kvpolicy.recipe", "kvpolicy.recipe.plan")]))
    assert find_cycles(graph) == [["kvpolicy.commands.bench", "kvpolicy.commands.cli", "kvpolicy.commands.compare",
                                   "kvpolicy.commands.bench"]]
    assert find_cycles({"a": {"a"}}) == [["a", "a"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}}) == []


def test_checker_finds_a_wrong_way_import_and_a_misplaced_package():
    fake = _fake([("kvpolicy.policies.h2o", "kvpolicy.hf.cache"),  # a policy importing the cache
                  ("kvpolicy.hf.cache", "kvpolicy.commands.compare"),  # an engine importing a command
                  ("kvpolicy.commands.cli", "kvpolicy.recipe"),  # fine: down
                  ("kvpolicy.recipe", "transformers"),
                  ("kvpolicy.hf.session", "triton"),
                  ("kvpolicy.backend.triton_kernels", "triton")])  # fine
    problems = wrong_way(fake)
    assert len(problems) == 2
    assert problems[0].startswith("kvpolicy.policies.h2o (layer 0, policy side) imports kvpolicy.hf.cache (layer 3")
    assert problems[1].startswith("kvpolicy.hf.cache (layer 3, engine integrations) imports kvpolicy.commands.compare")
    misplaced = misplaced_packages(fake)
    assert len(misplaced) == 2 and "kvpolicy.recipe" in misplaced[0] and "kvpolicy.hf.session" in misplaced[1]
    assert layer_of("kvpolicy.storage.dense") == 1 and layer_of("kvpolicy.somewhere_new") is None
    assert layer_of("kvpolicy.cache.layer") == 2 and layer_of("kvpolicy.recipe.budget") == 0


def test_reader_resolves_relative_and_function_level_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "policies").mkdir(parents=True)
    (pkg / "__init__.py").write_text('_EXPORTS = {"attach": "kvpolicy.attach"}\n')
    (pkg / "attach.py").write_text("def attach(): ...\n")
    (pkg / "recipe.py").write_text("")
    (pkg / "policies" / "__init__.py").write_text("")
    (pkg / "policies" / "base.py").write_text(
        "from typing import TYPE_CHECKING\nfrom .. import recipe\nfrom ..recipe import x\n"
        "if TYPE_CHECKING:\n    from ..attach import attach\n"
        "def f():\n    import transformers.utils\n    from kvpolicy import attach\n")
    found = {(i.importer, i.target, i.type_only) for i in read_imports(module_files(pkg))}
    assert found == {("kvpolicy.policies.base", "typing", False), ("kvpolicy.policies.base", "kvpolicy.recipe", False),
                     ("kvpolicy.policies.base", "kvpolicy.attach", True),
                     ("kvpolicy.policies.base", "transformers", False),
                     ("kvpolicy.policies.base", "kvpolicy.attach", False)}


def test_graph_summary_counts_rooms_levels_and_upward_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    for folder in ("recipe", "cache"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "recipe" / "budget.py").write_text("from ..errors import x\nfrom . import plan\n")
    (pkg / "recipe" / "plan.py").write_text("")
    (pkg / "cache" / "layer.py").write_text("from ..recipe.budget import Budget\nimport torch\n")
    summary = graph_summary(pkg)
    assert summary == {"modules": 7, "rooms": 4, "levels": 3, "imports between rooms": 2, "module imports": 3,
                       "running up the layers": 0}
    (pkg / "recipe" / "plan.py").write_text("def f():\n    from kvpolicy.cache import layer\n")  # layer 0 -> 2
    assert graph_summary(pkg)["running up the layers"] == 1


def test_every_package_ships():
    """A non-editable install ships only the packages pyproject lists: every folder of kvpolicy/ must be there."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / PACKAGE).rglob("__init__.py")}
    assert folders <= listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(folders - listed)}"


# --- the graph in numbers ---------------------------------------------------------------------------------------


def graph_summary(root: Path = ROOT / PACKAGE) -> dict[str, int]:
    """The import graph's size, between kvpolicy's top-level rooms (a folder, or a module at the top; the package's
    __init__ its own): rooms, levels (the longest chain of imports, plus one), imports between rooms and those
    that run up the layers."""
    imports = read_imports(module_files(root))

    def room(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 else module

    edges = {(room(i.importer), room(i.target)) for i in imports if i.internal and not i.type_only}
    edges = {(a, b) for a, b in edges if a != b}
    rooms = {room(name) for name in module_files(root)}
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    levels: dict[str, int] = {}

    def level(node: str, seen: frozenset = frozenset()) -> int:
        if node not in levels:
            below = [level(n, seen | {node}) for n in graph.get(node, ()) if n not in seen]
            levels[node] = 1 + max(below, default=0)
        return levels[node]

    return {"modules": len(module_files(root)), "rooms": len(rooms), "levels": max(level(r) for r in rooms),
            "imports between rooms": len(edges), "module imports": len({(i.importer, i.target) for i in imports
                                                                         if i.internal and not i.type_only}),
            "running up the layers": len(wrong_way(imports))}


if __name__ == "__main__":
    # python tests/test_architecture.py [ROOT]: the numbers of the graph, e.g. for a checkout of an older commit
    print(graph_summary(Path(sys.argv[1]) / PACKAGE if len(sys.argv) > 1 else ROOT / PACKAGE))

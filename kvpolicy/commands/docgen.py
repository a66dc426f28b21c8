"""The generated parts of the docs: recipe schema, policy parameters, statistics and hooks, read from the code.

A page under ``docs/`` marks each generated block with a pair of HTML comments::

    <!-- generated: recipe-budget -->
    ...
    <!-- /generated -->

``python -m kvpolicy.commands.docgen`` rewrites the inside of every block from the code (the recipe
schema in `kvpolicy.recipe.schema`, each built-in policy's class and ``Params`` dataclass, the
statistics in `kvpolicy.policies.base`, the hook specifications); ``--check`` only lists the
pages that differ and exits 1. The test suite runs the check, so the docs cannot drift.

Parameter docs come from each ``Params`` field's ``metadata["doc"]`` if set, else from its
comments in the source (the comment lines just above the field and the one after it);
validation notes are the ``ValueError`` messages of ``Params.validate`` that name the field.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any

from .. import hookspecs
from ..policies.base import STAT_FIELDS, STAT_NAMES, AttentionStats, CellArray, Policy
from ..recipe.budget import Schedule
from ..recipe.schema import BUDGET, REQUIRED, RULES, SCHEDULE_DOCS, SCHEMA_VERSION, TIER, TOP_LEVEL, Key
from ..registry import Registry

BLOCK = re.compile(r"(?P<open><!-- generated: (?P<name>[\w:.-]+) -->\n)(?P<body>.*?)(?P<close><!-- /generated -->)", re.S)
DOCS = Path(__file__).resolve().parents[2] / "docs"
#: The model shape the schedule example is computed for (SmolLM2-135M: 30 layers).
EXAMPLE_LAYERS = 30


# --- reading the code ----------------------------------------------------------------------------------


def _cell(text: Any) -> str:
    """Text for a markdown table cell: pipes escaped, one line, ``<`` outside code spans escaped."""
    parts = str(text).replace("|", "\\|").replace("\n", " ").split("`")
    return "`".join(part.replace("<", "&lt;") if index % 2 == 0 else part for index, part in enumerate(parts))


def _value(value: Any) -> str:
    """A default as it would be written in YAML, in backticks."""
    if value is None:
        return "none"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, (tuple, list)):
        return "`[" + ", ".join(str(v) for v in value) + "]`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    return f"`{value!r}`"


def _type(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _class_source(cls: type) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return None


def field_comments(cls: type) -> dict[str, str]:
    """Each annotated field of a class (and of its bases) -> the comment lines just above it plus its trailing comment."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):  # bases first, so that a subclass's comment wins
        out.update({name: text for name, text in _own_field_comments(klass).items() if text or name not in out})
    return out


def _own_field_comments(cls: type) -> dict[str, str]:
    source = _class_source(cls)
    if source is None:
        return {}
    lines = source.splitlines()
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}

    def own_line(number: int) -> bool:
        return lines[number - 1].lstrip().startswith("#")

    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, number = [], node.lineno - 1
            while number in comments and own_line(number):
                above.insert(0, comments[number])
                number -= 1
            after = [comments[node.end_lineno]] if node.end_lineno in comments and not own_line(node.end_lineno) else []
            out[node.target.id] = " ".join(above + after)
    return out


def validation_notes(cls: type) -> list[str]:
    """The ``ValueError`` messages raised by ``validate`` in ``cls`` and its bases (literal strings only)."""
    notes: list[str] = []
    for klass in cls.__mro__[:-1]:
        notes += [note for note in _own_validation_notes(klass) if note not in notes]
    return notes


def _own_validation_notes(cls: type) -> list[str]:
    source = _class_source(cls)
    if source is None:
        return []
    notes = []
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.FunctionDef) and node.name == "validate":  # methods of this class only
            for raise_ in (n for n in ast.walk(node) if isinstance(n, ast.Raise)):
                call = raise_.exc
                if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Constant):
                    notes.append(str(call.args[0].value))
    return notes


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    type: str
    default: Any
    doc: str
    checks: tuple[str, ...]


def policy_params(cls: type[Policy]) -> list[Param]:
    """The YAML ``params`` of a policy: name, type, default, doc and validation notes of each field."""
    params = cls.Params
    try:
        hints = typing.get_type_hints(params)
    except Exception:
        hints = {}
    comments = field_comments(params)
    notes = validation_notes(params)
    out = []
    for field in dataclasses.fields(params):
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = REQUIRED
        doc = field.metadata.get("doc") or comments.get(field.name, "")
        checks = tuple(n for n in notes if re.search(rf"\b{re.escape(field.name)}\b", n))
        out.append(Param(field.name, _type(hints.get(field.name, field.type)), default, doc, checks))
    return out


# --- the blocks ----------------------------------------------------------------------------------------


def keys_table(keys: tuple[Key, ...]) -> str:
    rows = ["| key | value | default | meaning |", "| --- | --- | --- | --- |"]
    for key in keys:
        default = "**required**" if key.default == REQUIRED else key.default_doc or _value(key.default)
        rows.append(f"| `{key.name}` | {_cell(key.kind)} | {_cell(default)} | {_cell(key.doc)} |")
    return "\n".join(rows)


def schedules_block() -> str:
    rows = ["| schedule | layer budgets (mean b) |", "| --- | --- |"]
    rows += [f"| `{name}` | {_cell(doc)} |" for name, doc in SCHEDULE_DOCS.items()]
    rows.append("| `per_layer: [...]` | one multiplier per layer, averaging 1 |")
    shares = Schedule("pyramid").multipliers(EXAMPLE_LAYERS, "<docs>")
    rows += ["", f"For example `schedule: pyramid` (beta {Schedule().beta:g}) over {EXAMPLE_LAYERS} layers "
             f"(SmolLM2-135M) gives layer 0 {shares[0]:.3g} b, layer {EXAMPLE_LAYERS // 2} "
             f"{shares[EXAMPLE_LAYERS // 2]:.3g} b and layer {EXAMPLE_LAYERS - 1} {shares[-1]:.3g} b; "
             "`funnel` gives the same figures in reverse order."]
    return "\n".join(rows)


def _needs_text(cls: type[Policy]) -> str:
    profile = ", ".join(f"`{stat}`" for stat in sorted(cls.profile_needs))
    profile = f"; at a layer's first attention call (the prompt) also {profile}, for `profile`" if profile else ""
    if not cls.needs:
        return "none: the layer may run plain SDPA, with no tracking cost" + profile
    needs = []
    for stat in sorted(cls.needs):
        if stat == "last_rows":
            window = cls().last_rows_window  # may depend on the params (e.g. SnapKV's window)
            depends = " with the default params" if window != cls.last_rows_window else ""
            needs.append(f"`last_rows` (the last {window} {'query' if window == 1 else 'queries'}{depends})")
        else:
            needs.append(f"`{stat}`")
    return ", ".join(needs) + profile


def policy_block(cls: type[Policy]) -> str:
    """What the code says about one policy: description, statistics, state, budget, parameters."""
    def dtypes(state: dict) -> str:
        def kind(entry: Any) -> str:
            if isinstance(entry, CellArray):
                return f"{str(entry.dtype).replace('torch.', '')} x [{', '.join(entry.dims)}]"
            return str(entry).replace("torch.", "")

        return ", ".join(f"`{name}` ({kind(entry)})" for name, entry in state.items())

    state = dtypes(cls.state)
    if cls.needs_token_ids:
        state += (", " if state else "") + "`token_ids` (int32, kept by the cache for it)"
    if cls.dynamic_budget:
        budget = "- **Budget:** set by the policy for each (batch row, KV head) at every eviction; a recipe's budget does not apply."
    elif cls.evicts:
        budget = "- **Budget:** applies (the policy evicts)."
    else:
        budget = "- **Budget:** does not apply (nothing is evicted)."
    lines = [
        f"- **Summary** (`description`): {cls.description}.",
        f"- **Attention statistics (`needs`):** {_needs_text(cls)}.",
        f"- **Per-token state:** {state} per (batch row, KV head, token)." if state else
        "- **Per-token state:** none.",
        *([f"- **Per-head state:** {dtypes(cls.cell_state)} per (batch row, KV head)."] if cls.cell_state else []),
        budget,
        f"- **Class:** `{cls.__module__}.{cls.__qualname__}`, parameters `{cls.Params.__qualname__}`.",
        "",
    ]
    params = policy_params(cls)
    if not params:
        lines.append("No parameters.")
        return "\n".join(lines)
    lines += [f"**Parameters** (the recipe's `params:` keys for `{cls.name}`):", "",
              "| param | type | default | meaning | checked |", "| --- | --- | --- | --- | --- |"]
    for p in params:
        checks = "; ".join(p.checks) or "-"
        lines.append(f"| `{p.name}` | {_cell(p.type)} | {_value(p.default)} | {_cell(p.doc) or '-'} | {_cell(checks)} |")
    return "\n".join(lines)


def policies_table(registry: Registry) -> str:
    rows = ["| policy | summary | attention statistics | params (defaults) |", "| --- | --- | --- | --- |"]
    for name in registry.names():
        cls = registry.get(name)
        needs = ", ".join(f"`{s}`" for s in sorted(cls.needs)) or "none (SDPA)"
        params = ", ".join(f"`{p.name}`={_value(p.default).strip('`')}" for p in policy_params(cls)) or "-"
        rows.append(f"| [`{name}`]({name}.md) | {_cell(cls.description)} | {needs} | {_cell(params)} |")
    return "\n".join(rows)


def all_policy_params(registry: Registry) -> str:
    parts = []
    for name in registry.names():
        parts += [f"### `{name}`", "", policy_block(registry.get(name)), ""]
    return "\n".join(parts).rstrip()


def statistics_block(registry: Registry) -> str:
    comments = field_comments(AttentionStats)
    rows = ["| statistic | shape | built-in policies that need it |", "| --- | --- | --- |"]
    for field in dataclasses.fields(AttentionStats):
        if field.name not in STAT_NAMES:
            continue
        users = ", ".join(f"`{n}`" for n in registry.names()
                          if field.name in registry.get(n).needs | registry.get(n).profile_needs) or "-"
        rows.append(f"| `{field.name}` | `{comments.get(field.name, '')}` | {users} |")
    # a statistic returned as several fields (the query moments: count, sum, outer products)
    for stat, parts in STAT_FIELDS.items():
        shape = ", ".join(f"`{name}` `{comments.get(name, '').split(' (')[0]}`" for name in parts)
        users = ", ".join(f"`{n}`" for n in registry.names() if stat in registry.get(n).needs) or "-"
        rows.append(f"| `{stat}` | {shape} | {users} |")
    return "\n".join(rows)


def hooks_block() -> str:
    parts = [f"Hook API version: **{hookspecs.HOOK_API_VERSION}** (`kvpolicy.hookspecs.HOOK_API_VERSION`); "
             f"pluggy project name and entry-point group: `{hookspecs.PROJECT}`.", ""]
    for name, function in inspect.getmembers(hookspecs, inspect.isfunction):
        if not name.startswith(f"{hookspecs.PROJECT}_"):
            continue
        returns = inspect.signature(function).return_annotation
        parts += [f"### `{name}`", "", f"```text\n{name}() -> {returns}\n```", "", inspect.getdoc(function) or "", ""]
    return "\n".join(parts).rstrip()


def compare_options_block() -> str:
    """The ``kvpolicy compare`` flags, their defaults and help, from its argument parser."""
    from .compare import add_compare_arguments

    parser = argparse.ArgumentParser(prog="kvpolicy compare")
    add_compare_arguments(parser)
    rows = ["| option | default | meaning |", "| --- | --- | --- |"]
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[-1] + ("" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}")
        flag += " ..." if action.nargs == "+" else ""
        default = action.default
        default = "-" if default is None or default is False else " ".join(map(str, default)) if isinstance(default, list) else default
        text = (action.help or "").replace("%%", "%")
        said = re.search(r"\s*\(default: ([^)]*)\)", text)  # the help's own "(default: ...)", said once
        if said and (said[1] == str(default) or default == "-"):
            default, text = said[1] if default == "-" else default, text.replace(said[0], "")
        rows.append(f"| `{flag}` | {_cell(default)} | {_cell(text)} |")
    return "\n".join(rows)


def tasks_block() -> str:
    """The built-in ``kvpolicy compare`` tasks: name, what it measures, table columns and plots."""
    from ..tasks import TASKS
    from .compare import DEFAULT_TASKS

    rows = ["| task | measures | table columns | plotted on | in the default run |", "| --- | --- | --- | --- | --- |"]
    for name, task in TASKS.items():
        if not type(task).__module__.startswith("kvpolicy.tasks."):
            continue  # registered by a plugin in this process
        columns = ", ".join(f"`{metric}` ({header})" for metric, header, _ in task.columns)
        plots = ", ".join(sorted({f"`{figure}.png`" for figure, _, _ in task.plots}))
        default = "yes" if name in DEFAULT_TASKS else "no"
        rows.append(f"| `{name}` | {_cell(task.description)} | {_cell(columns)} | {plots} | {default} |")
    return "\n".join(rows)


def ruler_block() -> str:
    """The RULER-style tasks: name, table header, what each measures, answer budget."""
    from ..tasks.ruler import RULER_TASKS

    rows = ["| task | table header | what it measures | answer budget (tokens) |", "| --- | --- | --- | --- |"]
    rows += [f"| `{name}` | `{task.columns[0][1]}` | {_cell(task.description)} | {task.generator.max_new_tokens} |"
             for name, task in RULER_TASKS.items()]
    return "\n".join(rows)


def blocks(registry: Registry | None = None) -> dict[str, str]:
    """Every generated block, by name. Built-in policies only (installed plugins are left out)."""
    registry = registry or Registry(load_entry_points=False)
    out = {
        "schema-version": f"Schema version: **{SCHEMA_VERSION}** (write `kvpolicy: {SCHEMA_VERSION}` first).",
        "recipe-top-level": keys_table(TOP_LEVEL),
        "recipe-layer-rule": keys_table(RULES["layers"]),
        "recipe-head-rule": keys_table(RULES["heads"]),
        "recipe-budget": keys_table(BUDGET),
        "recipe-tier": keys_table(TIER),
        "recipe-schedules": schedules_block(),
        "policies": policies_table(registry),
        "policy-params": all_policy_params(registry),
        "statistics": statistics_block(registry),
        "hooks": hooks_block(),
        "compare-options": compare_options_block(),
        "compare-tasks": tasks_block(),
        "ruler-tasks": ruler_block(),
    }
    for name in registry.names():
        out[f"policy:{name}"] = policy_block(registry.get(name))
    return out


# --- pages -------------------------------------------------------------------------------------------


def render(text: str, generated: dict[str, str], page: str = "<page>") -> str:
    """``text`` with the inside of every generated block replaced by its current content."""

    def replace(match: re.Match) -> str:
        name = match["name"]
        if name not in generated:
            raise KeyError(f"{page}: unknown generated block {name!r}; known: {', '.join(sorted(generated))}")
        return f"{match['open']}{generated[name]}\n{match['close']}"

    return BLOCK.sub(replace, text)


def update(docs: Path = DOCS, check: bool = False) -> list[Path]:
    """Regenerate the blocks of every page under ``docs``; return the pages that were (or would be) changed."""
    generated = blocks()
    changed = []
    for page in sorted(docs.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        fresh = render(text, generated, str(page))
        if fresh != text:
            changed.append(page)
            if not check:
                page.write_text(fresh, encoding="utf-8")
    return changed


def used_blocks(docs: Path = DOCS) -> set[str]:
    """The names of the generated blocks the pages under ``docs`` contain."""
    return {m["name"] for page in docs.rglob("*.md") for m in BLOCK.finditer(page.read_text(encoding="utf-8"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpolicy.commands.docgen", description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=Path, default=DOCS, help=f"the docs folder (default: {DOCS})")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    changed = update(args.docs, check=args.check)
    for page in changed:
        print(f"{'out of date' if args.check else 'updated'}: {page}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())

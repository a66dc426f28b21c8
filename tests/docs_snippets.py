"""Find and run the code snippets of the docs pages (used by tests/test_docs.py).

Every fenced block of a page under ``docs/`` is one of:

- ``python``: executed, in page order, in one module namespace per page;
- ``bash``: each command (``\\``-continued lines joined, ``#`` comments dropped) must be a
  ``kvpolicy ...`` command, run in-process through `kvpolicy.commands.cli.main`, or
  ``python -m kvpolicy.commands.docgen ...``; it must exit 0;
- ``yaml``: a recipe, loaded with `kvpolicy.load_recipe` and resolved for SmolLM2-135M's shape;
- ``toml``: parsed;
- ``text`` (or no language): output or a diagram, not run.

A block may be preceded (on its last non-blank line before the fence) by one directive:

- ``<!-- docs-test: skip: REASON -->``: not run; the reason is required;
- ``<!-- docs-test: exit N -->``: a bash block whose commands must exit with status N;
- ``<!-- docs-test: same-as PATH -->``: the block's text must appear verbatim in the
  repository file PATH (a walk-through that quotes an example cannot drift from it);
  python blocks still run; yaml and toml blocks are only compared.
- ``<!-- docs-test: vllm ROLE -->``: run by tests/test_vllm.py in the vLLM environment, not here:
  ``vllm engine`` (python, run as is), ``vllm serve`` (bash: the server the serve test starts),
  ``vllm client`` (python, run against that server), ``vllm bench`` (bash: a ``kvpolicy bench --engine
  vllm`` command, run with small sizes).

Run as a script (``python tests/docs_snippets.py --report FILE PAGE...``), in a scratch
folder where ``recipes`` and ``plugins`` link to the repository's, it runs the pages one
after the other in this one process and writes a JSON report: page -> ok, error, blocks run.
With ``--claims FOLDER``, several such runners (each in its own scratch folder) share the pages:
each takes the next page no other runner has claimed in FOLDER.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import sys
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)\s*$")
DIRECTIVE = re.compile(r"^<!-- docs-test: (?P<what>skip|exit|same-as|vllm)(?::|\s)\s*(?P<arg>.*?)\s*-->$")
RUN = ("python", "bash", "yaml", "toml")
NOT_RUN = ("text", "")
#: SmolLM2-135M: decoder layers, KV heads (what `kvpolicy validate` assumes by default)
SHAPE = (30, 3)


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the first code line
    lang: str
    code: str
    directive: str | None = None  # skip, exit, same-as, vllm
    arg: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, with their directives; raises ValueError on a malformed page."""
    lines = page.read_text(encoding="utf-8").splitlines()
    name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)
    out, index = [], 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if lines[index].lstrip().startswith(("```", "~~~")) and not match:
            raise ValueError(f"{name}:{index + 1}: a fence must start its line and name only a language")
        if not match:
            index += 1
            continue
        start, fence = index, match["fence"]
        index += 1
        while index < len(lines) and lines[index].rstrip() != fence:
            index += 1
        if index == len(lines):
            raise ValueError(f"{name}:{start + 1}: unclosed code fence")
        block = Block(name, start + 2, match["lang"], "\n".join(lines[start + 1 : index]) + "\n")
        before = next((line.strip() for line in reversed(lines[:start]) if line.strip()), "")
        found = DIRECTIVE.match(before)
        if before.startswith("<!-- docs-test") and not found:
            raise ValueError(f"{name}:{start}: cannot read the directive {before!r}")
        if found:
            block.directive, block.arg = found["what"], found["arg"]
            if block.directive == "skip" and len(block.arg) < 10:
                raise ValueError(f"{name}:{start}: a skip needs its reason: <!-- docs-test: skip: WHY -->")
            if block.directive == "vllm" and block.arg not in ("engine", "serve", "client", "bench"):
                raise ValueError(f"{name}:{start}: <!-- docs-test: vllm ROLE -->: ROLE is engine, serve, client or bench")
        if block.lang not in RUN + NOT_RUN:
            raise ValueError(f"{block.where}: snippet language {block.lang!r} is neither run ({', '.join(RUN)}) "
                             "nor plain text (text)")
        out.append(block)
        index += 1
    return out


def commands(code: str) -> list[str]:
    """The commands of a bash block: continuation lines joined; blank lines and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(shlex.join(words))
    return out


# --- running ------------------------------------------------------------------------------------------


def run_python(block: Block, module: types.ModuleType) -> None:
    code = compile("\n" * (block.line - 1) + block.code, block.page, "exec")
    exec(code, module.__dict__)


def run_bash(block: Block) -> None:
    from kvpolicy.commands import docgen
    from kvpolicy.commands.cli import main

    expected = int(block.arg) if block.directive == "exit" else 0
    for command in commands(block.code):
        words = shlex.split(command)
        if words[0] == "kvpolicy":
            status = main(words[1:])
        elif words[:3] == ["python", "-m", "kvpolicy.commands.docgen"]:
            status = docgen.main(words[3:])
        else:
            raise AssertionError(f"{block.where}: `{command}` is not a kvpolicy command; run only `kvpolicy ...` "
                                 "here, or mark the block <!-- docs-test: skip: WHY -->")
        if status != expected:
            raise AssertionError(f"{block.where}: `{command}` exited {status}, expected {expected}")


def run_yaml(block: Block, scratch: Path) -> None:
    import yaml

    import kvpolicy

    data = yaml.safe_load(block.code)
    if not (isinstance(data, dict) and "kvpolicy" in data):
        raise AssertionError(f"{block.where}: a yaml snippet must be a recipe (start with `kvpolicy: 1`)")
    path = scratch / f"snippet-{block.line}.yaml"
    path.write_text(block.code, encoding="utf-8")
    kvpolicy.load_recipe(path).resolve(*SHAPE)


def run_toml(block: Block) -> None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        return
    tomllib.loads(block.code)


def check_same_as(block: Block) -> None:
    path = ROOT / block.arg
    if not path.is_file():
        raise AssertionError(f"{block.where}: same-as names {block.arg}, which does not exist")
    if block.code not in path.read_text(encoding="utf-8"):
        raise AssertionError(f"{block.where}: this block is no longer a verbatim part of {block.arg}; copy it again")


def run_page(page: Path, scratch: Path) -> int:
    """Run every block of ``page``; return how many ran. Raises on the first failure."""
    stem = re.sub(r"\W", "_", str(page.relative_to(DOCS).with_suffix("")))
    module = types.ModuleType(f"docs_{stem}")
    sys.modules[module.__name__] = module  # so that dataclasses and typing find the snippet's globals
    ran = 0
    for block in blocks(page):
        if block.directive in ("skip", "vllm") or block.lang in NOT_RUN:
            continue
        if block.directive == "same-as":
            check_same_as(block)
            if block.lang != "python":
                ran += 1
                continue
        if block.lang == "python":
            run_python(block, module)
        elif block.lang == "bash":
            run_bash(block)
        elif block.lang == "yaml":
            run_yaml(block, scratch)
        elif block.lang == "toml":
            run_toml(block)
        ran += 1
    return ran


def claim(folder: Path, index: int) -> bool:
    """Take page ``index`` for this runner, if no other runner sharing ``folder`` took it first."""
    try:
        (folder / str(index)).open("x").close()
        return True
    except FileExistsError:
        return False


def main(argv: list[str]) -> int:
    import torch

    torch.set_num_threads(1)  # steady timing on a shared 2-core machine (multi-threaded torch slows down badly)
    report_path, pages = Path(argv[argv.index("--report") + 1]), [Path(p) for p in argv if p.endswith(".md")]
    claims = Path(argv[argv.index("--claims") + 1]) if "--claims" in argv else None
    scratch = Path.cwd()
    report = {}
    for index, page in enumerate(pages):
        if claims is not None and not claim(claims, index):
            continue  # another runner has it
        output = io.StringIO()
        started = time.perf_counter()
        try:
            with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                ran = run_page(page, scratch)
            report[str(page)] = {"ok": True, "blocks": ran}
        except (Exception, SystemExit) as exc:  # report every failure, then go on to the next page
            report[str(page)] = {"ok": False, "error": "".join(traceback.format_exception(exc))[-6000:],
                                 "output": output.getvalue()[-4000:]}
        report[str(page)]["seconds"] = round(time.perf_counter() - started, 1)
        print(f"{page.name}: {report[str(page)]}", file=sys.stderr)
    report_path.write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The docs: every snippet runs, the generated blocks match the code, and `mkdocs build --strict` passes.

Snippet conventions (languages, `<!-- docs-test: ... -->` directives) are in tests/docs_snippets.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from docs_snippets import DOCS, ROOT, blocks, commands

from kvpolicy.commands import docgen
from kvpolicy.registry import Registry

PAGES = sorted(DOCS.rglob("*.md"))
RUNNABLE = [p for p in PAGES if any(b.directive not in ("skip", "vllm") and b.lang not in ("text", "") for b in blocks(p))]
#: Skipped snippets are for what cannot run in a test (a fresh install, a 7-minute sweep): keep them rare.
MAX_SKIPS = 6
REGENERATE = "run `python -m kvpolicy.commands.docgen` and commit the pages it updates"


def page_id(page: Path) -> str:
    return str(page.relative_to(DOCS))


#: snippet runners at once: the pages run on one torch thread each, so two use both cores of a 2-core machine
RUNNERS = 2


def by_expected_cost(page: Path) -> int:
    # pages with the most commands first, so that the runners finish together
    return -sum(len(commands(b.code)) for b in blocks(page) if b.lang == "bash" and b.directive not in ("skip", "vllm"))


@pytest.fixture(scope="module")
def snippet_report(tmp_path_factory):
    """Run the snippets of every page in RUNNERS subprocesses that share the pages (each its own scratch folder
    as cwd); their JSON reports, merged."""
    claims = tmp_path_factory.mktemp("docs-claims")
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    pages = sorted(RUNNABLE, key=by_expected_cost)
    runners = []
    for _ in range(RUNNERS):
        scratch = tmp_path_factory.mktemp("docs-run")
        for name in ("recipes", "plugins"):
            (scratch / name).symlink_to(ROOT / name, target_is_directory=True)
        report, log = scratch / "report.json", (scratch / "stderr.txt").open("w")
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("docs_snippets.py")), "--report", str(report),
             "--claims", str(claims), *map(str, pages)],
            cwd=scratch, env=env, stdout=subprocess.DEVNULL, stderr=log,
        )
        runners.append((process, report, log))
    merged = {}
    for process, report, log in runners:
        try:
            process.wait(timeout=900)
        finally:
            if process.poll() is None:
                process.kill()
            log.close()
        assert process.returncode == 0 and report.is_file(), Path(log.name).read_text()[-4000:]
        merged.update(json.loads(report.read_text()))
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_snippets_run(snippet_report, page):
    result = snippet_report[str(page)]
    assert result["ok"], f"{page_id(page)}:\n{result['error']}\n--- output ---\n{result['output']}"
    assert result["blocks"] > 0


def test_snippet_directives_are_rare_and_explained():
    skipped = [b for p in PAGES for b in blocks(p) if b.directive == "skip"]  # blocks() demands a reason
    assert len(skipped) <= MAX_SKIPS, [b.where for b in skipped]
    for block in (b for p in PAGES for b in blocks(p) if b.lang == "bash" and b.directive != "skip"):
        assert commands(block.code), f"{block.where}: an empty bash block"


def test_generated_blocks_match_the_code():
    stale = docgen.update(DOCS, check=True)
    assert not stale, f"out of date: {[str(p.relative_to(ROOT)) for p in stale]}: {REGENERATE}"


def test_every_generated_block_is_used_and_every_policy_has_a_page():
    assert set(docgen.blocks()) - docgen.used_blocks(DOCS) == set(), "a generated block no page shows"
    nav = (ROOT / "mkdocs.yml").read_text()
    for name in Registry(load_entry_points=False).names():
        page = DOCS / "policies" / f"{name}.md"
        assert page.is_file(), f"built-in policy {name!r} has no page: write docs/policies/{name}.md"
        assert f"<!-- generated: policy:{name} -->" in page.read_text(), f"{page}: add its generated block"
        assert f"policies/{name}.md" in nav, f"add docs/policies/{name}.md to the nav in mkdocs.yml"


def test_a_stale_block_is_found_and_rewritten(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n<!-- generated: recipe-budget -->\nold\n<!-- /generated -->\n")
    assert docgen.main(["--docs", str(tmp_path), "--check"]) == 1
    assert docgen.main(["--docs", str(tmp_path)]) == 0
    assert "| `slack` | integer >= 0 | `0` |" in page.read_text()
    assert docgen.main(["--docs", str(tmp_path), "--check"]) == 0


def test_getting_started_repeats_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands_ = re.findall(r"```bash\n(.*?)```", quick_start, re.S)
    assert len(commands_) == 2
    page = (DOCS / "getting-started.md").read_text()
    for command in commands_:
        assert command in page, f"docs/getting-started.md no longer repeats the README command:\n{command}"


def test_docs_name_only_real_modules_and_commands():
    from kvpolicy.commands.cli import build_parser

    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    for page in PAGES:
        text = page.read_text()
        for path in re.findall(r"`(kvpolicy/[\w/]+(?:\.py)?)`", text):
            assert (ROOT / path).exists(), f"{page_id(page)} names {path}, which does not exist"
        for command in re.findall(r"`kvpolicy ([a-z]+)\b", text):
            assert command in subcommands, f"{page_id(page)} names `kvpolicy {command}`, not a command"


#: a Markdown link or image: [text](target) or ![alt](target "title")
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')


def test_links_point_at_files_that_exist():
    """Every relative link of the docs and the README names a file that exists (mkdocs checks the
    docs too, but only where it is installed, and never the README)."""
    for page in [*PAGES, ROOT / "README.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not inside code blocks
        text = re.sub(r"`[^`\n]*`", "", text)  # nor inline code
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor of the page itself
            path = target.split("#", 1)[0]
            assert (page.parent / path).exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"


def test_nav_lists_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def leaves(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from leaves(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from leaves(value)

    assert sorted(leaves(config["nav"])) == sorted(page_id(p) for p in PAGES)


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (pip install -e '.[docs]')")
def test_mkdocs_build_strict(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "policies" / "h2o" / "index.html").is_file()

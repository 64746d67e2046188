"""The documentation site: the README stays a front door, no page is orphaned, links out of the README
resolve, the API reference covers every module, and ``mkdocs build --strict`` passes."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README_MAX_LINES = 400
PACKAGES = ("geofm", "pretrain", "finetune", "federation", "benchmarks")


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs' toc both write it (for the headings these pages use)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#+ (.+)", line)):
            anchors.add(_slug(m.group(1)))
    return anchors


def test_the_readme_is_a_front_door_of_at_most_400_lines():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move sections into docs/ pages"


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(pages) - set(nav)) == [], "pages missing from mkdocs.yml's nav (orphaned)"
    assert sorted(set(nav) - set(pages)) == [], "nav entries without a page"
    assert len(nav) == len(set(nav)), "a page stands twice in the nav"


def test_the_readmes_links_into_docs_reach_a_file_and_its_heading():
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]*)(?:#([^)]+))?\)", readme)
    assert links, "the README links to the docs pages"
    for path, anchor in links:
        target = REPO / path
        assert target.exists(), f"README links to {path}, which does not exist"
        if anchor:
            assert anchor in _anchors(target), f"README links to {path}#{anchor}; no such heading there"


def _modules() -> set[str]:
    """Every module of the packages, by dotted name (a package by its own name)."""
    return {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for package in PACKAGES
        for p in (REPO / package).rglob("*.py")
    }


def _documented_modules() -> set[str]:
    """Every module a ``::: name`` directive of docs/reference/ renders (a package with its submodules
    unless the directive says ``show_submodules: false``)."""
    modules: set[str] = set()
    every = _modules()
    for page in (DOCS / "reference").rglob("*.md"):
        for m in re.finditer(r"^::: (\S+)\n((?:[ \t]+\S.*\n)*)", page.read_text(), re.MULTILINE):
            name, options = m.groups()
            modules.add(name)
            if "show_submodules: false" not in options:
                modules |= {module for module in every if module.startswith(name + ".")}
    return modules


def test_the_api_reference_renders_every_module_of_every_package():
    every = _modules()
    assert sorted(every - _documented_modules()) == [], "modules no page of docs/reference/ renders"


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: pip install -e '.[docs]' builds the site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    warnings = [line for line in result.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert result.returncode == 0 and not warnings, result.stderr[-4000:]
    assert (tmp_path / "index.html").exists() and (tmp_path / "reference" / "geofm" / "index.html").exists()

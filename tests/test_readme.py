"""The README's statements about the test suite match what pytest collects, and so do the docs pages'
(docs/getting-started.md repeats them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _number(text: str) -> int:
    return int(text.replace(",", ""))


@pytest.mark.slow
def test_the_readme_states_the_suites_current_test_counts():
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    fast, total = (int(n) for n in re.search(r"^(\d+)/(\d+) tests collected", collected, re.MULTILINE).groups())
    readme = (REPO / "README.md").read_text()
    assert re.search(r"\b[\d,]+ tests\b(?! not marked slow)", readme), "the README states the suite's size"
    assert re.search(r"\b[\d,]+ tests not marked slow", readme), "the README states the fast tier's size"
    text = "\n".join([readme, *(p.read_text() for p in sorted((REPO / "docs").rglob("*.md")))])
    stated_totals = [_number(n) for n in re.findall(r"\b([\d,]+) tests\b(?! not marked slow)", text)]
    stated_fast = [_number(n) for n in re.findall(r"\b([\d,]+) tests not marked slow", text)]
    assert set(stated_totals) == {total}, f"README and docs state {stated_totals} tests; pytest collects {total}"
    assert set(stated_fast) == {fast}, f"README and docs state {stated_fast} fast tests; pytest collects {fast}"

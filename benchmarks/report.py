"""``geofm bench report RESULTS.json``: the Markdown tables (and claims) of a benchmark's results file.

The docs' tables are this output verbatim: each benchmark with a doc page (:data:`DOC_PAGES`) has its
results files under ``docs/results/``, and the tests check that every such file's report stands in its page.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from geofm.errors import ConfigError

REPORTERS = {"fed-benefit": "benchmarks.fed_benefit_report", "one-shot": "benchmarks.one_shot"}
"""Benchmark -> the module whose ``markdown(results)`` writes its tables."""
DOC_PAGES = {"fed-benefit": "docs/federated-benefit.md", "one-shot": "docs/one-shot.md"}
"""Benchmark -> the doc page its results files under ``docs/results/`` stand in."""


def report(record: dict[str, Any]) -> str:
    """The Markdown of a results record (a ``geofm bench`` JSON file's content).

    Raises:
        ConfigError: for a benchmark without a report.
    """
    name = record.get("benchmark")
    if name not in REPORTERS:
        raise ConfigError(f"no report for benchmark {name!r}; reports exist for {', '.join(REPORTERS)}")
    return importlib.import_module(REPORTERS[name]).markdown(record["results"])


def report_file(path: Path) -> str:
    """:func:`report` of the JSON file at ``path``, led by the command that wrote it, where and how long it ran."""
    record = json.loads(Path(path).read_text())
    machine = record["machine"]
    ran = (
        f"`{record['command']}`: {record['seconds']:,.0f} s on {machine['cpu']} ({machine['usable_cpus']} usable CPUs, "
        f"{machine['torch_threads']} torch threads), load {machine['load_average']} -> {machine['load_average_after']}"
    )
    return f"{ran}\n\n{report(record)}"

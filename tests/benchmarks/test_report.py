"""``geofm bench report``: a results file's Markdown, and the docs' tables as its output verbatim."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.cli import register
from benchmarks.report import DOC_PAGES, report, report_file
from geofm.errors import ConfigError

REPO = Path(__file__).parents[2]
RESULTS = sorted(
    p for p in (REPO / "docs" / "results").glob("*.json") if json.loads(p.read_text())["benchmark"] in DOC_PAGES
)


def _arm(arm: str, seeds: list[int], per_seed: list[float]) -> dict:
    where = {"setting": "2 institutions", "budget": 4, "protocol": "frozen"}
    mean = sum(per_seed) / len(per_seed)
    return {
        "arm": arm,
        **where,
        "pretrain_seeds": seeds,
        "per_pretrain_seed": per_seed,
        "mean": mean,
        "std": 0.01,
        "uplink_bytes": 2**20,
        "downlink_bytes": 0,
        "client_seconds": 12.4,
    }


def test_fed_benefit_report_prints_each_arm_and_each_claim() -> None:
    claim = {
        "setting": "2 institutions",
        "budget": 4,
        "protocol": "frozen",
        "claim": "fedsense as good as central (within 2%)",
        "test": "paired TOST",
        "n": 2,
        "estimate": -0.004,
        "margin": 0.014,
        "ci": [-0.01, 0.002],
        "p": 0.031,
        "holds": True,
    }
    results = {
        "alpha": 0.05,
        "arms": [_arm("random", [], [0.5]), _arm("fedsense", [0, 1], [0.69, 0.71])],
        "claims": [claim],
    }
    text = report({"benchmark": "fed-benefit", "results": results})
    assert text.startswith("**2 institutions, budget 4, frozen backbone**")
    assert "| fedsense | 2 | 0.700 | 0.010 | 0.690 0.710 | 1.0 | 0.0 | 12 |" in text
    assert (
        "- fedsense as good as central (within 2%): **holds** (paired TOST, 2 pretraining seeds: -0.004, "
        "margin +-0.014, 90% CI [-0.010, +0.002], p 0.031)"
    ) in text
    with pytest.raises(ConfigError, match="no report for benchmark 'codec'"):
        report({"benchmark": "codec", "results": {}})


def test_fed_benefit_report_prints_the_dino_table_next_to_the_simmim_one() -> None:
    where = {"setting": "2 institutions", "budget": 4, "protocol": "frozen"}
    claim = {**where, "framework": "dino", "claim": "dino:fedema above dino:fedavg", "test": "paired t-test, one-sided"}
    claim.update(n=2, estimate=0.01, margin=None, ci=[-0.01, 0.03], p=0.2, holds=False)
    results = {
        "alpha": 0.05,
        "arms": [
            {**_arm("fedsense", [0, 1], [0.69, 0.71]), "framework": "simmim"},
            {**_arm("dino:fedavg", [0, 1], [0.6, 0.62]), "framework": "dino"},
            {**_arm("dino:fedema", [0, 1], [0.61, 0.63]), "framework": "dino"},
        ],
        "claims": [claim],
    }
    text = report({"benchmark": "fed-benefit", "results": results})
    simmim, dino = text.split("**DINO: 2 institutions, budget 4, frozen backbone**")
    assert simmim.startswith("**2 institutions, budget 4, frozen backbone**") and "| fedsense |" in simmim
    assert "dino:" not in simmim and "| dino:fedavg |" in dino and "| dino:fedema |" in dino
    assert "- dino:fedema above dino:fedavg: **does not hold**" in dino


def test_report_is_a_bench_command() -> None:
    parser = argparse.ArgumentParser(prog="geofm")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "report", "docs/results/fed-benefit.json"])
    assert args.results == Path("docs/results/fed-benefit.json") and args.handler.__name__ == "_report"


def test_there_is_a_committed_result_to_check() -> None:
    assert RESULTS, "docs/results/ holds no results file of a documented benchmark"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_the_docs_tables_are_the_report_of_their_results_file(path: Path) -> None:
    record = json.loads(path.read_text())
    page = (REPO / DOC_PAGES[record["benchmark"]]).read_text()
    assert report_file(path) in page, (
        f"{DOC_PAGES[record['benchmark']]} does not show `geofm bench report {path.relative_to(REPO)}` verbatim"
    )

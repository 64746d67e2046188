"""``geofm bench flatness`` in its smallest setting (FedAvg and FedProx), and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import flatness as bench
from benchmarks.cli import settings_of
from geofm.config.base import parse_overrides
from geofm.data.demo import make_demo_archive
from geofm.errors import ConfigError


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo")
    make_demo_archive(root, seed=0)
    return root


@pytest.mark.slow
def test_the_smallest_setting_measures_every_method_on_both_partitions(archive: Path, tmp_path: Path) -> None:
    settings = settings_of(bench, True, [f"archive={archive}", f"output_dir={tmp_path / 'out'}"])
    assert [m if isinstance(m, str) else m["name"] for m in settings["methods"]] == ["fedavg", "fedprox"]
    report = bench.run(settings)
    results = json.loads((tmp_path / "out" / "flatness.json").read_text())["results"]
    assert set(results) == {"dirichlet", "by_sensor"} and all(set(m) == {"fedavg", "fedprox"} for m in results.values())
    for partition, methods in results.items():
        for row in methods.values():
            assert row["seeds"][0]["flatness"]["draws"] == settings["draws"]
            assert row["flatness_std"] >= 0 and row["seconds"] > 0
        if partition == "dirichlet":  # validation accuracy of the global model, from rounds.jsonl
            assert all(0.0 <= row["metric"] <= 1.0 for row in methods.values())
        else:  # the held-out MIM loss is the measure's unperturbed loss
            assert all(row["metric"] == row["loss"] > 0 for row in methods.values())
    # the same seed and one local step from the same start: the proximal term has no gradient yet
    assert results["dirichlet"]["fedprox"]["metric"] == results["dirichlet"]["fedavg"]["metric"]
    assert len(report.rows) == 4
    markdown = (tmp_path / "out" / "flatness.md").read_text()
    command = markdown.splitlines()[0].removeprefix("Command: `").removesuffix("`")
    pairs = [p.strip("'") for p in command.removeprefix("geofm bench flatness ").split(" ")]
    assert {**bench.DEFAULTS, **dict(parse_overrides(pairs))} == settings, "the command does not rerun the settings"
    assert "| dirichlet | fedprox |" in markdown


def test_methods_that_are_not_registered_are_named_before_anything_runs(tmp_path: Path) -> None:
    settings = settings_of(bench, True, ["methods=[fedavg, nosuch_sam, nosuch_swa]", f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"methods: nosuch_sam, nosuch_swa are not a registered algorithm"):
        bench.run(settings)
    with pytest.raises(ConfigError, match="'fedavg' appears twice"):
        bench.method_sections(["fedavg", {"name": "fedavg"}])
    assert bench.method_sections([{"name": "fedavg", "label": "plain"}]) == {"plain": {"name": "fedavg"}}

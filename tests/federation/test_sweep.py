"""``geofm fed sweep``: one simulation per algorithm x scenario (x uplink), skipped once finished, then compared."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from federation.sweep import read_sweep, run_sweep
from geofm.errors import ConfigError, GeoFMError
from tests.federation.conftest import fedsense_options

pytestmark = pytest.mark.slow


@pytest.fixture
def sweep_file(fed_tree, tmp_path):
    """A sweep over a one-round federated demo base (FedSense with a 1-bit uplink) written beside it."""

    def make(**sweep) -> str:
        base = fed_tree("base", federation={"rounds": 1})
        (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
        settings = {"config": "base.yaml", "output_dir": str(tmp_path / "sweep"), **sweep}
        path = tmp_path / "sweep.yaml"
        path.write_text(yaml.safe_dump(settings, sort_keys=False))
        return str(path)

    return make


def test_cells_run_every_combination_over_the_bases_communication_settings_only(sweep_file, tmp_path):
    path = sweep_file(
        algorithms={"fedavg": {}, "prox": {"name": "fedprox", "options": {"proximal_beta": 0.1}}},
        scenarios={"sources": {}, "regions": {"partition": "by_region", "clients": 2}},
        uplinks={"32bit": {"bits": 32, "error_feedback": False}, "1bit": {"bits": 1}},
    )
    _, cells = read_sweep(path)
    assert [c.name for c in cells[:4]] == [
        "sources__fedavg__32bit",
        "sources__prox__32bit",
        "sources__fedavg__1bit",
        "sources__prox__1bit",
    ]
    assert len(cells) == 8
    fedavg_1bit = cells[2].tree["algorithm"]
    # FedSense's own settings of the base do not carry over; its uplink does, changed by the cell.
    assert fedavg_1bit["name"] == "fedavg" and "options" not in fedavg_1bit
    assert fedavg_1bit["uplink"]["bits"] == 1 and fedavg_1bit["uplink"]["error_feedback"] is True
    assert cells[1].tree["algorithm"]["options"] == {"proximal_beta": 0.1}
    assert cells[5].tree["federation"]["partition"] == "by_region"
    assert cells[5].run_dir == tmp_path / "sweep/regions/prox__32bit"
    assert cells[5].tree["run"]["output_dir"] == str(cells[5].run_dir)


def test_an_invalid_cell_is_named_before_anything_runs(sweep_file, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran a cell"))
    with pytest.raises(ConfigError, match=r"(?s)cell base__fedavgg.*did you mean 'fedavg'"):
        run_sweep(sweep_file(algorithms={"fedavgg": {}}))
    with pytest.raises(ConfigError, match="label 'a/b'"):
        read_sweep(sweep_file(algorithms={"a/b": {}}))


def test_every_cell_keeps_the_bases_privacy_and_one_that_cannot_is_named(fed_tree, monkeypatch, tmp_path):
    privacy = {"mode": "central", "clip": 0.1, "noise_multiplier": 1.0}
    base = fed_tree(
        "base", federation={"rounds": 1}, algorithm={"options": fedsense_options(distill_steps=0), "privacy": privacy}
    )
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    sweep = {"config": "base.yaml", "output_dir": str(tmp_path / "sweep"), "algorithms": {"fedavg": {}}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    _, (cell,) = read_sweep(str(tmp_path / "sweep.yaml"))
    assert cell.tree["algorithm"]["privacy"] == privacy
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({**sweep, "algorithms": {"scaffold": {}}}))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran a cell"))
    with pytest.raises(ConfigError, match=r"(?s)cell base__scaffold.*privacy: scaffold uploads"):
        run_sweep(str(tmp_path / "sweep.yaml"))


def test_a_failed_cell_leaves_the_others_to_run_and_is_named(sweep_file, monkeypatch, tmp_path):
    calls = []

    def fake_run(command, check):
        calls.append(command)
        return subprocess.CompletedProcess(command, 3)

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(GeoFMError, match=r"cells \['base__fedavg', 'base__fedprox'\] failed"):
        run_sweep(sweep_file(algorithms={"fedavg": {}, "fedprox": {"options": {"proximal_beta": 0.1}}}))
    assert len(calls) == 2
    assert json.loads((tmp_path / "sweep/sweep.json").read_text())["finished"] == {}


def test_a_sweep_runs_its_cells_compares_them_and_skips_them_when_rerun(sweep_file, monkeypatch, tmp_path):
    path = sweep_file(algorithms={"fedavg": {}, "fedprox": {"options": {"proximal_beta": 0.1}}})
    report = run_sweep(path, simulate_args=["--num-cpus", "2"])
    out = tmp_path / "sweep"
    for algorithm in ("fedavg", "fedprox"):
        rounds = (out / "base" / algorithm / "rounds.jsonl").read_text().splitlines()
        assert len(rounds) == 1
        assert json.loads((out / "base" / algorithm / "sweep_cell.json").read_text())["algorithm"] == algorithm
    text = report.read_text()
    assert "| fedavg |" in text and "| fedprox |" in text
    assert (out / "comparison/comparison.png").is_file()
    costs = {row["algorithm"]: row for row in json.loads((out / "comparison/comparison.json").read_text())}
    assert costs["fedavg"]["step_cost_vs_fedavg"] == 1.0
    assert costs["fedprox"]["step_cost_vs_fedavg"] > 0 and costs["fedprox"]["client_peak_memory_mib"] > 0
    assert costs["fedprox"]["server_seconds_per_round"] > 0

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("reran a finished cell"))
    assert run_sweep(path) == report

"""What the one-shot programs share (:mod:`federation.programs.oneshot`): `geofm fed simulate` checks their inputs first."""

from __future__ import annotations

import json

import pytest

import federation.flower.simulation
from geofm.cli import main

TREES = {"oscar": "oscar_tree", "ensemble": "ensemble_tree", "feddiff": "feddiff_tree"}


def _refusal(program: str, tree: dict, tmp_path, monkeypatch, capsys) -> str:
    """The one line `geofm fed simulate --program PROGRAM` prints for ``tree``, which must not start Ray."""
    monkeypatch.setattr(federation.flower.simulation, "_start_ray", lambda *a: pytest.fail("Ray started"))
    config = tmp_path / f"{program}.json"  # JSON is YAML
    config.write_text(json.dumps(tree))
    assert main(["fed", "simulate", "--config", str(config), "--program", program]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("program", ["oscar", "ensemble"])
def test_simulate_refuses_a_missing_public_folder_before_ray_starts(program, request, tmp_path, monkeypatch, capsys):
    tree = request.getfixturevalue(TREES[program])(tmp_path / "run")
    tree[program]["public"] = str(missing := tmp_path / "nonexistent")
    line = _refusal(program, tree, tmp_path, monkeypatch, capsys)
    assert line.startswith(f"geofm: error: {program}.public: no folder {missing} ")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("program", TREES)
def test_simulate_refuses_a_missing_data_root_of_every_one_shot_program_before_ray_starts(
    program, request, tmp_path, monkeypatch, capsys
):
    tree = request.getfixturevalue(TREES[program])(tmp_path / "run")
    tree["data"]["root"] = str(missing := tmp_path / "nonexistent")
    line = _refusal(program, tree, tmp_path, monkeypatch, capsys)
    assert line.startswith("geofm: error: ") and f"{missing}/" in line and "does not exist" in line

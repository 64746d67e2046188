"""`geofm fed simulate` runs the federated pretraining program on Flower's simulation engine."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml


def test_geofm_fed_simulate_runs_fedsense_on_flower_and_resumes(fed_tree, tmp_path, child_env):
    tree = fed_tree("simulated", federation={"rounds": 2})
    config = tmp_path / "fed.yaml"
    config.write_text(yaml.safe_dump(tree))
    cmd = [sys.executable, "-m", "geofm.cli", "fed", "simulate", "--config", str(config), "--num-cpus", "2"]
    done = subprocess.run(
        [*cmd, "federation.stop_after_rounds=1"], check=False, env=child_env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    run_dir = tmp_path / "simulated"
    assert "stopped after round 1 of 2" in done.stderr and not (run_dir / "backbone.safetensors").exists()
    assert "reconstruction figure" not in done.stdout, "drawn at the end of the run"

    done = subprocess.run(cmd, check=False, env=child_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "resumed from" in done.stderr
    assert f"reconstruction figure: {run_dir / 'reconstruction.png'}\n" in done.stdout
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2] and all(len(r["clients"]) == 3 for r in rounds)
    assert json.loads((run_dir / "backbone.json").read_text())["federation"]["rounds"] == 2
    states = sorted(p.name for p in (run_dir / "clients/uav_rgbn").iterdir())
    assert states == ["state_round_000001.npz", "state_round_000002.npz"], "each client keeps its state on disk"

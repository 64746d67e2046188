"""`geofm fed simulate` runs the federated pretraining program on Flower's simulation engine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import yaml

from federation.programs.base import check_simulation_inputs
from geofm.config.federated import FederatedConfig
from geofm.errors import ConfigError
from geofm.loggers import TENSORBOARD_FOLDER
from tests.federation.conftest import geofm_stderr_lines

pytestmark = pytest.mark.slow


def test_geofm_fed_simulate_runs_fedsense_on_flower_and_resumes(fed_tree, tmp_path, child_env):
    """Also the loggers on Flower's simulation engine: the server (a process of its own) writes the
    TensorBoard event files, each round once across the stopped run and its resumption."""
    tree = fed_tree("simulated", federation={"rounds": 2})
    config = tmp_path / "fed.yaml"
    config.write_text(yaml.safe_dump(tree))
    cmd = [sys.executable, "-m", "geofm.cli", "fed", "simulate", "--config", str(config), "--num-cpus", "2"]
    cmd += ["run.loggers=[jsonl,tensorboard]"]
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

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / TENSORBOARD_FOLDER), size_guidance={"scalars": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (r["round"], pytest.approx(r["loss"], rel=1e-6)) for r in rounds
    ]
    assert [e.step for e in events.Scalars("client_losses/loss/uav_rgbn")] == [1, 2]


def test_ctrl_c_stops_geofm_fed_simulate_after_its_last_round_and_a_rerun_resumes(fed_tree, tmp_path, child_env):
    tree = fed_tree("stopped", federation={"rounds": 20})
    config = tmp_path / "fed.yaml"
    config.write_text(yaml.safe_dump(tree))
    cmd = [sys.executable, "-m", "geofm.cli", "fed", "simulate", "--config", str(config), "--num-cpus", "2"]
    rounds_log = tmp_path / "stopped" / "rounds.jsonl"
    main = subprocess.Popen(cmd, env=child_env, stderr=subprocess.PIPE, text=True)
    while not (rounds_log.exists() and rounds_log.read_text()):
        assert main.poll() is None, "the simulation ended before its first round"
        time.sleep(0.2)
    main.send_signal(signal.SIGINT)
    _, stderr = main.communicate()
    done = len(rounds_log.read_text().splitlines())
    assert main.returncode == 2, stderr[-4000:]
    expected = f"geofm: error: stopped by SIGINT after round {done}; rerun the same command to resume"
    assert geofm_stderr_lines(stderr) == [expected], stderr[-4000:]

    resumed = subprocess.run(
        [*cmd, "federation.stop_after_rounds=1"], check=False, env=child_env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"after round {done}" in resumed.stderr and f"stopped after round {done + 1} of 20" in resumed.stderr
    assert [json.loads(line)["round"] for line in rounds_log.read_text().splitlines()] == list(range(1, done + 2))


def test_geofm_fed_simulate_refuses_a_missing_client_folder_before_it_starts(fed_tree, tmp_path, child_env):
    """In a simulation every institution's data is on this machine: a missing folder is the config's error."""
    tree = fed_tree("missing")
    tree["data"]["sources"][2]["root"] = str(missing := tmp_path / "no_such_dir")
    config = tmp_path / "fed.yaml"
    config.write_text(yaml.safe_dump(tree))
    command = [sys.executable, "-m", "geofm.cli", "fed", "simulate", "--config", str(config), "--num-cpus", "2"]
    done = subprocess.run(command, check=False, env=child_env, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-4000:]
    assert f"data.sources.2.root (institution uav_rgbn): image folder {missing} does not exist" in done.stderr
    assert "starting Ray" not in done.stderr and not (tmp_path / "missing").exists(), "refused before anything started"


def test_a_simulation_reports_every_missing_input_at_once_naming_who_reads_it(fed_tree, tmp_path):
    tree = fed_tree("missing", federation={"partition": "dirichlet", "clients": 3})
    tree["data"]["sources"][0]["root"] = str(tmp_path / "no_aerial")
    tree["task_options"]["teacher"]["checkpoint"] = str(tmp_path / "no_teacher.pth")
    with pytest.raises(ConfigError, match=r"fed\.yaml: 2 input") as caught:
        check_simulation_inputs(FederatedConfig.from_tree(tree), "fed.yaml")
    assert f"data.sources.0.root (aerial_rgb, shared by the clients): image folder {tmp_path / 'no_aerial'}" in str(
        caught.value
    )
    assert f"task_options.teacher.checkpoint: checkpoint not found: {tmp_path / 'no_teacher.pth'}" in str(caught.value)

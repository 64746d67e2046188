"""What makes a simulation stopped by SIGINT or SIGTERM end within seconds, without starting one: the end to
end behaviour is :func:`tests.federation.flower.test_adapter.test_a_stop_signal_ends_a_simulation_in_one_line_naming_its_last_round_and_leaves_no_ray_process`."""

from __future__ import annotations

import gc
import signal
from types import SimpleNamespace

import yaml

import federation.flower.simulation
from federation.flower.adapter import _server_main
from federation.flower.simulation import WORKER_MARKER, SimulationStop
from geofm.cli import main
from geofm.errors import RunInterrupted


def test_a_stopped_server_ends_as_a_finished_one_and_leaves_the_stop_for_the_simulation_to_raise(toy_run_config):
    """Flower's engine waits 3 s for the context of a server that raised: a stopped one returns."""
    stop = SimulationStop(WORKER_MARKER, "no-such-token")
    stop.received = signal.SIGTERM
    _server_main(None, SimpleNamespace(run_config={}), toy_run_config(), stop)
    assert isinstance(stop.interrupted, RunInterrupted)
    assert str(stop.interrupted) == "stopped by SIGTERM before round 1; rerun the same command to resume"


def test_a_stopped_simulate_command_skips_the_last_garbage_collection_and_exits_2_in_one_line(
    tmp_path, monkeypatch, capsys
):
    """The process ends once it printed the line: walking every object of torch, Ray and Flower first took seconds."""
    stopped = "stopped by SIGINT after round 3; rerun the same command to resume"

    def simulate(*args, **kwargs):
        raise RunInterrupted(stopped)

    frozen = []
    monkeypatch.setattr(federation.flower.simulation, "simulate", simulate)
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    config = tmp_path / "toy.yaml"
    config.write_text(yaml.safe_dump({"rounds": 5, "out": str(tmp_path / "records.jsonl")}))
    command = ["fed", "simulate", "--config", str(config), "--program", "toy", "--institutions", "a,b"]
    assert main(command) == 2
    assert capsys.readouterr().err.splitlines() == [f"geofm: error: {stopped}"]
    assert frozen == [True]

"""A client's processes (``federation.local_processes``, a node's ``local-processes``) are refused above the
machine's devices before any starts: a GPU each, or a CPU core each."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import yaml

import federation.flower.simulation
from federation.programs.client import local_processes
from geofm.cli import main
from geofm.config.federated import FederatedConfig
from geofm.errors import ConfigError
from geofm.training import engine as ds

CORES = len(os.sched_getaffinity(0))


def test_devices_are_the_gpus_under_a_gpu_accelerator_else_the_cores_this_process_may_use(monkeypatch):
    assert ds.local_devices() == (CORES, "CPU cores")  # the tests run with DS_ACCELERATOR=cpu
    gpus = SimpleNamespace(device_name=lambda: "cuda", device_count=lambda: 8)
    monkeypatch.setattr(ds, "get_accelerator", lambda: gpus)
    assert ds.local_devices() == (8, "GPUs")


def test_simulate_refuses_more_local_processes_than_cores_in_one_line_before_ray_starts(
    fed_tree, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(federation.flower.simulation, "_start_ray", lambda *a: pytest.fail("Ray started"))
    config = tmp_path / "fed.yaml"
    config.write_text(yaml.safe_dump(fed_tree("many")))
    assert main(["fed", "simulate", "--config", str(config), f"federation.local_processes={CORES + 1}"]) == 2
    expected = (
        f"geofm: error: federation.local_processes={CORES + 1}: a client trains on one process per device, and "
        f"this machine has {CORES} CPU cores; expected at most {CORES}"
    )
    assert capsys.readouterr().err.splitlines() == [expected]
    assert not (tmp_path / "many").exists()


def test_a_node_refuses_more_local_processes_than_its_cores_and_its_own_setting_wins(fed_tree):
    cfg = FederatedConfig.from_tree(fed_tree("node", federation={"local_processes": CORES + 1}))
    with pytest.raises(ConfigError, match=f"^federation.local_processes={CORES + 1}: .* has {CORES} CPU cores"):
        local_processes({"institution": "uav_rgbn"}, cfg)
    with pytest.raises(ConfigError, match=f"^node config local-processes={CORES + 1}: .* has {CORES} CPU cores"):
        local_processes({"institution": "uav_rgbn", "local-processes": CORES + 1}, cfg)
    assert local_processes({"institution": "uav_rgbn", "local-processes": CORES}, cfg) == CORES

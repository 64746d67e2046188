"""``run.loggers`` on a federated run: the server's rounds as TensorBoard scalars (the clients' means and
each client's own), and an MLflow run that ends with the exported backbone. On Flower's simulation
engine, tests/federation/flower/test_simulate_program.py's resumed run checks the server's TensorBoard scalars."""

from __future__ import annotations

import json

import pytest

from federation.programs.client import FederatedClient
from federation.programs.server import FederatedServer
from federation.runtime.inprocess import InProcess
from federation.runtime.roundloop import run_server
from geofm.config.federated import FederatedConfig
from geofm.loggers import MLFLOW_RUN_FILE, TENSORBOARD_FOLDER, local_store

pytestmark = pytest.mark.slow


def test_a_federated_run_logs_each_round_and_each_client_to_tensorboard_and_mlflow(fed_tree):
    tree = fed_tree("logged", federation={"rounds": 2}, run={"loggers": ["tensorboard", "mlflow"]})
    cfg = FederatedConfig.from_tree(tree)
    clients = {i + 1: FederatedClient(cfg, {"institution": name}) for i, name in enumerate(cfg.client_names)}
    server = FederatedServer(cfg)
    run_server(server, InProcess(clients), poll_s=0)
    run_dir = cfg.run.output_dir
    rounds = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / TENSORBOARD_FOLDER), size_guidance={"scalars": 0}).Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("loss", "loss_mim", "lr", "uplink_bytes", "downlink_bytes", "seconds"):
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [
            (r["round"], pytest.approx(r[tag], rel=1e-6)) for r in rounds
        ], tag
    for client in cfg.client_names:
        assert {f"examples/{client}", f"client_losses/loss/{client}", f"client_seconds_per_step/{client}"} <= tags
        assert [e.value for e in events.Scalars(f"client_losses/loss/{client}")] == pytest.approx(
            [r["client_losses"]["loss"][client] for r in rounds], rel=1e-6
        )

    from mlflow.tracking import MlflowClient

    mlflow = MlflowClient(tracking_uri=local_store(run_dir))
    run = mlflow.get_run(json.loads((run_dir / MLFLOW_RUN_FILE).read_text())["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["federation.rounds"] == "2"
    assert [m.step for m in mlflow.get_metric_history(run.info.run_id, "uplink_bytes")] == [1, 2]
    artifacts = {a.path for a in mlflow.list_artifacts(run.info.run_id)}
    assert {"backbone.safetensors", "backbone.json", "MODEL_CARD.md", "config.yaml"} <= artifacts

"""``run.loggers`` on central pretraining: TensorBoard event files and an MLflow run beside metrics.jsonl,
continued (not restarted) by a resumed run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geofm.config import PretrainConfig
from geofm.loggers import MLFLOW_RUN_FILE, TENSORBOARD_FOLDER, local_store
from pretrain.central import pretrain

pytestmark = pytest.mark.slow


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tensorboard(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / TENSORBOARD_FOLDER), size_guidance={"scalars": 0, "images": 0})
    return events.Reload()


def _mlflow(run_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=local_store(run_dir))
    run_id = json.loads((run_dir / MLFLOW_RUN_FILE).read_text())["run_id"]
    return client, client.get_run(run_id)


def test_a_stopped_and_resumed_run_continues_its_tensorboard_and_mlflow_curves(tiny_tree):
    loggers = ["jsonl", "tensorboard", "mlflow"]
    tree = tiny_tree("logged", run={"loggers": loggers, "stop_after_steps": 4})
    run_dir = pretrain(PretrainConfig.from_tree(tree))
    client, first = _mlflow(run_dir)
    assert first.info.status == "KILLED", "stopped before the schedule's end; a rerun resumes it"
    assert first.data.params["train.epochs"] == "2" and first.data.params["run.loggers"] == json.dumps(loggers)

    run_dir = pretrain(PretrainConfig.from_tree(tiny_tree("logged", run={"loggers": loggers})))
    records = [r for r in _metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 13))

    events = _tensorboard(run_dir)
    losses = events.Scalars("loss")
    assert [e.step for e in losses] == list(range(1, 13)), "each step once, the resumed ones after the first four"
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert [e.step for e in events.Scalars("lr")] == list(range(1, 13))
    assert "images_per_s" in events.Tags()["scalars"]
    assert [image.step for image in events.Images("figures/reconstruction")] == [4, 8, 12]

    client, run = _mlflow(run_dir)
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(1, 13))
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"backbone.safetensors", "backbone.json", "MODEL_CARD.md", "config.yaml", "figures"} <= artifacts

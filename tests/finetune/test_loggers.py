"""``run.loggers`` on finetuning: the validation and test metrics in TensorBoard and MLflow, the kept
weights and their evaluation as MLflow artifacts; rerunning a finished run logs nothing twice."""

from __future__ import annotations

import json

import pytest

from finetune.run import finetune
from geofm.config.finetune import FinetuneConfig
from geofm.loggers import MLFLOW_RUN_FILE, TENSORBOARD_FOLDER, local_store

pytestmark = pytest.mark.slow


def test_a_finetuning_run_logs_its_evaluation_metrics(class_folders, task_tree):
    tree = task_tree("classification", "logged", data={"root": str(class_folders)})
    tree["run"]["loggers"] = ["jsonl", "tensorboard", "mlflow"]
    run_dir = finetune(FinetuneConfig.from_tree(tree))
    validations = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "val" in r]
    test = json.loads((run_dir / "eval.json").read_text())["metrics"]
    finetune(FinetuneConfig.from_tree(tree))  # a finished run re-evaluates only

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / TENSORBOARD_FOLDER), size_guidance={"scalars": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("val/accuracy")] == [
        (r["step"], pytest.approx(r["val"]["accuracy"])) for r in validations
    ]
    assert [(e.step, e.value) for e in events.Scalars("test/accuracy")] == [(12, pytest.approx(test["accuracy"]))]
    assert [e.step for e in events.Scalars("epoch")] == list(range(1, 13)), "the validation's epoch is not a second"
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 13))

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=local_store(run_dir))
    run_id = json.loads((run_dir / MLFLOW_RUN_FILE).read_text())["run_id"]
    assert [m.step for m in client.get_metric_history(run_id, "val/accuracy")] == [r["step"] for r in validations]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "test/accuracy")] == [
        (12, pytest.approx(test["accuracy"]))
    ]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(run_id)} >= {"best", "eval.json", "config.yaml"}
    assert {a.path for a in client.list_artifacts(run_id, "best")} >= {"best/model.safetensors", "best/best.json"}

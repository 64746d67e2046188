"""``run.loggers``: the names a config takes, the missing package, and the dashboards' records of a run
that is stopped and resumed (TensorBoard purges what a killed run wrote after its checkpoint; MLflow
continues the same run without logging a step twice)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from geofm.config import PretrainConfig
from geofm.config.finetune import FinetuneConfig
from geofm.config.sections import RunConfig
from geofm.errors import ConfigError, GeoFMError, RunInterrupted
from geofm.loggers import (
    MLFLOW_RUN_FILE,
    TENSORBOARD_FOLDER,
    RunLoggers,
    check_installed,
    end_status,
    local_store,
    scalars,
)

DEMO = Path(__file__).parents[1] / "configs/pretrain/demo_gfm_swin_micro__img64_win4__4band.yaml"


def test_a_typo_in_run_loggers_is_refused_with_the_name_it_may_mean():
    with pytest.raises(ConfigError) as info:
        PretrainConfig.from_file(DEMO, ["run.loggers=[jsonl,tensorbord]"])
    assert str(info.value).splitlines()[1] == (
        "  override run.loggers=[jsonl,tensorbord]: unknown logger 'tensorbord'; did you mean 'tensorboard'? "
        "(known: jsonl, tensorboard, mlflow) (got ['jsonl', 'tensorbord'])"
    )


def test_run_loggers_default_to_jsonl_which_is_always_kept_first(tmp_path):
    assert RunConfig(output_dir=tmp_path).loggers == ["jsonl"]
    assert _run(tmp_path, ["mlflow", "tensorboard", "mlflow"]).loggers == ["jsonl", "mlflow", "tensorboard"]
    assert _run(tmp_path, "tensorboard").loggers == ["jsonl", "tensorboard"], "one name, as run.loggers=tensorboard"


def test_a_missing_package_is_named_with_the_extra_that_installs_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    check_installed(["jsonl", "tensorboard"])
    with pytest.raises(GeoFMError, match=r"^run.loggers names mlflow, but the mlflow package is not installed: "):
        check_installed(["jsonl", "mlflow"])


@pytest.mark.slow
def test_a_finetuning_run_without_the_package_stops_before_it_builds_anything(monkeypatch, task_tree):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    from finetune.run import finetune

    cfg = FinetuneConfig.from_tree(task_tree("classification", run={"loggers": ["mlflow"]}))
    with pytest.raises(GeoFMError, match=r"pip install geofm\[mlflow\]$"):
        finetune(cfg)
    assert not cfg.run.output_dir.exists()


def test_a_record_gives_its_numbers_by_tag_nested_entries_by_path():
    record = {
        "round": 3,
        "clients": ["a", "b"],
        "loss": 0.5,
        "examples": {"a": 24, "b": 12},
        "val": {"accuracy": 0.75},
        "discarded": "why",
        "flag": True,
        "missing": None,
    }
    assert scalars(record, "round") == {"loss": 0.5, "examples/a": 24.0, "examples/b": 12.0, "val/accuracy": 0.75}


def test_an_invocation_ends_finished_stopped_or_failed():
    assert end_status(None, finished=True) == "FINISHED"
    assert end_status(None, finished=False) == "KILLED"
    assert end_status(RunInterrupted("stopped by SIGINT"), finished=False) == "KILLED"
    assert end_status(ValueError("bad"), finished=False) == "FAILED"


def _run(tmp_path: Path, loggers: list[str] | str, **settings) -> RunConfig:
    return RunConfig(output_dir=tmp_path, loggers=loggers, **settings)


def _write(logs: RunLoggers, steps: range, offset: float = 0.0) -> None:
    for step in steps:
        logs.write({"step": step, "loss": step + offset, "val": {"accuracy": step / 10}})


@pytest.mark.slow
def test_tensorboard_drops_what_a_killed_run_wrote_after_its_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _run(tmp_path, ["tensorboard"])
    killed = RunLoggers(tmp_path / "metrics.jsonl", run)
    _write(killed, range(1, 7))  # checkpoint at 4, killed after 6 (never closed)
    with RunLoggers(tmp_path / "metrics.jsonl", run, resume_step=4) as resumed:
        _write(resumed, range(5, 9), offset=100.0)
        _write(resumed, range(8, 9), offset=200.0)  # a step already logged is not logged again
    events = EventAccumulator(str(tmp_path / TENSORBOARD_FOLDER), size_guidance={"scalars": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
        (5, 105.0),
        (6, 106.0),
        (7, 107.0),
        (8, 108.0),
    ]
    assert [e.step for e in events.Scalars("val/accuracy")] == list(range(1, 9))


@pytest.mark.slow
def test_mlflow_continues_the_same_run_and_logs_no_step_twice(tmp_path):
    from mlflow.tracking import MlflowClient

    run = _run(tmp_path, ["mlflow"], mlflow_experiment="loggers-test")
    config = {"train": {"epochs": 2, "bands": ["red", "nir"]}, "run": {"seed": 0}}
    killed = RunLoggers(tmp_path / "metrics.jsonl", run, config=config)
    _write(killed, range(1, 7))  # checkpoint at 4, killed after 6: MLflow keeps 5 and 6
    run_id = json.loads((tmp_path / MLFLOW_RUN_FILE).read_text())["run_id"]
    resumed_config = {**config, "run": {"seed": 0, "stop_after_steps": 3}}
    with RunLoggers(tmp_path / "metrics.jsonl", run, resume_step=4, config=resumed_config) as resumed:
        _write(resumed, range(5, 9), offset=100.0)
    client = MlflowClient(tracking_uri=local_store(tmp_path))
    assert json.loads((tmp_path / MLFLOW_RUN_FILE).read_text())["run_id"] == run_id
    history = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(s, float(s)) for s in range(1, 7)] + [(7, 107.0), (8, 108.0)]
    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED" and finished.info.run_name == tmp_path.name
    assert finished.data.params == {
        "train.epochs": "2",
        "train.bands": '["red", "nir"]',
        "run.seed": "0",
        "run.stop_after_steps": "3",
    }
    assert client.get_experiment(finished.info.experiment_id).name == "loggers-test"
    artifacts = client.get_experiment(finished.info.experiment_id).artifact_location
    assert artifacts == (tmp_path / "mlartifacts").as_uri(), "the local store keeps its artifacts in the run folder"

    elsewhere = _run(tmp_path, ["mlflow"], mlflow_tracking_uri=f"sqlite:///{tmp_path / 'other.db'}")
    with pytest.raises(GeoFMError, match=rf"names MLflow run {run_id} of sqlite:.*does not hold: restore"):
        RunLoggers(tmp_path / "metrics.jsonl", elsewhere, resume_step=8)

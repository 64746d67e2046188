"""Where a run's log records go: its JSON-lines file and, as ``run.loggers`` adds, TensorBoard and MLflow.

Every program logs through one :class:`RunLoggers` (``metrics.jsonl`` of central pretraining and
finetuning, ``rounds.jsonl`` of a federated server): it is a :class:`~geofm.runlog.MetricsLog`, which
the run reads back for its curves, model card and resume, and it hands each record to the dashboards
the config names:

- ``tensorboard``: event files in ``RUN/tensorboard`` (``torch.utils.tensorboard``); a record's numbers
  are scalars tagged by their key (a nested entry as ``val/accuracy``), a run's figure an image;
- ``mlflow``: an MLflow run in ``run.mlflow_tracking_uri``, by default a local store in the run folder
  (``sqlite:///RUN/mlflow.db``, artifacts in ``RUN/mlartifacts``), its id kept in ``RUN/mlflow_run.json``;
  the config as parameters, the same scalars as metrics, the run's export as artifacts at the end.

A resumed run continues its curves: TensorBoard purges what a killed invocation wrote after the
checkpoint resumed from (``purge_step``), and MLflow continues the same run, whose values logged
after that checkpoint stay (MLflow cannot delete them) and are not logged again. A dashboard never
gets a tag twice at one step. See ``docs/loggers.md``.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geofm.errors import GeoFMError, RunInterrupted
from geofm.runlog import MetricsLog

if TYPE_CHECKING:
    from geofm.config.sections import RunConfig

log = logging.getLogger("geofm.loggers")

LOGGERS = ("jsonl", "tensorboard", "mlflow")
"""The names ``run.loggers`` takes; ``jsonl`` is always written (the run reads it back)."""
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow"}
"""The package each dashboard needs, installed by the extra of the same name (``geofm[tensorboard]``)."""
TENSORBOARD_FOLDER = "tensorboard"
MLFLOW_STORE = "mlflow.db"
MLFLOW_ARTIFACTS = "mlartifacts"
MLFLOW_RUN_FILE = "mlflow_run.json"
"""In the run folder: the MLflow run a resumed run continues (its id, tracking URI and experiment)."""
RUN_FILE = "config.yaml"
"""The config a run folder keeps (a nested run folder is named after the run above it)."""


def logger_names(names: list[str]) -> list[str]:
    """``run.loggers`` checked: known names (ValueError naming the nearest for a typo), each once, with
    ``jsonl`` first, added where it is left out."""
    for name in names:
        if name not in LOGGERS:
            near = difflib.get_close_matches(str(name), LOGGERS, n=2, cutoff=0.5)
            hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
            raise ValueError(f"unknown logger {name!r}{hint} (known: {', '.join(LOGGERS)})")
    return ["jsonl", *dict.fromkeys(name for name in names if name != "jsonl")]


def check_installed(names: Iterable[str]) -> None:
    """Raise before training when a configured dashboard's package is missing.

    Raises:
        GeoFMError: naming the logger and the extra that installs it.
    """
    for name in names:
        package = PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise GeoFMError(
                f"run.loggers names {name}, but the {package} package is not installed: pip install geofm[{name}]"
            )


def local_store(run_dir: Path) -> str:
    """The tracking URI of the MLflow store inside a run folder."""
    return f"sqlite:///{(run_dir / MLFLOW_STORE).resolve()}"


def scalars(record: Mapping[str, Any], skip: str = "step") -> dict[str, float]:
    """The numbers of a log record by tag: a nested entry's tag is its path (``val/accuracy``,
    ``examples/client_a``); texts, lists, flags, nulls and ``skip`` (the step key) are left out."""
    found: dict[str, float] = {}

    def visit(value: Any, tag: str) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, f"{tag}/{key}" if tag else str(key))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found[tag] = float(value)

    visit({key: value for key, value in record.items() if key != skip}, "")
    return found


def end_status(error: BaseException | None, finished: bool) -> str:
    """An MLflow run status for how an invocation ended: FINISHED at the end of the schedule, KILLED when
    it stopped before (asked to, or interrupted; a rerun resumes it), FAILED on an error."""
    if error is None:
        return "FINISHED" if finished else "KILLED"
    return "KILLED" if isinstance(error, RunInterrupted | KeyboardInterrupt) else "FAILED"


class RunLoggers(MetricsLog):
    """A run's JSON-lines log (``path``) and the dashboards of ``run.loggers``; open on rank 0 only.

    Args:
        path: the JSON-lines file (``metrics.jsonl``, ``rounds.jsonl``); its folder is the run folder.
        run: the config's ``run`` section.
        resume_step: the step (round) the run resumes from: later records of the file are dropped, and
            the dashboards take records after it only.
        key: the record's step entry (``round`` for a federated server).
        config: the run's config as a dict (MLflow's parameters).
    """

    def __init__(
        self,
        path: Path,
        run: RunConfig,
        *,
        resume_step: int = 0,
        key: str = "step",
        config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(path, resume_step=resume_step, key=key)
        self.key = key
        check_installed(run.loggers)
        run_dir = path.parent
        self.dashboards: list[_Dashboard] = []
        if "tensorboard" in run.loggers:
            self.dashboards.append(_TensorBoard(run_dir / TENSORBOARD_FOLDER, resume_step))
        if "mlflow" in run.loggers:
            self.dashboards.append(_MLflow(run_dir, run, resume_step, config or {}))

    def write(self, record: dict) -> None:
        """Append ``record`` to the file and give its numbers to every dashboard at its step."""
        super().write(record)
        self.scalars(scalars(record, self.key), int(record[self.key]))

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """Numbers for the dashboards only (the file has them elsewhere, e.g. the test metrics in ``eval.json``)."""
        for dashboard in self.dashboards:
            fresh = dashboard.fresh(values, step)
            if fresh:
                dashboard.scalars(fresh, step)

    def figure(self, path: Path, step: int) -> None:
        """A figure the run drew (a PNG), as an image tagged by its name (``reconstruction``) if it exists."""
        if not path.is_file():
            return
        for dashboard in self.dashboards:
            if dashboard.fresh({f"figures/{path.stem}": 0.0}, step):
                dashboard.figure(path, step)

    def artifacts(self, paths: Iterable[Path]) -> None:
        """The run's products (its export, kept weights, evaluation) to the dashboards that keep files."""
        existing = [path for path in paths if path.exists()]
        for dashboard in self.dashboards:
            dashboard.artifacts(existing)

    def __enter__(self) -> RunLoggers:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """Close as FINISHED, or with the status of the error that ended the block."""
        self.close(end_status(error, finished=error is None))

    def close(self, status: str = "FINISHED") -> None:
        """Flush and close the dashboards; MLflow's run ends with ``status`` (see :func:`end_status`). A
        dashboard that fails to close is warned of: the run's own outcome stands."""
        for dashboard in self.dashboards:
            try:
                dashboard.close(status)
            except Exception as err:  # the run's outcome matters more than a dashboard's last write
                log.warning("could not close the %s logger: %s", dashboard.name, err)
        self.dashboards = []


class _Dashboard(ABC):
    """A dashboard, with its filter: each tag's steps only increase, and none is at or before the resume step."""

    name = ""

    def __init__(self, resume_step: int) -> None:
        self.resume_step = resume_step
        self.through: dict[str, int] = {}

    def fresh(self, values: Mapping[str, float], step: int) -> dict[str, float]:
        """The entries of ``values`` not yet logged at or after ``step``; marks them logged."""
        fresh = {tag: value for tag, value in values.items() if step > self.through.get(tag, self.resume_step)}
        self.through.update(dict.fromkeys(fresh, step))
        return fresh

    @abstractmethod
    def scalars(self, values: dict[str, float], step: int) -> None:
        """Log ``values`` at ``step``."""

    @abstractmethod
    def figure(self, path: Path, step: int) -> None:
        """Log the PNG at ``path`` as the figure of ``step``."""

    def artifacts(self, paths: list[Path]) -> None:
        """Keep the files and folders ``paths`` (a dashboard that keeps no files ignores them)."""
        return None

    @abstractmethod
    def close(self, status: str) -> None:
        """Flush and close; ``status``: how the invocation ended (:func:`end_status`)."""


class _TensorBoard(_Dashboard):
    """Event files in ``folder``; a resumed run's writer purges events after the resume step."""

    name = "tensorboard"

    def __init__(self, folder: Path, resume_step: int) -> None:
        super().__init__(resume_step)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder), purge_step=resume_step + 1 if resume_step else None)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a killed run keeps what it logged

    def figure(self, path: Path, step: int) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
        self.writer.add_image(f"figures/{path.stem}", pixels, step, dataformats="HWC")
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


class _MLflow(_Dashboard):
    """An MLflow run: created once per run folder (its id in :data:`MLFLOW_RUN_FILE`), continued on resume."""

    name = "mlflow"

    def __init__(self, run_dir: Path, run: RunConfig, resume_step: int, config: Mapping[str, Any]) -> None:
        super().__init__(resume_step)
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = run.mlflow_tracking_uri or local_store(run_dir)
        self.client = MlflowClient(tracking_uri=uri)
        record = run_dir / MLFLOW_RUN_FILE
        if record.exists():
            saved = json.loads(record.read_text())
            self.run_id = saved["run_id"]
            try:
                existing = self.client.get_run(self.run_id)
            except MlflowException:
                raise GeoFMError(
                    f"{record.resolve()} names MLflow run {self.run_id} of {saved['tracking_uri']}, which the "
                    f"tracking store {uri} does not hold: restore run.mlflow_tracking_uri, or delete the file to "
                    "log the rest of this run to a new MLflow run"
                ) from None
            self.client.update_run(self.run_id, status="RUNNING")
            for key in existing.data.metrics:
                history = self.client.get_metric_history(self.run_id, key)
                self.through[key] = max(m.step for m in history)
            logged = existing.data.params
        else:
            self.run_id = self._create(run_dir, run, uri)
            record.write_text(
                json.dumps({"run_id": self.run_id, "tracking_uri": uri, "experiment": run.mlflow_experiment}) + "\n"
            )
            logged = {}
        self._log_params({k: v for k, v in _params(config).items() if k not in logged})
        if (run_dir / RUN_FILE).is_file():
            self.client.log_artifact(self.run_id, str(run_dir / RUN_FILE))
        log.info("MLflow run %s in %s", self.run_id, uri)

    def _create(self, run_dir: Path, run: RunConfig, uri: str) -> str:
        """A new run in the configured experiment (created where missing; in the local store with its
        artifacts in the run folder), named after the run folder."""
        client = self.client
        experiment = client.get_experiment_by_name(run.mlflow_experiment)
        if experiment is None:
            location = None if run.mlflow_tracking_uri else (run_dir / MLFLOW_ARTIFACTS).resolve().as_uri()
            experiment_id = client.create_experiment(run.mlflow_experiment, artifact_location=location)
        else:
            experiment_id = experiment.experiment_id
        name = f"{run_dir.parent.name}/{run_dir.name}" if (run_dir.parent / RUN_FILE).is_file() else run_dir.name
        created = client.create_run(experiment_id, run_name=name, tags={"geofm.run_dir": str(run_dir.resolve())})
        return created.info.run_id

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH

        items = [Param(key, value) for key, value in params.items()]
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[start : start + MAX_PARAMS_TAGS_PER_BATCH])

    def scalars(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        metrics = [Metric(_name(tag), value, now, step) for tag, value in values.items()]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])

    def figure(self, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path), "figures")

    def artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), path.name)
            else:
                self.client.log_artifact(self.run_id, str(path))

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


def _name(tag: str) -> str:
    """A tag as an MLflow key (letters, digits, ``_ - . : /`` and spaces; anything else as ``_``)."""
    return re.sub(r"[^\w\-.:/ ]", "_", tag)


def _params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A config as MLflow parameters: dotted keys; lists and nulls as JSON, cut to MLflow's longest value."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    params: dict[str, str] = {}
    for key, value in config.items():
        name = _name(f"{prefix}{key}")
        if isinstance(value, Mapping) and value:
            params.update(_params(value, f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        params[name] = text if len(text) <= MAX_PARAM_VAL_LENGTH else text[: MAX_PARAM_VAL_LENGTH - 3] + "..."
    return params


__all__ = [
    "LOGGERS",
    "MLFLOW_RUN_FILE",
    "TENSORBOARD_FOLDER",
    "RunLoggers",
    "check_installed",
    "end_status",
    "local_store",
    "logger_names",
    "scalars",
]

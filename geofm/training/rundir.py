"""Run-directory machinery shared by every training program: inputs checked up front, checkpoints with
``last``, progress records, resume rules (the steps themselves run in :mod:`geofm.training.loop`, from the loader
of :mod:`geofm.data.loader`).

A run directory holds ``config.yaml`` (the validated config), ``checkpoints/step_*`` (DeepSpeed
checkpoints, each with a ``progress.json`` that can be read without building anything) and
``checkpoints/last`` pointing at the newest. It is created only once a run has started for real,
and removed again when the run fails before its first checkpoint: a start that fails leaves nothing
behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from geofm.checkpoints.io import LAST_CHECKPOINT, resolve_checkpoint_path
from geofm.config import OptimizerConfig, RunConfig, Section, SourceConfig, config_to_dict
from geofm.config.base import CONFIG_FILE
from geofm.config.saved import read_saved_config
from geofm.data.products import list_products
from geofm.errors import ConfigError, GeoFMError
from geofm.paths import check_writable
from geofm.runlog import Phases
from geofm.training import engine as ds
from geofm.training.engine_config import zero_stage

PROGRESS_FILE = "progress.json"
# The ``train`` settings that define a run's learning-rate schedule and its length (see check_resume).
TRAIN_SCHEDULE_KEYS = (
    "train.epochs",
    "train.warmup_epochs",
    "train.warmup_start_ratio",
    "train.min_lr_ratio",
    "train.base_lr",
    "train.lr_reference_batch",
)


@dataclass(frozen=True)
class InputPath:
    """A path a config names: a source's folder of images or products (``source``) or a checkpoint."""

    field: str
    path: Path
    source: SourceConfig | None = None

    @classmethod
    def of_source(cls, field: str, source: SourceConfig) -> InputPath:
        """The folder of an imagery source, which must hold its files or products."""
        return cls(field, source.root, source)

    def problem(self) -> str | None:
        """What is wrong with the path (absolute, as resolved from the working directory), or None."""
        try:
            if self.source is not None:
                list_products(self.source)
            else:
                resolve_checkpoint_path(self.path)
        except GeoFMError as err:
            return f"{self.field}: {err}"
        return None


def check_inputs(paths: Iterable[InputPath], source: str = "the config") -> None:
    """Check every input path of a config before anything is built, and report all problems at once.

    Raises:
        ConfigError: listing each missing folder, empty folder, unfinished chip store or missing checkpoint
            with its absolute path.
    """
    problems = [p for p in (item.problem() for item in paths) if p is not None]
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ConfigError(
            f"{source}: {len(problems)} input(s) cannot be read (relative paths are resolved against the working "
            f"directory {Path.cwd()}):\n{listed}"
        )


@dataclass(frozen=True)
class Progress:
    """Where a run stands, written next to every checkpoint.

    Attributes:
        step: optimizer steps done.
        total_steps: steps of the whole schedule.
        global_batch: images per optimizer step.
        world_size: processes that trained.
        zero_stage: the ZeRO stage those processes used (0 on one process).
        skipped_files: ``[source, file]`` indices of unreadable files skipped so far.
        skipped_invalid: ``[source, chip]`` indices of samples skipped so far because their quality
            band marks too many pixels invalid.
    """

    step: int
    total_steps: int
    global_batch: int
    world_size: int
    zero_stage: int
    skipped_files: list[list[int]] = field(default_factory=list)
    skipped_invalid: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(cls, step: int, total_steps: int, train: OptimizerConfig, world_size: int, **extra) -> Progress:
        """The record of ``step`` for processes training with the ``train`` settings."""
        return cls(
            step=step,
            total_steps=total_steps,
            global_batch=ds.global_batch(train, world_size),
            world_size=world_size,
            zero_stage=zero_stage(train, world_size),
            **extra,
        )

    @property
    def finished(self) -> bool:
        return self.step >= self.total_steps


class RunCheckpoints:
    """Periodic checkpoints under ``run_dir/checkpoints`` (``step_*``, or ``round_*`` for a federated
    server), ``last`` pointing at the newest."""

    def __init__(self, run_dir: Path, keep: int, rank: int, unit: str = "step") -> None:
        self.run_dir, self.directory, self.keep, self.rank = run_dir, run_dir / "checkpoints", keep, rank
        self.unit = unit
        self.created = False  # whether start() created the run directory

    def tag(self, count: int) -> str:
        """The folder name of the checkpoint after ``count`` steps (rounds)."""
        return f"{self.unit}_{count:07d}"

    def latest(self) -> Path | None:
        last = self.directory / LAST_CHECKPOINT
        return last if last.exists() else None

    def progress(self) -> Progress | None:
        """The progress recorded with the newest checkpoint (None without one)."""
        last = self.latest()
        if last is None:
            return None
        path = last / PROGRESS_FILE
        try:
            return Progress(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(
                f"{path.resolve()}: unreadable progress record of the last checkpoint ({err}); "
                "restore it or choose a new run.output_dir"
            ) from None

    def saved_config(self) -> dict | None:
        path = self.run_dir / CONFIG_FILE
        return read_saved_config(path) if path.exists() else None

    def start(self, cfg: Section) -> None:
        """Create the run directory and write ``config.yaml`` (rank 0), once the run is about to train."""
        if self.rank == 0:
            self.created = not self.run_dir.exists()
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.run_dir / CONFIG_FILE).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))

    @contextlib.contextmanager
    def removed_on_failure(self) -> Iterator[None]:
        """Around a run's training: if it fails before a checkpoint is written, the run directory
        :meth:`start` created is removed again, so that a start that fails leaves nothing behind."""
        try:
            yield
        except BaseException:
            if self.created and self.latest() is None:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise

    def save(self, engine, progress: Progress, client_state: dict) -> None:
        """Save a checkpoint of ``engine`` (all ranks call this) with its progress record; prune old ones."""
        tag = self.tag(progress.step)
        ds.save_checkpoint(engine, self.directory, tag, client_state)
        ds.barrier()
        if self.rank == 0:
            self.commit(tag, progress)
        ds.barrier()

    def commit(self, tag: str, progress: Progress) -> None:
        """Make the written checkpoint ``tag`` the newest: its progress record, ``last``, old ones pruned."""
        (self.directory / tag / PROGRESS_FILE).write_text(json.dumps(asdict(progress)) + "\n")
        link = self.directory / f".{LAST_CHECKPOINT}.tmp"
        link.unlink(missing_ok=True)
        link.symlink_to(tag)
        os.replace(link, self.directory / LAST_CHECKPOINT)
        for old in sorted(self.directory.glob(f"{self.unit}_*"))[: -self.keep]:
            shutil.rmtree(old)


def _lookup(tree: Mapping | None, dotted: str) -> Any:
    for key in dotted.split("."):
        tree = (tree or {}).get(key)
    return tree


def check_resume(
    run_dir: Path,
    saved: dict,
    current: dict,
    progress: Progress,
    *,
    invariants: Iterable[str],
    schedule_keys: Iterable[str],
    global_batch: int,
    world_size: int,
    zero_stage: int,
    extend: bool,
) -> None:
    """Refuse a resume that would silently change the run; allow an explicit extension.

    Args:
        run_dir: the run directory, for messages.
        saved: the run's saved config (``config.yaml``); ``current``: the config now.
        progress: the progress recorded with the last checkpoint.
        invariants: dotted keys that define the model and data (never changeable).
        schedule_keys: dotted keys that define the learning-rate schedule and its length; only the
            run length (``train.epochs``) may change, only with ``extend`` and only for a finished run.
        global_batch, world_size, zero_stage: what this invocation would use.
        extend: the user asked to train a finished run for longer.

    Raises:
        ConfigError: saying what changed and how to proceed.
    """
    where = f"{run_dir} holds checkpoints of a run"
    for dotted in invariants:
        a, b = _lookup(saved, dotted), _lookup(current, dotted)
        if a != b:
            raise ConfigError(
                f"{where} with another {dotted} ({a!r}, now {b!r}); resume with the same settings or choose a new run.output_dir"
            )
    changed = [
        (k, _lookup(saved, k), _lookup(current, k)) for k in schedule_keys if _lookup(saved, k) != _lookup(current, k)
    ]
    lengthened = [c for c in changed if c[0] == "train.epochs" and c[2] > c[1]]
    if extend:
        if not progress.finished:
            raise ConfigError(
                f"--extend trains a finished run for longer; {run_dir} is at step {progress.step} of {progress.total_steps}: rerun without --extend to finish it"
            )
        if not lengthened or len(changed) != 1:
            raise ConfigError(
                f"--extend needs a larger train.epochs and no other schedule change; changed: {_describe(changed) or 'nothing'}"
            )
    elif changed:
        hint = (
            "to train this finished run for longer, rerun with --extend"
            if progress.finished and lengthened and len(changed) == 1
            else "restore the setting to resume, or choose a new run.output_dir"
        )
        raise ConfigError(
            f"{where} with another learning-rate schedule ({_describe(changed)}): the schedule would jump; {hint}"
        )
    if global_batch != progress.global_batch:
        raise ConfigError(
            f"{where} with {progress.global_batch} images per optimizer step ({progress.world_size} process(es)); now "
            f"{global_batch} ({world_size} process(es) x train.micro_batch_size x train.grad_accum_steps). "
            f"Keep {progress.global_batch} images per step to continue the same schedule, e.g. "
            f"{_batch_hint(progress.global_batch, world_size)}, or choose a new run.output_dir"
        )
    if (progress.zero_stage or zero_stage) and (progress.zero_stage, progress.world_size) != (zero_stage, world_size):
        raise ConfigError(
            f"{where} whose optimizer state is sharded for {progress.world_size} process(es) at ZeRO stage "
            f"{progress.zero_stage}; this start would use {world_size} process(es) at stage {zero_stage}. Resume with "
            f"{progress.world_size} process(es) and train.zero_stage={progress.zero_stage}, or choose a new run.output_dir"
        )


@dataclass(frozen=True)
class RunStart:
    """A training run about to build its model: who this process is, and where the run stands.

    Attributes:
        rank, world_size: this process's rank and the number of processes.
        device: this process's device.
        checkpoints: the run's checkpoints (the run directory is created by ``checkpoints.start``).
        progress: the progress of the last checkpoint, or None for a new run.
    """

    rank: int
    world_size: int
    device: torch.device
    checkpoints: RunCheckpoints
    progress: Progress | None


def start_run(
    cfg: Section,
    train: OptimizerConfig,
    run: RunConfig,
    inputs: Iterable[InputPath],
    *,
    invariants: Iterable[str],
    schedule_keys: Iterable[str],
    source: str,
    extend: bool = False,
    phases: Phases | None = None,
) -> RunStart:
    """What every program on the DeepSpeed engine does before building anything.

    Check every input path (all problems at once) and that ``run.output_dir`` can be written, join
    the process group, and, when the run directory holds checkpoints, check that this start would
    continue the same run (:func:`check_resume`). ``phases`` times the path checks and the process group.

    Raises:
        ConfigError: a missing input, or a resume that would change the run.
        OutputPathError: ``run.output_dir`` cannot be written.
    """
    phases = phases or Phases()
    check_inputs(inputs, source)
    check_writable(run.output_dir, "run.output_dir", folder=True)
    phases.lap("inputs")
    rank, world = ds.init_distributed()
    phases.lap("distributed")
    checkpoints = RunCheckpoints(run.output_dir, run.keep_checkpoints, rank)
    progress = checkpoints.progress()
    if progress is not None:
        check_resume(
            run.output_dir,
            checkpoints.saved_config(),
            config_to_dict(cfg),
            progress,
            invariants=invariants,
            schedule_keys=schedule_keys,
            global_batch=ds.global_batch(train, world),
            world_size=world,
            zero_stage=zero_stage(train, world),
            extend=extend,
        )
    return RunStart(rank, world, ds.device(), checkpoints, progress)


def _describe(changed: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in changed)


def _batch_hint(images: int, world_size: int) -> str:
    if images % world_size:
        return f"a process count that divides {images}"
    per_process = images // world_size
    return f"train.micro_batch_size={per_process} train.grad_accum_steps=1 with {world_size} process(es)"

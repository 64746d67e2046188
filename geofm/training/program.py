"""A central training program as a short template: start, build, resume, loop, finish.

:meth:`TrainingProgram.run` does, in order:

1. **start**: check the inputs and the output folder, join the process group, and check that a run
   directory with checkpoints would be continued by the same run (:func:`geofm.training.rundir.start_run`);
2. **build**: the program's model, data and engine (:meth:`~TrainingProgram.build`, the program's own),
   then the run directory and its ``config.yaml``;
3. **resume**: the engine's state from ``checkpoints/last`` when the run has one
   (:meth:`~TrainingProgram.resumed` reads the program's own entries);
4. **loop**: :meth:`geofm.training.loop.TrainLoop.run` over the program's data, epoch after epoch, with its
   checkpoints (:meth:`~TrainingProgram.save`), log records and figures (``metrics.jsonl`` and the
   dashboards of ``run.loggers``: :class:`geofm.loggers.RunLoggers`, closed when the invocation ends);
5. **finish**: once the schedule is done, :meth:`~TrainingProgram.finish` (export, evaluate).

A program subclasses :class:`TrainingProgram`, declares what a resume must keep, and fills in the hooks.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from geofm.checkpoints.io import LAST_CHECKPOINT
from geofm.config import config_to_dict
from geofm.data.loader import run_loader
from geofm.loggers import RunLoggers, check_installed, end_status
from geofm.runlog import METRICS_LOG, Phases
from geofm.training import engine as ds
from geofm.training.loop import Forward, TrainLoop, epoch_steps, step_seed
from geofm.training.rundir import InputPath, Progress, start_run

log = logging.getLogger("geofm.training")


class TrainingProgram(ABC):
    """A program on the DeepSpeed engine (see the module's docstring for its steps).

    A program writes :meth:`inputs`, :meth:`build` (which sets ``engine``, ``schedule``, ``dataset`` and
    ``sampler``: the training data and its epoch sampler, with ``set_epoch`` and ``set_start``),
    :meth:`forward`, :meth:`resumed`, :meth:`saved` and :meth:`finish`; the other hooks have defaults.

    Args:
        cfg: the program's validated config (``train``, ``run`` and ``data.num_workers`` are read here).
        source: the config's file name, for errors.
        extend: train a finished run for the larger ``train.epochs`` of ``cfg``.

    Attributes:
        invariants: the config keys a resumed run must share with the run that wrote its checkpoints.
        schedule_keys: the keys that fix the learning-rate schedule and its length.
        loss_keys: the losses averaged into each log record.
        seed_numpy: seed numpy's global RNG at each step too (a program drawing from it).
        log: the program's logger.
    """

    invariants: ClassVar[tuple[str, ...]]
    schedule_keys: ClassVar[tuple[str, ...]]
    loss_keys: ClassVar[tuple[str, ...]] = ("loss",)
    seed_numpy: ClassVar[bool] = False
    log: ClassVar[logging.Logger] = log

    def __init__(self, cfg, *, source: str = "the config", extend: bool = False) -> None:
        self.cfg, self.source, self.extend = cfg, source, extend
        self.run_dir: Path = cfg.run.output_dir
        self.startup = Phases()
        self.step = 0
        self.metrics: RunLoggers | None = None

    def run(self) -> Path:
        """Start, build, resume, train and, once the schedule is done, finish; return the run directory."""
        self.start()
        self.build()
        self.checkpoints.start(self.cfg)
        self.startup.lap("engine")
        self.resume()
        try:
            self.loop()
            if self.step >= self.schedule.total_steps:
                self.finish()
        except BaseException as err:
            self.close_log(err)
            raise
        self.close_log(None)
        return self.run_dir

    # ---- the template -------------------------------------------------------------------
    def start(self) -> None:
        """Check the inputs, join the process group, check a resume (:func:`geofm.training.rundir.start_run`)."""
        cfg = self.cfg
        check_installed(cfg.run.loggers)
        self.started = start_run(
            cfg,
            cfg.train,
            cfg.run,
            self.inputs(),
            invariants=self.invariants,
            schedule_keys=self.schedule_keys,
            source=self.source,
            extend=self.extend,
            phases=self.startup,
        )
        self.rank, self.world = self.started.rank, self.started.world_size
        self.device, self.checkpoints = self.started.device, self.started.checkpoints

    def resume(self) -> None:
        """The engine's state and the step of ``checkpoints/last``, when the run has checkpoints."""
        progress = self.started.progress
        if progress is None:
            return
        client_state = ds.load_checkpoint(self.engine, self.checkpoints.directory, LAST_CHECKPOINT)
        self.step = progress.step
        self.resumed(progress, client_state)
        self.startup.lap("resume")
        if self.rank == 0:
            self.log.info("resumed from %s at step %d", self.checkpoints.latest().resolve(), self.step)

    def loop(self) -> None:
        """Train from ``self.step`` until the schedule's end or a stop asked for."""
        cfg = self.cfg
        if self.rank == 0:
            self.metrics = RunLoggers(
                self.run_dir / METRICS_LOG, cfg.run, resume_step=self.step, config=config_to_dict(cfg)
            )
        micro, accum = cfg.train.micro_batch_size, cfg.train.grad_accum_steps
        loader = run_loader(self.dataset, self.sampler, micro, cfg.data.num_workers, self.device)

        def epoch_batches(epoch: int, done: int) -> Iterator[dict]:
            self.sampler.set_epoch(epoch)
            self.sampler.set_start(done * micro * accum)
            return self.batches(iter(loader))

        loop = TrainLoop(
            self.engine,
            self.forward(),
            self.loss_keys,
            seed_of=lambda step: step_seed(cfg.run.seed, step, self.rank),
            seed_numpy=self.seed_numpy,
            on_step=self.on_step,
            images=micro * self.world,
        )
        self.step = loop.run(
            epoch_steps(self.step, self.schedule.steps_per_epoch, accum, epoch_batches),
            self.started,
            step=self.step,
            schedule=self.schedule,
            config=cfg.run,
            save=self.save,
            metrics=self.metrics,
            record=self.log_entries,
            after_step=self.after_step,
            startup=self.startup,
            logger=self.log,
        )

    def close_log(self, error: BaseException | None) -> None:
        """Close the run's loggers (rank 0), saying whether the invocation reached the schedule's end,
        stopped before it or failed (``error``)."""
        if self.metrics is not None:
            self.metrics.close(end_status(error, self.step >= self.schedule.total_steps))

    def save(self, step: int) -> None:
        """The checkpoint of ``step`` (every process together), then the program's figures (rank 0)."""
        progress = Progress.of(step, self.schedule.total_steps, self.cfg.train, self.world, **self.progress_entries())
        self.checkpoints.save(self.engine, progress, {"step": step, **self.client_state()})
        if self.rank == 0:
            self.saved(step)

    # ---- hooks --------------------------------------------------------------------------
    @abstractmethod
    def inputs(self) -> list[InputPath]:
        """Every path the config reads, checked before anything is built."""

    @abstractmethod
    def build(self) -> None:
        """The model, the data (``dataset``, ``sampler``, ``schedule``) and the ``engine``."""

    @abstractmethod
    def forward(self) -> Forward:
        """The forward pass of a micro-batch through ``self.engine``."""

    @abstractmethod
    def finish(self) -> None:
        """What follows the last step of the schedule (export, evaluation)."""

    @abstractmethod
    def resumed(self, progress: Progress, client_state: dict) -> None:
        """Read the program's own entries of a resumed checkpoint (its progress and client state)."""

    @abstractmethod
    def saved(self, step: int) -> None:
        """After a checkpoint, on rank 0: the program's curves and figures."""

    def batches(self, batches: Iterator[dict]) -> Iterator[dict]:
        """The micro-batches of an epoch as the loop trains them (default: as the loader gives them)."""
        return batches

    def log_entries(self) -> dict[str, Any]:
        """More entries for each log record (every process calls it together)."""
        return {}

    def on_step(self, index: int) -> None:
        """Work right after the optimizer step of step ``index`` (0-based), before its log record (an EMA teacher)."""
        return None

    def after_step(self, step: int) -> bool:
        """Work after a step's log record (validation); True when it took time the throughput should not count."""
        return False

    def progress_entries(self) -> dict[str, Any]:
        """More fields of a checkpoint's :class:`~geofm.training.rundir.Progress` (every process calls it together)."""
        return {}

    def client_state(self) -> dict[str, Any]:
        """More entries of a checkpoint's client state, beside its step."""
        return {}


__all__ = ["TrainingProgram"]

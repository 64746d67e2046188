"""Central pretraining of any registered objective (``task``: masked image modelling by default, DINO...).

One program for one CPU, one GPU or a cluster: launch it plainly, or with ``deepspeed`` /
``torchrun`` for several processes. It is the program template (:class:`geofm.training.program.TrainingProgram`)
around the config's pretraining task (:class:`geofm.tasks.PretrainingTask`, implemented in
:mod:`geofm.tasks`): the task builds the model and the samples, computes a micro-batch's losses,
follows each optimizer step (an EMA teacher), keeps its own state in checkpoints, draws its figures
and exports the backbone. A run directory holds ``config.yaml``, ``metrics.jsonl``,
``loss_curve.png`` (and the objective's figures, e.g. ``reconstruction.png``), redrawn at each
checkpoint, ``checkpoints/step_*`` with ``checkpoints/last`` pointing at the newest, and, once
training ends, ``backbone.safetensors`` with its ``backbone.json`` sidecar. Running the same config
again resumes from ``checkpoints/last`` at the step it reached, with the same data order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from geofm.config import PretrainConfig
from geofm.data.loader import leave_cores_to_workers
from geofm.data.pile import PileSampler, SkippedFiles
from geofm.runlog import final_metrics, plot_loss_curve
from geofm.tasks import TASKS, PretrainingTask
from geofm.tasks.mim.figures import RECONSTRUCTION_FIGURE
from geofm.training import engine as ds
from geofm.training.loop import Forward
from geofm.training.program import TrainingProgram
from geofm.training.rundir import TRAIN_SCHEDULE_KEYS, InputPath, Progress

log = logging.getLogger("geofm.pretrain")

# What defines the learning-rate schedule and its length: fixed for a run, except --extend's epochs.
SCHEDULE_KEYS = (*TRAIN_SCHEDULE_KEYS, "data.samples_per_epoch")
TASK_STATE = "task"
"""The checkpoint's client-state entry holding the task's own state (an EMA teacher and its centre)."""


class Pretraining(TrainingProgram):
    """Central pretraining through the program template, the objective being the config's task."""

    schedule_keys = SCHEDULE_KEYS
    log = log

    def __init__(self, cfg: PretrainConfig, *, source: str = "the config", extend: bool = False) -> None:
        super().__init__(cfg, source=source, extend=extend)
        self.task: PretrainingTask = TASKS.get(cfg.task)(cfg)
        self.invariants = self.task.resume_invariants
        self.loss_keys = self.task.log_keys

    def inputs(self) -> list[InputPath]:
        """Every path the config reads: source folders, the task's files (a teacher), initial weights."""
        cfg = self.cfg
        paths = [InputPath.of_source(f"data.sources.{i}.root ({s.name})", s) for i, s in enumerate(cfg.data.sources)]
        paths += self.task.inputs()
        if cfg.model.init_checkpoint is not None:
            paths.append(InputPath("model.init_checkpoint", cfg.model.init_checkpoint))
        return paths

    def build(self) -> None:
        """The task's model, its pile of the configured sources with the sampler and schedule, and the engine."""
        cfg, task = self.cfg, self.task
        if self.device.type == "cpu":
            leave_cores_to_workers(cfg.data.num_workers)
        torch.manual_seed(cfg.run.seed)
        self.model = task.build_model()
        self.startup.lap("model")
        self.dataset = pile = task.pile()
        self.schedule = ds.make_schedule(cfg.train, pile.samples_per_epoch, self.world, pile.describe())
        self.sampler = PileSampler(
            pile.source_sizes,
            pile.weights,
            pile.samples_per_epoch,
            seed=cfg.run.seed,
            rank=self.rank,
            world_size=self.world,
        )
        self.skipped = SkippedFiles(pile.source_sizes)
        self.startup.lap("data_index")
        task.prepare(self.model)
        self.startup.lap("prepare")  # the objective's own networks: GFM's frozen teacher, DINO's EMA copy
        self.engine = ds.initialize(
            self.model, cfg.train, self.world, self.schedule, param_groups=task.param_groups(self.model)
        )

    def forward(self) -> Forward:
        return lambda batch: self.task.forward(self.engine, batch)

    def on_step(self, index: int) -> None:
        """The task's work after the optimizer step of step ``index`` (0-based)."""
        self.task.after_step(self.engine.module, (index + 1) / self.schedule.total_steps)

    def client_state(self) -> dict:
        state = self.task.state_dict()
        return {TASK_STATE: state} if state else {}

    def resumed(self, progress: Progress, client_state: dict) -> None:
        self.skipped.update(progress.skipped_files, progress.skipped_invalid)
        if TASK_STATE in client_state:
            self.task.load_state_dict(client_state[TASK_STATE])

    def batches(self, batches: Iterator[dict]) -> Iterator[dict]:
        """The epoch's batches, the files skipped in each recorded as it is read."""
        for batch in batches:
            self.skipped.add_batch(batch)
            yield batch

    def skipped_everywhere(self) -> tuple[list[list[int]], list[list[int]]]:
        """Unreadable files and mostly invalid chips skipped by any process (a collective call when distributed)."""
        gathered = ds.gather_objects((self.skipped.files, self.skipped.invalid))
        files, invalid = set().union(*(g[0] for g in gathered)), set().union(*(g[1] for g in gathered))
        return [list(pair) for pair in sorted(files)], [list(pair) for pair in sorted(invalid)]

    def log_entries(self) -> dict[str, int]:
        files, invalid = self.skipped_everywhere()
        return {"skipped_files": len(files), "skipped_invalid_chips": len(invalid)}

    def progress_entries(self) -> dict:
        files, invalid = self.skipped_everywhere()
        return {"skipped_files": files, "skipped_invalid": invalid}

    def saved(self, step: int) -> None:
        plot_loss_curve(self.metrics.read(), self.run_dir / "loss_curve.png", self.run_dir.name)
        self.task.figures(self.engine.module, self.dataset, self.run_dir)
        self.metrics.figure(self.run_dir / RECONSTRUCTION_FIGURE, step)

    def finish(self) -> None:
        """The task's export of the trained backbone (rank 0)."""
        if self.rank == 0:
            final = final_metrics(self.metrics.read())
            self.task.export(self.engine.module, self.run_dir, self.step, final, {})
            self.metrics.artifacts(self.task.products(self.run_dir))


def pretrain(cfg: PretrainConfig, *, extend: bool = False, source: str = "the config") -> Path:
    """Run (or resume) pretraining as configured; return the run directory.

    Args:
        cfg: the validated config.
        extend: train a finished run for the larger ``train.epochs`` of ``cfg`` (the schedule is
            re-planned over the new length, without a second warm-up).
        source: the config's file name, for errors.

    Raises:
        ConfigError: a missing input (all of them listed at once), or a resume that would change the run.
    """
    return Pretraining(cfg, source=source, extend=extend).run()

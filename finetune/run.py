"""The finetuning program (``geofm finetune``): a pretrained backbone and a task head trained on the DeepSpeed engine.

One program for every task family and for linear probing (``model.frozen``), on one CPU, one GPU or
several processes under ``deepspeed``/``torchrun``. The backbone starts from ``checkpoint`` (any
layout :mod:`geofm.checkpoints` reads, bands matched by name; a task band the checkpoint lacks starts
fresh and is reported) or at random. AdamW with layer-wise lr decay over timm's layer groups, warmup
then cosine (DeepSpeed's WarmupCosineLR scales every group's own lr), gradient clipping.

A run directory holds, as in pretraining, ``config.yaml``, ``metrics.jsonl`` (the training loss per
logged step; ``{"step", "epoch", "val": {...}}`` per validation), ``loss_curve.png`` and
``val_curve.png``, ``checkpoints/step_*`` with ``checkpoints/last``; then ``best/model.safetensors``
and ``best/best.json`` (the weights with the best validation metric, or the final ones without a
validation split) and, at the end, ``eval.json``: the test metrics of those weights. Running the
same config again resumes from ``checkpoints/last``; a finished run only re-evaluates. Each
checkpoint holds the kept weights of its time (hard links under ``checkpoints/step_*/best``), so a
resume undoes a selection made after its checkpoint, whose steps it replays.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from finetune.best import BEST_DIR, load_best_weights, read_best, restore_best, save_best, snapshot_best
from finetune.evaluate import eval_loader, eval_record, evaluate, format_metrics, write_json
from finetune.splits import build_split, describe_split
from geofm.checkpoints import LoadReport
from geofm.config.finetune import FinetuneConfig
from geofm.data.finetune.sampler import EpochSampler
from geofm.loggers import scalars
from geofm.runlog import plot_loss_curve, plot_metric_curve
from geofm.tasks.finetuning import task_of
from geofm.tasks.finetuning.model import build_finetune_model
from geofm.training import engine as ds
from geofm.training.loop import Forward
from geofm.training.program import TrainingProgram
from geofm.training.rundir import TRAIN_SCHEDULE_KEYS, InputPath, Progress

log = logging.getLogger("geofm.finetune")

EVAL_FILE = "eval.json"
# What a resumed run must share with the run that wrote its checkpoints.
RESUME_INVARIANTS = (
    "task",
    "checkpoint",
    "model",
    "head",
    "finetune",
    "data.root",
    "data.torchgeo",
    "data.bands",
    "data.custom_bands",
    "data.dataset_bands",
    "data.hr",
    "data.num_classes",
    "data.train_fraction",
    "data.split",
    "data.chip_size",
    "data.crops_per_scene",
    "run.seed",
)


def finetune_inputs(cfg: FinetuneConfig) -> list[InputPath]:
    """The checkpoint a finetuning config reads (its data is checked when the datasets are built)."""
    return [InputPath("checkpoint", cfg.checkpoint)] if cfg.checkpoint is not None else []


def checkpoint_provenance(cfg: FinetuneConfig, report: LoadReport | None) -> dict | None:
    """What the backbone started from, for ``eval.json`` (None: random initialisation)."""
    if report is None:
        return None
    return {
        "path": str(cfg.checkpoint),
        "layout": report.layout,
        "tensors_loaded": len(report.used),
        "adapted": report.adapted,
        "fresh_bands": report.fresh_bands,
    }


class Finetuning(TrainingProgram):
    """Finetuning through the program template: the task's splits and model, validation after epochs
    with the best weights kept, and the test evaluation of the kept weights at the end."""

    invariants = RESUME_INVARIANTS
    schedule_keys = TRAIN_SCHEDULE_KEYS
    seed_numpy = True  # timm's Mixup draws from numpy
    log = log

    def inputs(self) -> list[InputPath]:
        return finetune_inputs(self.cfg)

    def build(self) -> None:
        """The splits, the epoch sampler and schedule, the model (backbone from the checkpoint) and its engine."""
        cfg, opt = self.cfg, self.cfg.finetune
        self.dataset = build_split(cfg, "train", train=True)
        self.val_set = build_split(cfg, opt.val_split, train=False) if opt.val_split else None
        self.test_set = build_split(cfg, "test", train=False)
        crops = cfg.data.crops_per_scene
        self.schedule = ds.make_schedule(cfg.train, len(self.dataset) * crops, self.world, describe_split(cfg, "train"))
        self.sampler = EpochSampler(len(self.dataset), crops, cfg.run.seed, self.rank, self.world)

        torch.manual_seed(cfg.run.seed)
        model, self.report = build_finetune_model(cfg)
        if self.rank == 0:
            self._log_backbone()
        groups = model.param_groups(cfg.train.weight_decay, opt.layer_decay)
        self.engine = ds.initialize(model, cfg.train, self.world, self.schedule, param_groups=groups)
        self.dtype = ds.compute_dtype(cfg.train)
        self.task = task_of(cfg)
        self.metric = cfg.primary_metric
        self.val_loader = (
            None
            if self.val_set is None
            else eval_loader(self.val_set, cfg, self.device, self.rank, self.world, keep=True)
        )
        self.seconds_before = 0.0

    def _log_backbone(self) -> None:
        report = self.report
        log.info("backbone: %s", report if report is not None else "random initialisation (no checkpoint)")
        if report is not None and report.fresh_bands:
            log.warning(
                "bands %s are not in the checkpoint %s: their patch-embedding kernels start fresh",
                report.fresh_bands,
                self.cfg.checkpoint,
            )

    def resume(self) -> None:
        """As every program, then the best weights as of the checkpoint resumed from (a selection made
        after it is undone: its steps are replayed)."""
        super().resume()
        self.best = read_best(self.run_dir)
        if self.best is not None and self.best["step"] > self.step:
            if self.rank == 0:
                restore_best(self.run_dir, self.checkpoints.latest().resolve())
            ds.barrier()
            self.best = read_best(self.run_dir)
        self.started_at = time.perf_counter()

    def resumed(self, progress: Progress, client_state: dict) -> None:
        self.seconds_before = float(client_state.get("seconds", 0.0))

    def seconds(self) -> float:
        """Training seconds of the run, over all its invocations."""
        return self.seconds_before + time.perf_counter() - self.started_at

    def forward(self) -> Forward:
        return lambda batch: self.task.forward(self.engine, batch, self.device, self.dtype)

    def client_state(self) -> dict:
        return {"seconds": self.seconds()}

    def saved(self, step: int) -> None:
        snapshot_best(self.run_dir, self.checkpoints.latest().resolve())
        self.plot(self.metrics.read())

    def plot(self, records: list[dict]) -> None:
        """The loss curve and the validation curve, the kept step marked."""
        run_dir, best = self.run_dir, self.best
        plot_loss_curve(records, run_dir / "loss_curve.png", run_dir.name)
        kept = best["step"] if best is not None and best["split"] is not None else None
        title = f"{run_dir.name}: {self.cfg.finetune.val_split}"
        plot_metric_curve(records, "val", [self.metric], run_dir / "val_curve.png", title, kept=kept)

    def after_step(self, step: int) -> bool:
        """At the end of every ``finetune.eval_every``-th epoch and of the run: evaluate, keep the best weights."""
        opt, schedule, metric = self.cfg.finetune, self.schedule, self.metric
        epochs_done, in_epoch = divmod(step, schedule.steps_per_epoch)
        last = step == schedule.total_steps
        if self.val_set is None or in_epoch or not (epochs_done % opt.eval_every == 0 or last):
            return False
        epoch = round(step / schedule.steps_per_epoch, 4)
        module = self.engine.module
        values = evaluate(module, self.val_loader, self.cfg, self.device, self.dtype, self.rank, self.world).metrics
        if self.metrics is not None:
            self.metrics.write({"step": step, "epoch": epoch, "val": values})
            log.info("step %d (epoch %g): %s %s", step, epoch, opt.val_split, format_metrics(values))
        if self.best is None or self.task.improves(metric, values[metric], self.best["value"]):
            self.best = {
                "step": step,
                "epoch": epoch,
                "split": opt.val_split,
                "metric": metric,
                "value": values[metric],
            }
            self.best["metrics"] = values
            if self.rank == 0:
                save_best(module, self.run_dir, self.best)
        return True

    def finish(self) -> None:
        """Keep the final weights when nothing was validated, then evaluate the kept weights on the test split."""
        cfg, run_dir, module, step = self.cfg, self.run_dir, self.engine.module, self.step
        if self.val_set is None and self.rank == 0:
            final = {
                "step": step,
                "epoch": float(cfg.train.epochs),
                "split": None,
                "metric": None,
                "value": None,
                "metrics": {},
            }
            save_best(module, run_dir, final)
        ds.barrier()
        selected = load_best_weights(module, run_dir)
        test = evaluate(module, self.test_set, cfg, self.device, self.dtype, self.rank, self.world)
        if self.rank == 0:
            record = eval_record(
                cfg,
                "test",
                test,
                checkpoint=checkpoint_provenance(cfg, self.report),
                arch=cfg.model.arch,
                bands=list(cfg.data.bands),
                frozen=cfg.model.frozen,
                epochs=cfg.train.epochs,
                steps=step,
                seconds=round(self.seconds(), 1),
                selected=selected,
                run_dir=str(run_dir),
            )
            write_json(record, run_dir / EVAL_FILE)
            self.plot(self.metrics.read())
            self.metrics.scalars(scalars({"test": test.metrics}), step)
            self.metrics.artifacts([run_dir / BEST_DIR, run_dir / EVAL_FILE])
            log.info(
                "test %s (weights of step %d): %s", cfg.dataset_name, selected["step"], format_metrics(test.metrics)
            )


def finetune(cfg: FinetuneConfig, *, source: str = "the config") -> Path:
    """Run (or resume) finetuning as configured and evaluate the kept weights on the test split.

    Args:
        cfg: the validated config.
        source: the config's file name, for errors.

    Returns:
        The run directory.

    Raises:
        ConfigError: a missing checkpoint, a resume that would change the run, a checkpoint without
            any of the task's bands.
        DatasetNotFoundError: missing downstream data (before the run directory is created).
        DatasetTooSmallError: a split without samples, or a train split smaller than one global batch.
    """
    return Finetuning(cfg, source=source).run()

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
from collections.abc import Iterator
from pathlib import Path

import torch

from finetune.best import load_best_weights, read_best, restore_best, save_best, snapshot_best
from finetune.evaluate import eval_loader, eval_record, evaluate, format_metrics, write_json
from finetune.models import build_finetune_model
from finetune.splits import build_split, describe_split
from finetune.tasks import task_of
from geofm import engine as ds
from geofm.checkpoints import LoadReport
from geofm.checkpoints.io import LAST_CHECKPOINT
from geofm.config.finetune import FinetuneConfig
from geofm.data.finetune.sampler import EpochSampler
from geofm.data.loader import run_loader
from geofm.loop import TrainLoop, epoch_steps, step_seed
from geofm.rundir import TRAIN_SCHEDULE_KEYS, InputPath, Progress, start_run
from geofm.runlog import MetricsLog, plot_loss_curve, plot_metric_curve

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
    start = start_run(
        cfg,
        cfg.train,
        cfg.run,
        finetune_inputs(cfg),
        invariants=RESUME_INVARIANTS,
        schedule_keys=TRAIN_SCHEDULE_KEYS,
        source=source,
    )
    rank, world, dev, checkpoints, progress = (
        start.rank,
        start.world_size,
        start.device,
        start.checkpoints,
        start.progress,
    )
    run_dir = cfg.run.output_dir

    opt = cfg.finetune
    train_set = build_split(cfg, "train", train=True)
    val_set = build_split(cfg, opt.val_split, train=False) if opt.val_split else None
    test_set = build_split(cfg, "test", train=False)
    crops = cfg.data.crops_per_scene
    schedule = ds.make_schedule(cfg.train, len(train_set) * crops, world, describe_split(cfg, "train"))
    sampler = EpochSampler(len(train_set), crops, cfg.run.seed, rank, world)

    torch.manual_seed(cfg.run.seed)
    model, report = build_finetune_model(cfg)
    if rank == 0:
        log.info("backbone: %s", report if report is not None else "random initialisation (no checkpoint)")
        if report is not None and report.fresh_bands:
            log.warning(
                "bands %s are not in the checkpoint %s: their patch-embedding kernels start fresh",
                report.fresh_bands,
                cfg.checkpoint,
            )
    groups = model.param_groups(cfg.train.weight_decay, opt.layer_decay)
    engine = ds.initialize(model, cfg.train, world, schedule, param_groups=groups)
    dtype = ds.compute_dtype(cfg.train)
    task = task_of(cfg)
    checkpoints.start(cfg)

    step, seconds_before = 0, 0.0
    if progress is not None:
        client = ds.load_checkpoint(engine, checkpoints.directory, LAST_CHECKPOINT)
        step, seconds_before = progress.step, float(client.get("seconds", 0.0))
        if rank == 0:
            log.info("resumed from %s at step %d", checkpoints.latest().resolve(), step)
    best = read_best(run_dir)
    if best is not None and best["step"] > step:
        # selected after the checkpoint resumed from: back to the selection as of that checkpoint
        if rank == 0:
            restore_best(run_dir, checkpoints.latest().resolve())
        ds.barrier()
        best = read_best(run_dir)

    metrics = MetricsLog(run_dir / "metrics.jsonl", resume_step=step) if rank == 0 else None
    micro, accum = cfg.train.micro_batch_size, cfg.train.grad_accum_steps
    started = time.perf_counter()
    metric = cfg.primary_metric

    def seconds() -> float:
        return seconds_before + time.perf_counter() - started

    def save(step: int) -> None:
        record = Progress.of(step, schedule.total_steps, cfg.train, world)
        checkpoints.save(engine, record, {"step": step, "seconds": seconds()})
        if rank == 0:
            snapshot_best(run_dir, checkpoints.latest().resolve())
            plot(metrics.read())

    def plot(records: list[dict]) -> None:
        plot_loss_curve(records, run_dir / "loss_curve.png", run_dir.name)
        kept = best["step"] if best is not None and best["split"] is not None else None
        title = f"{run_dir.name}: {opt.val_split}"
        plot_metric_curve(records, "val", [metric], run_dir / "val_curve.png", title, kept=kept)

    val_loader = None if val_set is None else eval_loader(val_set, cfg, dev, rank, world, keep=True)

    def validate(step: int) -> bool:
        """At the end of every ``finetune.eval_every``-th epoch and of the run: evaluate, keep the best weights."""
        nonlocal best
        epochs_done, in_epoch = divmod(step, schedule.steps_per_epoch)
        last = step == schedule.total_steps
        if val_set is None or in_epoch or not (epochs_done % opt.eval_every == 0 or last):
            return False
        epoch = round(step / schedule.steps_per_epoch, 4)
        values = evaluate(engine.module, val_loader, cfg, dev, dtype, rank, world).metrics
        if metrics is not None:
            metrics.write({"step": step, "epoch": epoch, "val": values})
            log.info("step %d (epoch %g): %s %s", step, epoch, opt.val_split, format_metrics(values))
        if best is None or task.improves(metric, values[metric], best["value"]):
            best = {"step": step, "epoch": epoch, "split": opt.val_split, "metric": metric, "value": values[metric]}
            best["metrics"] = values
            if rank == 0:
                save_best(engine.module, run_dir, best)
        return True

    loader = run_loader(train_set, sampler, micro, cfg.data.num_workers, dev)

    def epoch_batches(epoch: int, done: int) -> Iterator[dict]:
        sampler.set_epoch(epoch)
        sampler.set_start(done * micro * accum)
        return iter(loader)

    loop = TrainLoop(
        engine,
        lambda batch: task.forward(engine, batch, dev, dtype),
        seed_of=lambda step: step_seed(cfg.run.seed, step, rank),
        seed_numpy=True,  # timm's Mixup draws from numpy
        images=micro * world,
    )
    step = loop.run(
        epoch_steps(step, schedule.steps_per_epoch, accum, epoch_batches),
        start,
        step=step,
        schedule=schedule,
        config=cfg.run,
        save=save,
        metrics=metrics,
        after_step=validate,
    )

    if step < schedule.total_steps:
        return run_dir
    if val_set is None and rank == 0:
        final = {
            "step": step,
            "epoch": float(cfg.train.epochs),
            "split": None,
            "metric": None,
            "value": None,
            "metrics": {},
        }
        save_best(engine.module, run_dir, final)
    ds.barrier()
    selected = load_best_weights(engine.module, run_dir)
    test = evaluate(engine.module, test_set, cfg, dev, dtype, rank, world)
    if rank == 0:
        record = eval_record(
            cfg,
            "test",
            test,
            checkpoint=checkpoint_provenance(cfg, report),
            arch=cfg.model.arch,
            bands=list(cfg.data.bands),
            frozen=cfg.model.frozen,
            epochs=cfg.train.epochs,
            steps=step,
            seconds=round(seconds(), 1),
            selected=selected,
            run_dir=str(run_dir),
        )
        write_json(record, run_dir / EVAL_FILE)
        plot(metrics.read())
        log.info("test %s (weights of step %d): %s", cfg.dataset_name, selected["step"], format_metrics(test.metrics))
    return run_dir

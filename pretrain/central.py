"""Central continual pretraining (SimMIM, plus GFM distillation when a teacher is configured).

One program for one CPU, one GPU or a cluster: launch it plainly, or with ``deepspeed`` /
``torchrun`` for several processes. A run directory holds ``config.yaml``, ``metrics.jsonl``,
``loss_curve.png`` and ``reconstruction.png`` (both redrawn at each checkpoint),
``checkpoints/step_*`` with ``checkpoints/last`` pointing at the newest, and, once training ends,
``backbone.safetensors`` with its ``backbone.json`` sidecar. Running the same config again resumes
from ``checkpoints/last`` at the step it reached, with the same data order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from geofm import engine as ds
from geofm.checkpoints import export_backbone, load_pretraining_model
from geofm.checkpoints.io import LAST_CHECKPOINT
from geofm.checkpoints.provenance import gsd_range
from geofm.checkpoints.teacher import build_teacher
from geofm.config import PretrainConfig, config_to_dict
from geofm.config.federated import FederatedConfig
from geofm.data.loader import leave_cores_to_workers, run_loader
from geofm.data.pile import PileSampler, PretrainPile, SkippedFiles
from geofm.loop import Forward, TrainLoop, epoch_steps, step_seed
from geofm.models.backbones import backbone_kwargs, create_backbone, prefer_fused_attention
from geofm.models.masking import MaskGenerator
from geofm.models.mim import MaskedImageModel, Tap, default_vit_tap
from geofm.models.teacher import FrozenTeacher, teacher_channels, teacher_dtype
from geofm.reconstruction import shown_chips, write_reconstruction_figure
from geofm.rundir import TRAIN_SCHEDULE_KEYS, InputPath, Progress, start_run
from geofm.runlog import LOSS_KEYS, MetricsLog, Phases, final_metrics, plot_loss_curve
from geofm.tasks import StepOutput

log = logging.getLogger("geofm.pretrain")


def student_kwargs(cfg: PretrainConfig | FederatedConfig) -> dict:
    """timm kwargs of the student backbone (recorded in the exported sidecar)."""
    m = cfg.model
    return backbone_kwargs(
        in_chans=len(cfg.data.bands), img_size=m.img_size, window_size=m.window_size, timm_kwargs=m.timm_kwargs
    )


def build_student(cfg: PretrainConfig | FederatedConfig) -> MaskedImageModel:
    """Student backbone with mask token, decoder and, with a teacher, the projector onto the teacher's
    feature width: random, or from ``model.init_checkpoint`` (all of these the file holds: a GFM,
    SimMIM or geofm pretraining checkpoint continues where it stopped)."""
    encoder = create_backbone(cfg.model.arch, student_kwargs(cfg), drop_path_rate=cfg.model.drop_path_rate)
    if cfg.teacher is None:
        model = MaskedImageModel(encoder, len(cfg.data.bands))
    else:
        if cfg.model.family == "swin":
            tap = Tap(cfg.teacher.stage, cfg.teacher.include_merging)
        else:
            tap = Tap(cfg.model.distill_block) if cfg.model.distill_block else default_vit_tap(encoder)
        model = MaskedImageModel(
            encoder,
            len(cfg.data.bands),
            tap,
            teacher_channels(cfg.teacher),
            cfg.teacher.alpha,
            cfg.teacher.distill_loss,
        )
    if cfg.model.init_checkpoint is not None:
        report = load_pretraining_model(model, cfg.model.init_checkpoint, cfg.data.bands)
        log.info("student initialised from %s: %s", cfg.model.init_checkpoint, report)
    return model


# What a resumed run must share with the run that wrote its checkpoints.
RESUME_INVARIANTS = ("model", "masking", "teacher", "data.bands", "data.custom_bands", "run.seed")
# What defines the learning-rate schedule and its length: fixed for a run, except --extend's epochs.
SCHEDULE_KEYS = (*TRAIN_SCHEDULE_KEYS, "data.samples_per_epoch")


def prepare_models(
    model: MaskedImageModel, teacher: FrozenTeacher | None, cfg: PretrainConfig | FederatedConfig, dev: torch.device
) -> None:
    """The device's choices for the step: the attention kernel, and the teacher's device and precision."""
    prefer_fused_attention(model, dev)
    if teacher is not None:
        prefer_fused_attention(teacher, dev)
        teacher.to(dev, teacher_dtype(cfg.teacher.precision, dev))


def pretrain_inputs(cfg: PretrainConfig) -> list[InputPath]:
    """Every path a pretraining config reads: source folders, teacher and initial weights."""
    paths = [InputPath.of_source(f"data.sources.{i}.root ({s.name})", s) for i, s in enumerate(cfg.data.sources)]
    if cfg.teacher is not None:
        paths.append(InputPath("teacher.checkpoint", cfg.teacher.checkpoint))
    if cfg.model.init_checkpoint is not None:
        paths.append(InputPath("model.init_checkpoint", cfg.model.init_checkpoint))
    return paths


def mim_forward(engine, teacher: FrozenTeacher | None, dev: torch.device, dtype: torch.dtype) -> Forward:
    """The masked-image-modelling forward of a micro-batch through ``engine``; with a teacher, its
    features of the same images are the distillation targets. Every pretraining mode trains with it."""

    def forward(batch: dict) -> StepOutput:
        images = batch["image"].to(dev, dtype, non_blocking=True)
        targets = teacher(images) if teacher is not None else None
        mask, valid = batch["mask"].to(dev, non_blocking=True), batch["valid"].to(dev, non_blocking=True)
        return StepOutput(engine(images, mask, valid, targets))

    return forward


def _recording(batches: Iterator[dict], skipped: SkippedFiles) -> Iterator[dict]:
    """``batches``, the files skipped in each recorded as it is read."""
    for batch in batches:
        skipped.add_batch(batch)
        yield batch


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
    startup = Phases()
    start = start_run(
        cfg,
        cfg.train,
        cfg.run,
        pretrain_inputs(cfg),
        invariants=RESUME_INVARIANTS,
        schedule_keys=SCHEDULE_KEYS,
        source=source,
        extend=extend,
        phases=startup,
    )
    rank, world, dev, checkpoints, progress = (
        start.rank,
        start.world_size,
        start.device,
        start.checkpoints,
        start.progress,
    )
    if dev.type == "cpu":
        leave_cores_to_workers(cfg.data.num_workers)
    run_dir = cfg.run.output_dir

    torch.manual_seed(cfg.run.seed)
    teacher = build_teacher(cfg.teacher, cfg.data.teacher_band_indices) if cfg.teacher else None
    startup.lap("teacher")
    model = build_student(cfg)
    startup.lap("student")
    masks = MaskGenerator(cfg.model.img_size, cfg.masking.mask_patch_size, model.patch_size, cfg.masking.mask_ratio)
    pile = PretrainPile(cfg.data, cfg.model.img_size, mask_fn=masks)
    schedule = ds.make_schedule(cfg.train, pile.samples_per_epoch, world, pile.describe())
    sampler = PileSampler(
        pile.source_sizes, pile.weights, pile.samples_per_epoch, seed=cfg.run.seed, rank=rank, world_size=world
    )
    shown = shown_chips(pile, cfg.run.seed) if rank == 0 else None  # the reconstruction figure's chips
    startup.lap("data_index")
    prepare_models(model, teacher, cfg, dev)
    engine = ds.initialize(model, cfg.train, world, schedule)
    dtype = ds.compute_dtype(cfg.train)
    checkpoints.start(cfg)
    startup.lap("engine")

    step, skipped = 0, SkippedFiles(pile.source_sizes)
    if progress is not None:
        ds.load_checkpoint(engine, checkpoints.directory, LAST_CHECKPOINT)
        step = progress.step
        skipped.update(progress.skipped_files, progress.skipped_invalid)
        startup.lap("resume")
        if rank == 0:
            log.info("resumed from %s at step %d", checkpoints.latest().resolve(), step)

    metrics = MetricsLog(run_dir / "metrics.jsonl", resume_step=step) if rank == 0 else None
    micro, accum = cfg.train.micro_batch_size, cfg.train.grad_accum_steps

    def skipped_everywhere() -> tuple[list[list[int]], list[list[int]]]:
        """Unreadable files and mostly invalid chips skipped by any process (a collective call when distributed)."""
        gathered = ds.gather_objects((skipped.files, skipped.invalid))
        files, invalid = set().union(*(g[0] for g in gathered)), set().union(*(g[1] for g in gathered))
        return [list(pair) for pair in sorted(files)], [list(pair) for pair in sorted(invalid)]

    def skipped_counts() -> dict[str, int]:
        files, invalid = skipped_everywhere()
        return {"skipped_files": len(files), "skipped_invalid_chips": len(invalid)}

    def save(step: int) -> None:
        files, invalid = skipped_everywhere()
        record = Progress.of(step, schedule.total_steps, cfg.train, world, skipped_files=files, skipped_invalid=invalid)
        checkpoints.save(engine, record, {"step": step})
        if metrics is not None:
            plot_loss_curve(metrics.read(), run_dir / "loss_curve.png", run_dir.name)
            write_reconstruction_figure(engine.module, pile, shown, cfg.data.bands, run_dir)

    loader = run_loader(pile, sampler, micro, cfg.data.num_workers, dev)

    def epoch_batches(epoch: int, done: int) -> Iterator[dict]:
        sampler.set_epoch(epoch)
        sampler.set_start(done * micro * accum)
        return _recording(iter(loader), skipped)

    loop = TrainLoop(
        engine,
        mim_forward(engine, teacher, dev, dtype),
        LOSS_KEYS,
        seed_of=lambda step: step_seed(cfg.run.seed, step, rank),
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
        record=skipped_counts,
        startup=startup,
        logger=log,
    )

    if step >= schedule.total_steps and rank == 0:
        export_student(cfg, engine.module, run_dir, step, final_metrics(metrics.read()))
    return run_dir


def export_student(
    cfg: PretrainConfig | FederatedConfig,
    model: MaskedImageModel,
    run_dir: Path,
    step: int,
    final: dict | None,
    extra: dict | None = None,
) -> Path:
    """Write the student backbone (timm layout) with its sidecar and model card next to the run.

    ``extra`` adds sidecar entries (a federated run's ``federation`` record).
    """
    metadata = {
        "method": "gfm" if cfg.teacher is not None else "simmim",
        "bands": list(cfg.data.bands),
        "gsd": gsd_range(s.gsd for s in cfg.data.sources),
        "img_size": cfg.model.img_size,
        "normalisation": {
            s.name: {"bands": list(s.bands), "scale": s.scale, "mean": list(s.mean), "std": list(s.std)}
            for s in cfg.data.sources
        },
        "data": [{"name": s.name, "root": str(s.root), "weight": s.weight, "gsd": s.gsd} for s in cfg.data.sources],
        "teacher": None
        if cfg.teacher is None
        else {"arch": cfg.teacher.arch, "checkpoint": str(cfg.teacher.checkpoint)},
        "steps": step,
        "metrics": final,
        "config": config_to_dict(cfg),
        **(extra or {}),
    }
    path = export_backbone(
        model.encoder, run_dir, arch=cfg.model.arch, create_kwargs=student_kwargs(cfg), metadata=metadata
    )
    log.info("exported backbone to %s", path)
    return path

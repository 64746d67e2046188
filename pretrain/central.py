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
from geofm.checkpoints.provenance import gsd_range
from geofm.config import PretrainConfig, config_to_dict
from geofm.config.federated import FederatedConfig
from geofm.data.pile import PileSampler, PretrainPile, SkippedFiles
from geofm.loop import Forward
from geofm.models.backbones import backbone_kwargs, create_backbone, prefer_fused_attention
from geofm.models.masking import MaskGenerator
from geofm.models.mim import MaskedImageModel, Tap, default_vit_tap
from geofm.models.teacher import FrozenTeacher, build_teacher, teacher_channels, teacher_dtype
from geofm.program import TrainingProgram
from geofm.reconstruction import shown_chips, write_reconstruction_figure
from geofm.runlog import LOSS_KEYS, final_metrics, plot_loss_curve
from geofm.tasks import StepOutput
from geofm.training import TRAIN_SCHEDULE_KEYS, InputPath, Progress, leave_cores_to_workers

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


class Pretraining(TrainingProgram):
    """Central pretraining through the program template; its objective, masked image modelling (GFM, or
    SimMIM without a teacher), is the methods of the section *objective*, which another pretraining
    objective replaces: the models (:meth:`build_models`, :meth:`place_models`), the pile's per-chip
    :meth:`mask_fn`, the :meth:`forward`, the figures (:meth:`prepare_figures`, :meth:`write_figures`)
    and the :meth:`export`."""

    invariants = RESUME_INVARIANTS
    schedule_keys = SCHEDULE_KEYS
    loss_keys = LOSS_KEYS
    log = log

    def inputs(self) -> list[InputPath]:
        return pretrain_inputs(self.cfg)

    def build(self) -> None:
        """The models, the pile of the configured sources with its sampler and schedule, and the engine."""
        cfg = self.cfg
        if self.device.type == "cpu":
            leave_cores_to_workers(cfg.data.num_workers)
        torch.manual_seed(cfg.run.seed)
        self.build_models()
        self.dataset = pile = PretrainPile(cfg.data, cfg.model.img_size, mask_fn=self.mask_fn())
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
        if self.rank == 0:
            self.prepare_figures()
        self.startup.lap("data_index")
        self.place_models()
        self.engine = ds.initialize(self.model, cfg.train, self.world, self.schedule)
        self.dtype = ds.compute_dtype(cfg.train)

    def resumed(self, progress: Progress, client_state: dict) -> None:
        self.skipped.update(progress.skipped_files, progress.skipped_invalid)

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
        self.write_figures()

    # ---- the objective: masked image modelling ------------------------------------------
    def build_models(self) -> None:
        """The frozen teacher (GFM) and the student with its mask token and decoder."""
        cfg = self.cfg
        self.teacher = build_teacher(cfg.teacher, cfg.data.teacher_band_indices) if cfg.teacher else None
        self.startup.lap("teacher")
        self.model = build_student(cfg)
        self.startup.lap("student")

    def mask_fn(self) -> MaskGenerator:
        """SimMIM's masks at the student's token grid, drawn for each chip the pile reads."""
        cfg = self.cfg
        return MaskGenerator(
            cfg.model.img_size, cfg.masking.mask_patch_size, self.model.patch_size, cfg.masking.mask_ratio
        )

    def place_models(self) -> None:
        """The device's attention kernel, and the teacher on the device at its precision."""
        prepare_models(self.model, self.teacher, self.cfg, self.device)

    def forward(self) -> Forward:
        return mim_forward(self.engine, self.teacher, self.device, self.dtype)

    def prepare_figures(self) -> None:
        """The fixed chips of the reconstruction figure (rank 0)."""
        self.shown = shown_chips(self.dataset, self.cfg.run.seed)

    def write_figures(self) -> None:
        """The reconstruction figure of the fixed chips, redrawn at each checkpoint."""
        write_reconstruction_figure(self.engine.module, self.dataset, self.shown, self.cfg.data.bands, self.run_dir)

    def finish(self) -> None:
        """Export the student's backbone (rank 0)."""
        if self.rank == 0:
            export_student(self.cfg, self.engine.module, self.run_dir, self.step, final_metrics(self.metrics.read()))


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

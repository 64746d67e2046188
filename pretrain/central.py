"""Central continual pretraining (SimMIM, plus GFM distillation when a teacher is configured).

One program for one CPU, one GPU or a cluster: launch it plainly, or with ``deepspeed`` /
``torchrun`` for several processes. A run directory holds ``config.yaml``, ``metrics.jsonl``,
``loss_curve.png``, ``checkpoints/step_*`` with ``checkpoints/last`` pointing at the newest, and,
once training ends, ``backbone.safetensors`` with its ``backbone.json`` sidecar. Running the same
config again resumes from ``checkpoints/last`` at the step it reached, with the same data order.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from torch.utils.data import DataLoader

from geofm import engine as ds
from geofm.checkpoints import export_backbone, load_backbone_for_bands
from geofm.checkpoints.infer import gsd_range
from geofm.checkpoints.io import LAST_CHECKPOINT as LAST
from geofm.config import PretrainConfig, config_to_dict
from geofm.errors import ConfigError, GeoFMError, RunInterrupted
from geofm.data.pile import PileSampler, PretrainPile
from geofm.models.backbones import backbone_kwargs, create_backbone
from geofm.models.masking import MaskGenerator
from geofm.models.mim import MaskedImageModel, Tap, default_vit_tap
from geofm.models.teacher import FrozenTeacher, build_teacher
from geofm.runlog import LOSS_KEYS, MetricsLog, Throughput, is_finite, plot_loss_curve, progress_bar

log = logging.getLogger("geofm.pretrain")


def student_kwargs(cfg: PretrainConfig) -> dict:
    """timm kwargs of the student backbone (recorded in the exported sidecar)."""
    m = cfg.model
    return backbone_kwargs(
        in_chans=len(cfg.data.bands), img_size=m.img_size, window_size=m.window_size, timm_kwargs=m.timm_kwargs
    )


def build_student(cfg: PretrainConfig, teacher: FrozenTeacher | None) -> MaskedImageModel:
    """Student backbone (random, or from ``model.init_checkpoint``) with mask token, decoder, projector."""
    encoder = create_backbone(cfg.model.arch, student_kwargs(cfg), drop_path_rate=cfg.model.drop_path_rate)
    if cfg.model.init_checkpoint is not None:
        report = load_backbone_for_bands(encoder, cfg.model.init_checkpoint, cfg.data.bands)
        log.info("student initialised from %s: %s", cfg.model.init_checkpoint, report)
    if teacher is None:
        return MaskedImageModel(encoder, len(cfg.data.bands))
    if cfg.model.family == "swin":
        tap = Tap(cfg.teacher.stage, cfg.teacher.include_merging)
    else:
        tap = Tap(cfg.model.distill_block) if cfg.model.distill_block else default_vit_tap(encoder)
    return MaskedImageModel(
        encoder, len(cfg.data.bands), tap, teacher.out_channels, cfg.teacher.alpha, cfg.teacher.distill_loss
    )


@dataclass
class _Interval:
    """Sums of the losses since the last log line."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOSS_KEYS, 0.0))
    count: int = 0

    def add(self, losses: dict[str, torch.Tensor]) -> None:
        for key in LOSS_KEYS:
            self.sums[key] += float(losses[key].detach())
        self.count += 1

    def means(self) -> dict[str, float]:
        values = ds.mean_across_ranks(torch.tensor([self.sums[k] / max(self.count, 1) for k in LOSS_KEYS]))
        self.sums, self.count = dict.fromkeys(LOSS_KEYS, 0.0), 0
        return dict(zip(LOSS_KEYS, values.tolist()))


class _Checkpoints:
    """Periodic DeepSpeed checkpoints, ``last`` pointing at the newest, old ones pruned."""

    def __init__(self, directory: Path, keep: int, rank: int) -> None:
        self.directory, self.keep, self.rank = directory, keep, rank

    def latest(self) -> Path | None:
        last = self.directory / LAST
        return last if last.exists() else None

    def save(self, engine, step: int, client_state: dict) -> None:
        tag = f"step_{step:07d}"
        ds.save_checkpoint(engine, self.directory, tag, client_state)
        ds.barrier()
        if self.rank == 0:
            link = self.directory / f".{LAST}.tmp"
            link.unlink(missing_ok=True)
            link.symlink_to(tag)
            os.replace(link, self.directory / LAST)
            for old in sorted(self.directory.glob("step_*"))[: -self.keep]:
                shutil.rmtree(old)
        ds.barrier()


# What a resumed run must share with the run that wrote its checkpoints.
RESUME_INVARIANTS = ("model", "masking", "teacher", "data.bands", "run.seed")


def _check_resumable(cfg: PretrainConfig, saved_config: Path) -> None:
    """Refuse to resume a run directory written by a different model, masking, teacher or bands.

    Training settings (epochs, learning rate...) may change between invocations.
    """
    if not saved_config.exists():
        return
    saved, current = yaml.safe_load(saved_config.read_text()), config_to_dict(cfg)
    for dotted in RESUME_INVARIANTS:
        a, b = saved, current
        for key in dotted.split("."):
            a, b = (a or {}).get(key), (b or {}).get(key)
        if a != b:
            raise ConfigError(
                f"{saved_config.parent} holds checkpoints of a run with another {dotted} ({a!r}, now {b!r}); "
                "resume with the same settings or choose a new run.output_dir"
            )


class _StopSignals:
    """SIGINT/SIGTERM become a stop request honoured at the next optimizer-step boundary.

    Cluster schedulers send SIGTERM before they kill a job; stopping between steps leaves the
    model and optimizer consistent for the checkpoint written on the way out. A second signal
    interrupts at once. Several processes agree on the request each step, so they stop together.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    def requested(self) -> bool:
        """Whether any process received a stop signal (a collective call when distributed)."""
        flag = torch.tensor([float(self.received is not None)])
        return bool(ds.max_across_ranks(flag))


def train_micro_step(engine, teacher: FrozenTeacher | None, batch: dict, dev: torch.device, dtype: torch.dtype) -> dict:
    """Forward and backward of one micro-batch; the engine steps the optimizer at accumulation boundaries."""
    images = batch["image"].to(dev, dtype, non_blocking=True)
    targets = teacher(images) if teacher is not None else None
    losses = engine(images, batch["mask"].to(dev, non_blocking=True), batch["valid"].to(dev, non_blocking=True), targets)
    engine.backward(losses["loss"])
    engine.step()
    return losses


def _step_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the global RNG (drop path) for one step: a pure function, so resumes match."""
    return (seed * 1_000_003 + step * 7_919 + rank) % 2**63


def pretrain(cfg: PretrainConfig) -> Path:
    """Run (or resume) pretraining as configured; return the run directory."""
    rank, world = ds.init_distributed()
    dev = ds.device()
    run_dir = cfg.run.output_dir
    checkpoints = _Checkpoints(run_dir / "checkpoints", cfg.run.keep_checkpoints, rank)
    if checkpoints.latest() is not None:
        _check_resumable(cfg, run_dir / "config.yaml")
    if rank == 0:
        checkpoints.directory.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))

    torch.manual_seed(cfg.run.seed)
    teacher = build_teacher(cfg.teacher, cfg.teacher_band_indices) if cfg.teacher else None
    model = build_student(cfg, teacher)
    masks = MaskGenerator(
        cfg.model.img_size, cfg.masking.mask_patch_size, model.patch_size, cfg.masking.mask_ratio
    )
    pile = PretrainPile(cfg.data, cfg.model.img_size, mask_fn=masks)
    sampler = PileSampler(
        pile.source_sizes, pile.weights, pile.samples_per_epoch, seed=cfg.run.seed, rank=rank, world_size=world
    )
    schedule = ds.make_schedule(cfg.train, pile.samples_per_epoch, world)
    engine = ds.initialize(model, cfg.train, world, schedule)
    dtype = torch.bfloat16 if ds.use_bf16(cfg.train) else torch.float32
    if teacher is not None:
        teacher.to(dev, dtype)

    step, skipped = 0, 0
    if checkpoints.latest() is not None:
        state = ds.load_checkpoint(engine, checkpoints.directory, LAST)
        step, skipped = state["step"], state["skipped_files"]
        if rank == 0:
            log.info("resumed from %s at step %d", checkpoints.latest().resolve(), step)
    stop_at = schedule.total_steps
    if cfg.run.stop_after_steps is not None:
        stop_at = min(stop_at, step + cfg.run.stop_after_steps)

    metrics = MetricsLog(run_dir / "metrics.jsonl", resume_step=step) if rank == 0 else None
    bar = progress_bar(schedule.total_steps, step, rank == 0 and cfg.run.progress, run_dir.name)
    interval, speed = _Interval(), Throughput()
    micro, accum = cfg.train.micro_batch_size, cfg.train.grad_accum_steps
    saved_step = step

    def client_state() -> dict:
        return {"step": step, "skipped_files": skipped}

    with _StopSignals() as stop:
        try:
            while step < stop_at:
                epoch, done = divmod(step, schedule.steps_per_epoch)
                sampler.set_epoch(epoch)
                sampler.set_start(done * micro * accum)
                batches = iter(
                    DataLoader(
                        pile,
                        batch_size=micro,
                        sampler=sampler,
                        num_workers=cfg.data.num_workers,
                        drop_last=True,
                        pin_memory=dev.type == "cuda",
                    )
                )
                for _ in range(done, schedule.steps_per_epoch):
                    torch.manual_seed(_step_seed(cfg.run.seed, step, rank))
                    for _ in range(accum):
                        batch = next(batches)
                        losses = train_micro_step(engine, teacher, batch, dev, dtype)
                        interval.add(losses)
                        speed.add(micro * world)
                        skipped += int(batch["skipped"].sum())
                    step += 1
                    bar.update(1)
                    if step % cfg.run.log_every == 0 or step == stop_at:
                        record = {
                            "step": step,
                            "epoch": round(step / schedule.steps_per_epoch, 4),
                            **interval.means(),
                            "lr": engine.get_lr()[0],
                            "images_per_s": round(speed.rate(), 2),
                            "skipped_files": skipped,
                        }
                        if not is_finite(record):
                            raise FloatingPointError(
                                f"step {step}: loss is not finite ({record}); "
                                f"checkpoints up to step {saved_step} are intact"
                            )
                        if metrics is not None:
                            metrics.write(record)
                            bar.set_postfix(loss=f"{record['loss']:.4f}", img_s=f"{record['images_per_s']:.1f}")
                    stopping = stop.requested()
                    if step % cfg.run.checkpoint_every == 0 or step == stop_at or stopping:
                        checkpoints.save(engine, step, client_state())
                        saved_step = step
                        if metrics is not None:
                            plot_loss_curve(metrics.read(), run_dir / "loss_curve.png", run_dir.name)
                        speed.restart()
                    if stopping:
                        name = signal.Signals(stop.received).name if stop.received else "another process"
                        raise RunInterrupted(
                            f"stopped by {name} at step {step}; saved a checkpoint, rerun the same command to resume"
                        )
                    if step >= stop_at:
                        break
        except (GeoFMError, OSError):
            # Bad input met between steps: keep the progress. One process can save alone; several
            # would wait on each other in the collective save, so they rely on periodic checkpoints.
            if world == 1 and step > saved_step:
                checkpoints.save(engine, step, client_state())
                log.warning("stopped at step %d: saved a checkpoint; fix the input and rerun to resume", step)
            raise
        finally:
            bar.close()

    if step >= schedule.total_steps and rank == 0:
        records = metrics.read()
        _export(cfg, engine.module, run_dir, step, records[-1] if records else None)
    return run_dir


def _export(cfg: PretrainConfig, model: MaskedImageModel, run_dir: Path, step: int, final: dict | None) -> Path:
    """Write the student backbone (timm layout) with its sidecar and model card next to the run."""
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
        "teacher": None if cfg.teacher is None else {"arch": cfg.teacher.arch, "checkpoint": str(cfg.teacher.checkpoint)},
        "steps": step,
        "metrics": final,
        "config": config_to_dict(cfg),
    }
    path = export_backbone(model.encoder, run_dir, arch=cfg.model.arch, create_kwargs=student_kwargs(cfg), metadata=metadata)
    log.info("exported backbone to %s", path)
    return path
